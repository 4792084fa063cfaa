"""HF-style sharded safetensors checkpoints: a streaming writer and a zero-copy mmap reader.

Layout of a checkpoint directory:
  config.json                      HF DeepseekV3 config (model_type deepseek_v3)
  model.safetensors.index.json     {"metadata": {"total_size": N, "sha256": {shard file: hex}},
                                    "weight_map": {tensor: shard file}}
  model-0000i-of-0000n.safetensors one shard per group of tensors (a decoder layer, or the top-level tensors)

The index records each shard's sha256 when it is written; the reader checks a shard against it when
it first maps it, so a shard changed in place (same name, same timestamp) is an error naming it,
never silently read.

Memory at real K2 widths (a K2 MoE layer is 17 GB): the writer takes tensors as chunk streams
(`StreamedTensor`) and hashes what it writes, so it never holds more than a chunk; the reader maps each
tensor on its own, so a tensor's pages leave the process (and its RSS) when the caller drops the array,
and hashes a shard through bounded windows.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from k2vec.errors import K2VecError
from k2vec.model.architecture import tensor_shapes

INDEX_NAME = "model.safetensors.index.json"
DIGESTS_KEY = "sha256"  # index["metadata"][DIGESTS_KEY]: {shard file: sha256}
_VERIFIED: dict[tuple[int, ...], str] = {}  # (dev, inode, size, mtime, ctime) -> sha256 of shards hashed
_ST_DTYPES = {"F32": np.float32, "F64": np.float64, "BF16": np.uint16, "I32": np.int32,
              "I64": np.int64, "U8": np.uint8, "I8": np.int8, "F16": np.float16}
_NUMPY_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items() if k != "BF16"}
_HASH_WINDOW = 1 << 26  # bytes of a shard mapped at once while hashing it
_WRITE_CHUNK = 1 << 24


class CheckpointError(K2VecError):
    pass


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor to write without holding it: `chunks()` yields its C-order bytes as arrays (any split)."""

    dtype: str                 # safetensors dtype: F32, BF16, I32, ...
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[self.dtype]).itemsize


def streamed(arr: np.ndarray) -> StreamedTensor:
    """An in-memory array as a StreamedTensor (one chunk)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in _NUMPY_TO_ST:
        raise CheckpointError(f"dtype {arr.dtype} has no safetensors code")
    return StreamedTensor(_NUMPY_TO_ST[arr.dtype], tuple(arr.shape), lambda: (arr,))


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors(path: Path, tensors: Mapping[str, StreamedTensor]) -> tuple[int, str]:
    """One safetensors file, tensor by tensor and chunk by chunk (data in name order); returns
    (data bytes, sha256 of the file as written)."""
    names = sorted(tensors)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as the safetensors writer pads it
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for part in (len(head).to_bytes(8, "little"), head):
            fh.write(part)
            digest.update(part)
        for name in names:
            t, written = tensors[name], 0
            for chunk in t.chunks():
                data = memoryview(np.ascontiguousarray(chunk)).cast("B")
                for i in range(0, data.nbytes, _WRITE_CHUNK):
                    fh.write(data[i:i + _WRITE_CHUNK])
                digest.update(data)
                written += data.nbytes
                del data, chunk
            if written != t.nbytes:
                raise CheckpointError(f"{path.name}: tensor {name} produced {written} bytes, its dtype {t.dtype} "
                                      f"and shape {list(t.shape)} need {t.nbytes}")
    return offset, digest.hexdigest()


def write_shards(out_dir: Path, shards: Iterable[Iterable[tuple[str, np.ndarray | StreamedTensor]]],
                 count: int) -> dict:
    """Write `count` shards, each from an iterable of (name, array or StreamedTensor); a StreamedTensor
    is produced chunk by chunk while it is written, so memory stays at one chunk.

    Returns the index dict (also written to `out_dir`)."""
    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    total = 0
    written = 0
    for i, tensors in enumerate(shards):
        fname = shard_name(i, count)
        specs: dict[str, StreamedTensor] = {}
        for name, value in tensors:
            if name in weight_map or name in specs:
                raise CheckpointError(f"tensor {name} written twice")
            specs[name] = value if isinstance(value, StreamedTensor) else streamed(value)
            weight_map[name] = fname
        size, digests[fname] = write_safetensors(out_dir / fname, specs)
        total += size
        del specs
        written += 1
    if written != count:
        raise CheckpointError(f"expected {count} shards, wrote {written}")
    index = {"metadata": {"total_size": total, DIGESTS_KEY: digests},
             "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def shard_groups(model: dict[str, Any]) -> list[list[str]]:
    """Tensor names per shard: one shard per decoder layer, then one for the top-level tensors.

    A shard is the unit held in memory, so memory stays at one layer's weights."""
    names = list(tensor_shapes(model))
    layers: list[list[str]] = [[] for _ in range(model["num_hidden_layers"])]
    top: list[str] = []
    for n in names:
        if n.startswith("model.layers."):
            layers[int(n.split(".")[2])].append(n)
        else:
            top.append(n)
    return layers + [top]


