"""HF-style sharded safetensors checkpoints: a streaming writer and a zero-copy mmap reader.

Layout of a checkpoint directory:
  config.json                      HF DeepseekV3 config (model_type deepseek_v3)
  model.safetensors.index.json     {"metadata": {"total_size": N, "sha256": {shard file: hex}},
                                    "weight_map": {tensor: shard file}}
  model-0000i-of-0000n.safetensors one shard per group of tensors (a decoder layer, or the top-level tensors)

The index records each shard's sha256 when it is written; the reader checks a shard against it when
it first maps it, so a shard changed in place (same name, same timestamp) is an error naming it,
never silently read.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np
from safetensors.numpy import save_file

from .digests import sha256_bytes, sha256_file
from .errors import K2VecError

INDEX_NAME = "model.safetensors.index.json"
DIGESTS_KEY = "sha256"  # index["metadata"][DIGESTS_KEY]: {shard file: sha256}
_VERIFIED: dict[tuple[int, ...], str] = {}  # (dev, inode, size, mtime, ctime) -> sha256 of shards hashed
_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "BF16": np.uint16, "I32": np.int32,
              "I64": np.int64, "U8": np.uint8, "I8": np.int8, "F16": np.float16}


class CheckpointError(K2VecError):
    pass


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(out_dir: Path, shards: Iterable[Iterable[tuple[str, np.ndarray]]], count: int) -> dict:
    """Write `count` shards, each from an iterable of (name, array), holding one shard in memory at a time.

    Returns the index dict (also written to `out_dir`)."""
    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    total = 0
    written = 0
    for i, tensors in enumerate(shards):
        fname = shard_name(i, count)
        arrays = {name: np.ascontiguousarray(arr) for name, arr in tensors}
        for name, arr in arrays.items():
            if name in weight_map:
                raise CheckpointError(f"tensor {name} written twice")
            weight_map[name] = fname
            total += arr.nbytes
        save_file(arrays, str(out_dir / fname), metadata={"format": "pt"})
        del arrays
        digests[fname] = sha256_file(out_dir / fname)  # just written: read back from the page cache
        written += 1
    if written != count:
        raise CheckpointError(f"expected {count} shards, wrote {written}")
    index = {"metadata": {"total_size": total, DIGESTS_KEY: digests},
             "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _read_header(path: Path, mm: mmap.mmap) -> tuple[dict, int]:
    size = len(mm)
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(mm[:8], "little")
    if n > size - 8:
        raise CheckpointError(f"{path}: header length {n} at offset 0 runs past the end ({size} bytes)")
    header = json.loads(bytes(mm[8 : 8 + n]))
    header.pop("__metadata__", None)
    return header, 8 + n


class Checkpoint(Mapping[str, np.ndarray]):
    """Read-only mapping tensor name -> numpy view into the mmapped shard (no copy).

    Each shard is checked against the sha256 its index records before any tensor of it is handed out.
    `verify=False` is for checkpoints that k2vec did not write (transformers' save_pretrained records
    no hashes)."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        if not index_path.exists():
            raise CheckpointError(f"{self.directory}: no {INDEX_NAME}; not a checkpoint directory")
        self.config = json.loads((self.directory / "config.json").read_text())
        index = json.loads(index_path.read_text())
        self.weight_map: dict[str, str] = index["weight_map"]
        self.digests: dict[str, str] | None = None
        if verify:
            self.digests = index.get("metadata", {}).get(DIGESTS_KEY)
            unrecorded = sorted(set(self.weight_map.values()) - set(self.digests or {}))
            if unrecorded:
                raise CheckpointError(f"{index_path}: no sha256 recorded for shard(s) {unrecorded[:3]}; this "
                                      f"checkpoint cannot be verified (rebuild it with the weights stage)")
        self._maps: dict[str, tuple[mmap.mmap, dict, int]] = {}

    def _shard(self, fname: str) -> tuple[mmap.mmap, dict, int]:
        if fname not in self._maps:
            path = self.directory / fname
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                st = os.fstat(fh.fileno())
            # A file is hashed once per process: any write to it since would have moved its ctime.
            seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if self.digests is not None and _VERIFIED.get(seen) != self.digests[fname]:
                got = sha256_bytes(mm)  # the mapped bytes themselves: what is checked is what is read
                _VERIFIED[seen] = got
                if got != self.digests[fname]:
                    mm.close()
                    raise CheckpointError(f"{path}: sha256 {got} differs from the one {INDEX_NAME} recorded when "
                                          f"the shard was written ({self.digests[fname]}): the shard changed "
                                          f"since; rebuild the checkpoint (delete {self.directory})")
            header, base = _read_header(path, mm)
            self._maps[fname] = (mm, header, base)
        return self._maps[fname]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(name)
        mm, header, base = self._shard(self.weight_map[name])
        info = header[name]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or base + end > len(mm):
            raise CheckpointError(f"{self.weight_map[name]}: tensor {name} has inconsistent offsets")
        arr = np.frombuffer(mm, dtype=dtype, count=count, offset=base + begin)
        return arr.reshape(info["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)
