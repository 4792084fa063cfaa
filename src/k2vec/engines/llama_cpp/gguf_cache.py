"""The bundle as a GGUF file: an HF checkpoint written from the bundle, converted by llama.cpp's converter,
kept in the engine's cache directory under a key of the bundle's digest.

The checkpoint is what the `weights` stage writes (config.json = the bundle's `hf_config`, one safetensors
shard per decoder layer, k2vec.model.checkpoint), with the DeepSeek-V3 per-expert tensor names the converter
reads; INT4 weights are dequantized to float32 by the numpy engine's BundleWeights, the values the golden is
computed on. Greedy and score runs of one bundle, and every later run of it, share one conversion: the file is
`$XDG_CACHE_HOME/k2vec-llama-cpp/<key>.gguf` (a sandboxed run's XDG_CACHE_HOME is results/cache/<engine>),
written under its final name only when complete, and made once at a time (a lock file per key).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from k2vec.atomic import atomic_directory, atomic_file
from k2vec.digests import sha256_file
from k2vec.engines.numpy_engine import BundleWeights
from k2vec.errors import K2VecError
from k2vec.model.checkpoint import shard_groups, write_shards
from k2vec.pipeline.code_digest import PACKAGE_DIR, code_digest, module_sources

CACHE_NAME = "k2vec-llama-cpp"


class ConversionError(K2VecError):
    """The bundle could not be made into a GGUF file."""


def write_hf_checkpoint(bundle, out_dir: Path) -> None:
    """The bundle's model as an HF checkpoint directory (float32; INT4 weights dequantized)."""
    meta = bundle.metadata
    cfg = meta["hf_config"]
    weights = BundleWeights(bundle, meta["quantization"])
    groups = shard_groups(cfg)
    for name in (n for g in groups for n in g):
        if name not in weights.quantized and name not in bundle:
            raise ConversionError(f"bundle has no tensor {name!r}, which its hf_config's architecture needs")

    def shard(names: list[str]):
        for name in names:
            yield name, np.ascontiguousarray(weights[name], dtype=np.float32)
            weights.release(name)

    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        write_shards(tmp, (shard(g) for g in groups), len(groups))


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


def cache_dir() -> Path | None:
    """$XDG_CACHE_HOME (else ~/.cache)/k2vec-llama-cpp, made if need be; None where it cannot be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / CACHE_NAME
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def cache_key(bundle_sha256: str, variant: str, converter: dict, modules: tuple[str, ...]) -> str:
    """The file name of a conversion: the bundle's sha256, the variant (`f32`, `q4_0`), the converter's
    identity (its manifest: llama-cpp-python version, llama.cpp commit, sdist sha256) and the meaning of
    this package's code that writes it (k2vec.pipeline.code_digest), so an edit to either converts anew."""
    code = code_digest(module_sources(*modules), str(PACKAGE_DIR))
    h = hashlib.sha256(json.dumps([bundle_sha256, variant, converter, code], sort_keys=True).encode())
    return f"{bundle_sha256[:16]}-{variant}-{h.hexdigest()[:16]}.gguf"


def cached(bundle_path: str | os.PathLike, variant: str, build: Callable[[Path], None], converter: dict,
           modules: tuple[str, ...] = (__name__,)) -> tuple[Path, bool]:
    """(the GGUF file of `variant`, whether it was already there): `build(path)` writes it, once per key
    (cache_key: `converter` is the converter's manifest, `modules` the code that writes the file); without a
    writable cache directory it is built in TMPDIR for this run only."""
    root = cache_dir()
    if root is None:
        out = Path(tempfile.mkdtemp(prefix="k2vec-gguf-")) / f"{variant}.gguf"
        print(f"k2vec llama_cpp: no writable cache directory (XDG_CACHE_HOME); converting into {out}",
              file=sys.stderr)
        build(out)
        return out, False
    final = root / cache_key(sha256_file(bundle_path), variant, converter, modules)
    if final.is_file():
        return final, True
    with open(root / (final.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a concurrent run of the same bundle waits, then finds the file
        if final.is_file():
            return final, True
        # Temporaries of this name are a killed writer's (the lock is ours): they would only take space.
        for stale in root.glob(f".{final.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        with atomic_file(final) as tmp:
            build(tmp)
    return final, False
