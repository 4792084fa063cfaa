"""A bundle's model as an HF checkpoint, and the engine cache that keeps what an engine derives from a bundle.

Engines that load a model from files (llama.cpp a GGUF file, vLLM an HF checkpoint directory) make them from
the bundle alone: `write_hf_checkpoint` writes the checkpoint the `weights` stage writes (config.json = the
bundle's `hf_config`, one safetensors shard per decoder layer, k2vec.model.checkpoint, DeepSeek-V3's
per-expert tensor names), INT4 weights dequantized to float32 by the numpy engine's BundleWeights (the values
the golden is computed on). `cached` keeps one such file or directory per bundle, variant and code in
`$XDG_CACHE_HOME/<engine cache>/` (a sandboxed run's XDG_CACHE_HOME is results/cache/<engine>), written under
its final name only when complete, and made once at a time (a lock file per key), so the runs of one bundle,
and every later run of it, share one conversion; of one bundle file's derivations of a variant, the two last
used are kept.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from k2vec.atomic import atomic_directory, atomic_file
from k2vec.digests import sha256_file
from k2vec.engines.numpy_engine import BundleWeights
from k2vec.entry_store import cache_dir
from k2vec.errors import K2VecError
from k2vec.model.checkpoint import shard_groups, write_shards
from k2vec.pipeline.code_digest import PACKAGE_DIR, code_digest, module_sources


KEEP_PER_SLOT = 2


class CheckpointError(K2VecError):
    """The bundle lacks a tensor its architecture needs, so no checkpoint can be written from it."""


def write_hf_checkpoint_into(bundle, directory: Path) -> None:
    """The bundle's model as HF checkpoint files in the existing, empty `directory` (float32; INT4 dequantized)."""
    meta = bundle.metadata
    cfg = meta["hf_config"]
    weights = BundleWeights(bundle, meta["quantization"])
    groups = shard_groups(cfg)
    for name in (n for g in groups for n in g):
        if name not in weights.quantized and name not in bundle:
            raise CheckpointError(f"bundle has no tensor {name!r}, which its hf_config's architecture needs")

    def shard(names: list[str]):
        for name in names:
            yield name, np.ascontiguousarray(weights[name], dtype=np.float32)
            weights.release(name)

    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_shards(directory, (shard(g) for g in groups), len(groups))


def write_hf_checkpoint(bundle, out_dir: Path) -> None:
    """The bundle's model as an HF checkpoint directory `out_dir`, written whole or not at all."""
    with atomic_directory(out_dir) as tmp:
        write_hf_checkpoint_into(bundle, tmp)


def cache_key(bundle_path: str | os.PathLike, bundle_sha256: str, variant: str, identity: dict,
              modules: tuple[str, ...], suffix: str) -> str:
    """The name of a derived file or directory: `<bundle file's stem>-<variant>-<digest><suffix>`, the digest over
    the bundle's sha256, the variant (`f32`, `q4_0`, `hf-f32`), the identity of the third-party code that reads or
    converts it (a converter's manifest, a library's version) and the meaning of this package's code that writes
    it (k2vec.pipeline.code_digest), so an edit to either makes it anew."""
    code = code_digest(module_sources(*modules), str(PACKAGE_DIR))
    h = hashlib.sha256(json.dumps([bundle_sha256, variant, identity, code], sort_keys=True).encode())
    return f"{_slot(bundle_path, variant)}{h.hexdigest()[:16]}{suffix}"


def _slot(bundle_path: str | os.PathLike, variant: str) -> str:
    """What the names of one bundle file's derivations of one variant start with."""
    return f"{Path(bundle_path).name.removesuffix('.kdtr')}-{variant}-"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def cached(name: str, bundle_path: str | os.PathLike, variant: str, build: Callable[[Path], None], identity: dict,
           modules: tuple[str, ...], suffix: str = "", directory: bool = False) -> tuple[Path, bool]:
    """(the derived file, or directory with `directory`, of `variant` in the cache `name`; whether it was already
    there): `build(path)` writes it, once per key (cache_key); a directory's `build` gets an empty directory.
    Without a writable cache directory it is built in TMPDIR for this run only."""
    root = cache_dir(name)
    if root is None:
        out = Path(tempfile.mkdtemp(prefix=f"{name}-")) / f"{variant}{suffix}"
        print(f"k2vec {name}: no writable cache directory (XDG_CACHE_HOME); writing {out} for this run",
              file=sys.stderr)
        if directory:
            out.mkdir()
        build(out)
        return out, False
    final = root / cache_key(bundle_path, sha256_file(bundle_path), variant, identity, modules, suffix)
    if final.exists():
        try:
            os.utime(final)   # its last use, which `_keep_latest` goes by
        except OSError:   # not ours to touch: it is still the file to use
            pass
        return final, True
    with open(root / (final.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a concurrent run of the same bundle waits, then finds it
        if final.exists():
            return final, True
        # Temporaries of this name are a killed writer's (the lock is ours): they would only take space.
        for stale in root.glob(f".{final.name}.*.tmp"):
            _remove(stale)
        with (atomic_directory if directory else atomic_file)(final) as tmp:
            build(tmp)
    _keep_latest(root, _slot(bundle_path, variant), suffix)
    return final, False


def _keep_latest(root: Path, slot: str, suffix: str) -> None:
    """Remove all but the KEEP_PER_SLOT last used derivations of one bundle file and variant: each edit of the
    bundle, of the converter or of the code that writes them makes a new one, and the old ones would only take
    space (two, so that switching between two configs or converters does not convert on every switch)."""
    name = re.compile(re.escape(slot) + "[0-9a-f]{16}" + re.escape(suffix))   # not its lock file
    entries = sorted((p for p in root.iterdir() if name.fullmatch(p.name)), key=lambda p: p.stat().st_mtime,
                     reverse=True)
    for old in entries[KEEP_PER_SLOT:]:
        _remove(old)
        (root / (old.name + ".lock")).unlink(missing_ok=True)