# Bytes per element of every safetensors dtype (those without a numpy type too: their offsets are
# checked all the same). A header is at most 100 MB, safetensors' own limit.
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100_000_000
_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def check_header(path: Path, tensors: Mapping[str, Any], data_size: int,
                 error: type[Exception] = CheckpointError) -> None:
    """`error` naming `path` and the tensor at fault, unless every entry of a safetensors header's
    `tensors` (__metadata__ left out) is an object with a string dtype, a shape of non-negative
    integers and data_offsets [begin, end] of integers whose length fits dtype and shape, and the
    tensors' byte ranges tile the data section [0, data_size) exactly: no overlap, no gap, nothing past
    its end or after the last tensor (as the safetensors library itself requires)."""
    spans = []
    for name, e in tensors.items():
        where = f"{path}: tensor {name}"
        if not isinstance(e, dict):
            raise error(f"{where}: its header entry is a JSON {_json_type(e)}, not an object with dtype, shape "
                        f"and data_offsets")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(dtype, str):
            raise error(f"{where}: dtype {dtype!r} is not a string such as \"BF16\"")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise error(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise error(f"{where}: data_offsets {offsets!r} is not [begin, end], two integers with "
                        f"0 <= begin <= end")
        begin, end = offsets
        if dtype in ST_ITEMSIZE and end - begin != math.prod(shape) * ST_ITEMSIZE[dtype]:
            raise error(f"{where}: data_offsets {offsets} hold {end - begin} bytes, its dtype {dtype} and shape "
                        f"{shape} need {math.prod(shape) * ST_ITEMSIZE[dtype]}")
        spans.append((begin, end, name))
    at, last = 0, None
    for begin, end, name in sorted(spans):
        if begin < at:
            raise error(f"{path}: tensor {name} (data bytes [{begin}, {end})) overlaps tensor {last} (which ends "
                        f"at {at}): two tensors would share bytes")
        if begin > at:
            raise error(f"{path}: tensor {name} starts at data byte {begin}, but "
                        f"{f'tensor {last} ends' if last else 'the data starts'} at {at}: {begin - at} bytes "
                        f"between them belong to no tensor")
        at, last = end, name
    if at > data_size:
        raise error(f"{path}: tensor {last} has data_offsets ending at {at}, past the file's {data_size} data "
                    f"bytes (truncated or corrupt shard)")
    if at < data_size:
        raise error(f"{path}: the last {data_size - at} of its {data_size} data bytes belong to no tensor "
                    f"(the last, {last}, ends at {at})")


def read_header(path: Path, fh, wanted: str | None = None,
                error: type[Exception] = CheckpointError) -> tuple[dict[str, dict], int, int]:
    """(tensors of the header: name -> {dtype, shape, data_offsets}, offset of the data, file size) of
    an open safetensors file, every field checked (check_header); `error` naming the file, and the
    tensor at fault or else `wanted` (the one the caller reads), otherwise."""
    size = os.fstat(fh.fileno()).st_size
    hold = f"; it should hold {wanted}" if wanted else ""
    fh.seek(0)
    head = fh.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or 8 + n > size or n > MAX_HEADER_BYTES:
        raise error(f"{path}: not a safetensors file (header length {n}, file {size} bytes){hold}")
    try:
        header = json.loads(fh.read(n), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as err:
        raise error(f"{path}: safetensors header is not valid JSON ({err}){hold}") from None
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is a JSON {_json_type(header)}, not an object{hold}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    check_header(path, tensors, size - 8 - n, error)
    return tensors, 8 + n, size


def check_weight_map(index: Any, path: Path, error: type[Exception] = CheckpointError) -> dict[str, str]:
    """The weight_map of a parsed model.safetensors.index.json at `path`: tensor name -> a shard's file
    name inside the checkpoint directory; `error` naming the file (and the tensor) otherwise."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        what = "an object" if isinstance(index, dict) else f"a JSON {_json_type(index)}"
        raise error(f"{path}: not a safetensors index ({what} without a weight_map object)")
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname or os.path.isabs(fname) or ".." in Path(fname).parts:
            raise error(f"{path}: weight_map maps tensor {name} to {fname!r}, not the file name of a shard in "
                        f"the checkpoint directory")
    return weight_map


def _file_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_mapped(fh, size: int) -> str:
    """sha256 of the file through mapped windows (the mapped bytes are what readers get), each unmapped
    before the next: the pages hashed do not accumulate in this process."""
    h = hashlib.sha256()
    for start in range(0, size, _HASH_WINDOW):
        with mmap.mmap(fh.fileno(), min(_HASH_WINDOW, size - start), access=mmap.ACCESS_READ, offset=start) as mm:
            h.update(mm)
    return h.hexdigest()


class Checkpoint(Mapping[str, np.ndarray]):
    """Read-only mapping tensor name -> numpy view of the tensor's own read-only mmap (no copy): its
    pages stay mapped only while the caller holds the array.

    Each shard is checked against the sha256 its index records before any tensor of it is handed out
    (and again if the file changes while open). `verify=False` is for checkpoints that k2vec did not
    write (transformers' save_pretrained records no hashes)."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        if not index_path.exists():
            raise CheckpointError(f"{self.directory}: no {INDEX_NAME}; not a checkpoint directory")
        self.config = json.loads((self.directory / "config.json").read_text())
        index = json.loads(index_path.read_text())
        self.weight_map: dict[str, str] = check_weight_map(index, index_path)
        self.digests: dict[str, str] | None = None
        if verify:
            self.digests = index.get("metadata", {}).get(DIGESTS_KEY)
            unrecorded = sorted(set(self.weight_map.values()) - set(self.digests or {}))
            if unrecorded:
                raise CheckpointError(f"{index_path}: no sha256 recorded for shard(s) {unrecorded[:3]}; this "
                                      f"checkpoint cannot be verified (rebuild it with the weights stage)")
        self._headers: dict[str, tuple[dict, int, int]] = {}

    def _verify(self, fname: str, path: Path, fh) -> None:
        # A file is hashed once per process: any write to it since would have moved its ctime.
        key = _file_key(os.fstat(fh.fileno()))
        if self.digests is None or _VERIFIED.get(key) == self.digests[fname]:
            return
        got = _hash_mapped(fh, key[2])
        _VERIFIED[key] = got
        if got != self.digests[fname]:
            raise CheckpointError(f"{path}: sha256 {got} differs from the one {INDEX_NAME} recorded when "
                                  f"the shard was written ({self.digests[fname]}): the shard changed "
                                  f"since; rebuild the checkpoint (delete {self.directory})")

    def info(self, name: str) -> tuple[np.dtype, list[int]]:
        """(dtype, shape) of a tensor, from its shard's header (no data read)."""
        fname = self.weight_map[name]
        if fname not in self._headers:
            path = self.directory / fname
            with open(path, "rb") as fh:
                self._verify(fname, path, fh)
                self._headers[fname] = read_header(path, fh, name)
        header = self._headers[fname][0]
        if name not in header:
            raise CheckpointError(f"{self.directory / fname}: tensor {name}, listed in {INDEX_NAME}, is not in "
                                  f"the shard's header")
        if header[name]["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.directory / fname}: tensor {name} has dtype {header[name]['dtype']}, "
                                  f"not one of {sorted(_ST_DTYPES)}")
        return np.dtype(_ST_DTYPES[header[name]["dtype"]]), header[name]["shape"]

    def shape_of(self, name: str) -> list[int]:
        return self.info(name)[1]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(name)
        fname = self.weight_map[name]
        dtype, shape = self.info(name)
        header, base, size = self._headers[fname]
        begin, end = header[name]["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        path = self.directory / fname
        if end - begin != count * dtype.itemsize or base + end > size:
            raise CheckpointError(f"{path}: tensor {name} has inconsistent offsets [{begin}, {end}) for "
                                  f"{count} x {dtype} after a {base}-byte header in a {size}-byte file")
        if count == 0:
            return np.empty(shape, dtype)
        start = base + begin
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as fh:
            self._verify(fname, path, fh)  # no-op unless the file changed since it was hashed
            mm = mmap.mmap(fh.fileno(), base + end - aligned, access=mmap.ACCESS_READ, offset=aligned)
        return np.frombuffer(mm, dtype=dtype, count=count, offset=start - aligned).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)
