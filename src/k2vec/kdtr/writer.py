"""Streaming, atomic KDTR writer."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Union

import numpy as np

from k2vec.atomic import atomic_file
from k2vec.kdtr.format import (
    DEFAULT_ALIGNMENT,
    DTYPE_CODES,
    DTYPES,
    ENTRY,
    HEADER,
    HEADER_CRC_SPAN,
    HEADER_SIZE,
    MAGIC,
    MAX_ALIGNMENT,
    MAX_DIR_SIZE,
    MAX_RANK,
    MIN_ALIGNMENT,
    PACKING_CODES,
    PACKING_DTYPES,
    VERSION,
    KdtrError,
    TensorInfo,
    align_up,
    dump_metadata,
    element_count,
    entry_size,
    name_problem,
)

ArrayLike = Union[np.ndarray, Callable[[], np.ndarray]]


@dataclass(frozen=True)
class TensorData:
    """A tensor value with storage options: `dtype='bf16'` stores a uint16 array as bf16 bits;
    `packing='int4'` marks a u8 array of packed nibbles. `value` may be a zero-argument callable."""

    value: Any
    dtype: str | None = None
    packing: str = ""


def bf16(value: ArrayLike) -> TensorData:
    """Store `value` (uint16 bf16 bits, or a callable returning them) as dtype bf16."""
    return TensorData(value, dtype="bf16")


def int4(value: ArrayLike) -> TensorData:
    """Store `value` (u8 bytes in docs/int4-format.md's int4-offset8-lownibble-first layout, or a
    callable returning them) with packing int4."""
    return TensorData(value, dtype="u8", packing="int4")


_NUMPY_TO_KDTR = {np.dtype(npdt).newbyteorder("<"): name
                  for name, npdt in DTYPES.values() if name != "bf16"}


def _to_storage(name: str, td: TensorData) -> tuple[np.ndarray, str]:
    value = td.value() if callable(td.value) else td.value
    if isinstance(value, np.generic):  # numpy scalar -> 0-d array
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise KdtrError(None, f"tensor {name!r}",
                        f"value is a {type(value).__name__}; pass a numpy array or a callable returning one")
    arr = value
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype.name == "bfloat16":  # ml_dtypes, if the caller uses it
        arr, natural = arr.view(np.uint16), "bf16"
    else:
        natural = _NUMPY_TO_KDTR.get(arr.dtype.newbyteorder("<"))
    want = td.dtype or natural
    if want is None:
        raise KdtrError(None, f"tensor {name!r}", f"unsupported numpy dtype {arr.dtype}")
    if want not in DTYPE_CODES:
        raise KdtrError(None, f"tensor {name!r}", f"unknown KDTR dtype {want!r}")
    if want != natural and not (want == "bf16" and natural == "u16"):
        raise KdtrError(None, f"tensor {name!r}",
                        f"array of numpy dtype {arr.dtype} cannot be stored as {want}")
    if td.packing and PACKING_DTYPES.get(td.packing) != want:
        raise KdtrError(None, f"tensor {name!r}", f"packing {td.packing!r} needs dtype "
                        f"{PACKING_DTYPES.get(td.packing)}, got {want}")
    if td.packing and arr.ndim == 0:
        raise KdtrError(None, f"tensor {name!r}", f"packing {td.packing!r} packs the last dimension; got a 0-d array")
    if arr.ndim > MAX_RANK:
        raise KdtrError(None, f"tensor {name!r}", f"rank {arr.ndim} > {MAX_RANK}")
    # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones
    return (arr if arr.flags.c_contiguous else arr.copy(order="C")), want


def _normalise(tensors) -> list[tuple[bytes, str, TensorData]]:
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out = []
    seen: set[bytes] = set()
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise KdtrError(None, "tensors", f"expected (name, array_or_callable) pairs, got {item!r:.80}")
        name, value = item
        if not isinstance(name, str):
            raise KdtrError(None, "name", f"tensor name {name!r} is not a str")
        raw = name.encode("utf-8", "surrogatepass")
        bad = name_problem(raw)
        if bad:
            raise KdtrError(None, "name", f"tensor name {name!r}: {bad[1]} (byte {bad[0]})")
        if raw in seen:
            raise KdtrError(None, "name", f"duplicate tensor name {name!r}")
        seen.add(raw)
        td = value if isinstance(value, TensorData) else TensorData(value)
        if td.packing and td.packing not in PACKING_CODES:
            raise KdtrError(None, f"tensor {name!r}", f"unknown packing {td.packing!r}")
        out.append((raw, name, td))
    out.sort(key=lambda t: t[0])  # canonical order: bytewise by name (readers check it)
    return out


def write_bundle(path: str | os.PathLike, tensors: Iterable[tuple[str, Any]] | Mapping[str, Any],
                 metadata: dict, *, alignment: int = DEFAULT_ALIGNMENT) -> list[TensorInfo]:
    """Write a KDTR bundle atomically; return its directory.

    `tensors`: (name, value) pairs or a mapping; a value is a numpy array, a zero-argument callable
    returning one, or a TensorData (see `bf16`, `int4`). Tensors are stored sorted by name (bytes),
    whatever the input order, and each callable is called once, in that order, just before its data
    is written: pass callables and only one tensor is in memory at a time. The same tensors and
    metadata give byte-identical files.
    """
    if not (MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise KdtrError(None, "alignment", f"{alignment} is not a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
    items = _normalise(tensors)
    meta = dump_metadata(metadata)
    dir_size = sum(entry_size(len(raw)) for raw, _, _ in items)
    if dir_size > MAX_DIR_SIZE:
        raise KdtrError(None, "dir_size", f"{len(items)} tensors need a {dir_size}-byte directory, "
                        f"more than {MAX_DIR_SIZE}")
    dir_offset = HEADER_SIZE
    meta_offset = dir_offset + dir_size
    data_offset = align_up(meta_offset + len(meta), alignment)

    infos: list[TensorInfo] = []
    entries: list[bytes] = []
    with atomic_file(path) as tmp, open(tmp, "wb") as fh:
        fh.seek(meta_offset)  # header + directory are written last, once the checksums are known
        fh.write(meta)
        fh.write(bytes(data_offset - meta_offset - len(meta)))
        pos = data_offset
        for raw, name, td in items:
            arr, dtype = _to_storage(name, td)
            shape = tuple(int(d) for d in arr.shape)
            flat = arr.reshape(-1).view(np.uint8)
            if element_count(shape, arr.itemsize) is None:
                raise KdtrError(None, f"tensor {name!r}", f"shape {shape} too large")
            crc = zlib.crc32(flat)
            fh.write(flat)
            end = pos + flat.nbytes
            padded = align_up(end, alignment)
            fh.write(bytes(padded - end))
            packing = PACKING_CODES[td.packing]
            dims = shape + (0,) * (MAX_RANK - len(shape))
            entries.append(ENTRY.pack(len(raw), DTYPE_CODES[dtype], len(shape), packing, bytes(3),
                                      *dims, pos, flat.nbytes, crc, 0)
                           + raw + bytes(align_up(len(raw), 8) - len(raw)))
            infos.append(TensorInfo(name, dtype, shape, pos, flat.nbytes, crc, td.packing))
            pos = padded
            del arr, flat  # streaming: drop the tensor before calling the next callable
        directory = b"".join(entries)
        assert len(directory) == dir_size
        header = HEADER.pack(MAGIC, VERSION, HEADER_SIZE, alignment, pos, len(items), dir_offset,
                             dir_size, meta_offset, len(meta), data_offset, zlib.crc32(directory),
                             zlib.crc32(meta), 0, 0)
        header = header[:HEADER_CRC_SPAN] + zlib.crc32(header[:HEADER_CRC_SPAN]).to_bytes(4, "little")
        fh.seek(0)
        fh.write(header)
        fh.write(directory)
    return infos
