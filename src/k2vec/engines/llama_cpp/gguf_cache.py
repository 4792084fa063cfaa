"""The bundle as a GGUF file: the bundle's HF checkpoint (k2vec.engines.checkpoint_cache: float32, INT4
dequantized, DeepSeek-V3's per-expert names as the converter reads them) converted by llama.cpp's converter, kept
in the engine cache: `$XDG_CACHE_HOME/k2vec-llama-cpp/<key>.gguf`, one conversion shared by the greedy and score
runs of a bundle and every later run of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from k2vec.engines import checkpoint_cache
from k2vec.engines.checkpoint_cache import write_hf_checkpoint
from k2vec.errors import K2VecError

CACHE_NAME = "k2vec-llama-cpp"


class ConversionError(K2VecError):
    """The bundle could not be made into a GGUF file."""


def convert(tree: Path, model_dir: Path, out: Path, outtype: str = "f32") -> None:
    """llama.cpp's converter (directory `tree`) on `model_dir`, writing `out`; its log goes to our stderr."""
    cmd = [sys.executable, "-m", "k2vec.engines.llama_cpp.vocabless", str(tree), str(model_dir), str(out),
           "--outtype", outtype]
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(res.stderr)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConversionError(f"llama.cpp's converter exited with code {res.returncode} on {model_dir}: {last}")


def convert_bundle(bundle, tree: Path, out: Path) -> None:
    """The bundle as a float32 GGUF at `out`, through an HF checkpoint in a temporary directory; `tree`: the
    converter's directory (converter.find_tree)."""
    with tempfile.TemporaryDirectory(prefix="k2vec-hf-") as tmp:
        model_dir = Path(tmp) / "checkpoint"
        write_hf_checkpoint(bundle, model_dir)
        convert(tree, model_dir, out)


def cached(bundle_path: str | os.PathLike, variant: str, build: Callable[[Path], None], converter: dict,
           modules: tuple[str, ...] = (__name__, checkpoint_cache.__name__)) -> tuple[Path, bool]:
    """(the GGUF file of `variant`, whether it was already there): `build(path)` writes it, once per key
    (checkpoint_cache.cache_key: `converter` is the converter's manifest, `modules` the code that writes it)."""
    return checkpoint_cache.cached(CACHE_NAME, bundle_path, variant, build, converter, modules, suffix=".gguf")
