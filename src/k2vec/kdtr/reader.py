"""Zero-copy KDTR reader: mmap the file, validate header + directory + metadata, hand out views.

Opening reads the 88-byte header, the directory and the metadata block only (time and memory
proportional to those, never to the tensor data). `verify()` then reads every tensor's bytes
and checks their CRC-32 and the zero padding. Check order follows docs/kdtr-format.md §6, and
include/kdtr.h applies the same rules in the same order.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from k2vec.kdtr.format import (
    DTYPES,
    ENTRY,
    ENTRY_FIELDS,
    ENTRY_SIZE,
    HEADER,
    HEADER_CRC_SPAN,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAGIC,
    MAX_ALIGNMENT,
    MAX_DIR_SIZE,
    MAX_META_SIZE,
    MAX_NAME_LEN,
    MAX_RANK,
    MIN_ALIGNMENT,
    PACKING_DTYPES,
    PACKINGS,
    VERSION,
    KdtrError,
    TensorInfo,
    align_up,
    element_count,
    name_problem,
    parse_metadata,
)

_PARALLEL_BYTES = 32 << 20  # verify() uses threads above this many tensor bytes


def _parse(buf, size: int, source: str):
    """Validate everything but the tensor bytes (rules 1-23 of docs/kdtr-format.md §7).
    Returns (header bytes, entries, metadata, alignment)."""

    def fail(offset, field, reason):
        raise KdtrError(offset, field, reason, source)

    def hfail(field, reason):
        fail(HEADER_FIELDS[field], f"header.{field}", reason)

    if size < 4:
        fail(0, "header.magic", f"file is {size} bytes, too short for the magic")
    if bytes(buf[0:4]) != MAGIC:
        fail(0, "header.magic", f"magic is {bytes(buf[0:4])!r}, not {MAGIC!r}: not a KDTR file")
    if size < 8:
        fail(4, "header.version", f"file is {size} bytes, truncated inside the header")
    version = struct.unpack_from("<I", buf, 4)[0]
    if version != VERSION:
        hfail("version", f"format version {version}; this reader supports {VERSION} only")
    if size < HEADER_SIZE:
        fail(size, "header", f"file is {size} bytes, truncated inside the {HEADER_SIZE}-byte header")
    head = bytes(buf[0:HEADER_SIZE])
    (_, _, header_size, alignment, file_size, count, dir_offset, dir_size, meta_offset, meta_size,
     data_offset, dir_crc, meta_crc, reserved, header_crc) = HEADER.unpack(head)
    if zlib.crc32(head[:HEADER_CRC_SPAN]) != header_crc:
        hfail("header_crc32", f"header checksum 0x{header_crc:08x} does not match its bytes "
              f"(0x{zlib.crc32(head[:HEADER_CRC_SPAN]):08x}): corrupted header")
    if header_size != HEADER_SIZE:
        hfail("header_size", f"{header_size}, expected {HEADER_SIZE}")
    if not (MIN_ALIGNMENT <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        hfail("alignment", f"{alignment} is not a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
    if file_size != size:
        hfail("file_size", f"header says {file_size} bytes, the file has {size}"
              + (" (truncated)" if size < file_size else " (trailing bytes)"))
    if reserved != 0:
        hfail("reserved", f"0x{reserved:08x}, must be 0")
    if dir_offset != HEADER_SIZE:
        hfail("dir_offset", f"{dir_offset}, must be {HEADER_SIZE} (right after the header)")
    if dir_size > MAX_DIR_SIZE or dir_size > size - dir_offset:
        hfail("dir_size", f"{dir_size} bytes from offset {dir_offset} run past the end of the "
              f"file ({size}) or over the cap {MAX_DIR_SIZE}")
    if count > dir_size // ENTRY_SIZE:
        hfail("tensor_count", f"{count} entries cannot fit in a {dir_size}-byte directory")
    if meta_offset != dir_offset + dir_size:
        hfail("meta_offset", f"{meta_offset}, must be {dir_offset + dir_size} (right after the directory)")
    if meta_size > MAX_META_SIZE or meta_size > size - meta_offset:
        hfail("meta_size", f"{meta_size} bytes from offset {meta_offset} run past the end of the "
              f"file ({size}) or over the cap {MAX_META_SIZE}")
    meta_end = meta_offset + meta_size
    if data_offset != align_up(meta_end, alignment) or data_offset > size:
        hfail("data_offset", f"{data_offset}, must be {align_up(meta_end, alignment)} (metadata end "
              f"{meta_end} rounded up to {alignment}) and inside the file ({size})")
    directory = bytes(buf[dir_offset:meta_offset])
    if zlib.crc32(directory) != dir_crc:
        hfail("dir_crc32", f"directory checksum 0x{dir_crc:08x} does not match its bytes "
              f"(0x{zlib.crc32(directory):08x})")
    meta_raw = bytes(buf[meta_offset:meta_end])
    if zlib.crc32(meta_raw) != meta_crc:
        hfail("meta_crc32", f"metadata checksum 0x{meta_crc:08x} does not match its bytes "
              f"(0x{zlib.crc32(meta_raw):08x})")
    pad = bytes(buf[meta_end:data_offset])
    if pad.count(0) != len(pad):
        i = next(i for i, b in enumerate(pad) if b)
        fail(meta_end + i, "padding", "non-zero byte in the padding before the tensor data")

    entries: list[TensorInfo] = []
    pos = 0  # within `directory`
    expect = data_offset  # where the next tensor must start
    prev_name = b""
    for i in range(count):
        at = dir_offset + pos

        def efail(field, reason, _i=i, _at=at):
            fail(_at + ENTRY_FIELDS[field], f"dir[{_i}].{field}", reason)

        if dir_size - pos < ENTRY_SIZE:
            fail(at, f"dir[{i}]", f"entry needs {ENTRY_SIZE} bytes, {dir_size - pos} left in the directory")
        (name_len, code, rank, pcode, res1, *dims, offset, nbytes, crc, res2) = ENTRY.unpack_from(directory, pos)
        if not 1 <= name_len <= MAX_NAME_LEN:
            efail("name_len", f"{name_len}, must be 1..{MAX_NAME_LEN}")
        padded_len = align_up(name_len, 8)
        if dir_size - pos - ENTRY_SIZE < padded_len:
            efail("name_len", f"name of {name_len} bytes (padded {padded_len}) runs past the directory end")
        raw = directory[pos + ENTRY_SIZE: pos + ENTRY_SIZE + name_len]
        bad = name_problem(raw)
        if bad:
            fail(at + ENTRY_SIZE + bad[0], f"dir[{i}].name", f"{raw!r}: {bad[1]}")
        npad = directory[pos + ENTRY_SIZE + name_len: pos + ENTRY_SIZE + padded_len]
        if npad.count(0) != len(npad):
            efail("name", f"name padding of {raw.decode()!r} is not zero")
        if i and raw <= prev_name:
            efail("name", f"{raw.decode()!r} " + ("duplicates the previous name" if raw == prev_name
                  else f"sorts before the previous name {prev_name.decode()!r} (names must be strictly increasing)"))
        name = raw.decode("ascii")
        if code not in DTYPES:
            efail("dtype", f"unknown dtype code 0x{code:02x} for {name!r}")
        dtype, npdt = DTYPES[code]
        if rank > MAX_RANK:
            efail("rank", f"{rank} > {MAX_RANK} for {name!r}")
        if pcode not in PACKINGS:
            efail("packing", f"unknown packing code {pcode} for {name!r}")
        packing = PACKINGS[pcode]
        if packing and PACKING_DTYPES[packing] != dtype:
            efail("packing", f"packing {packing} needs dtype {PACKING_DTYPES[packing]}, {name!r} is {dtype}")
        if packing and rank == 0:
            efail("packing", f"packing {packing} packs the last dimension; {name!r} is 0-d")
        if res1 != b"\0\0\0" or res2 != 0:
            efail("reserved", f"reserved bytes of {name!r} are not zero")
        if any(dims[rank:]):
            fail(at + ENTRY_FIELDS["dims"] + 8 * rank, f"dir[{i}].dims",
                 f"dims beyond rank {rank} of {name!r} are not zero")
        isize = np.dtype(npdt).itemsize
        shape = tuple(dims[:rank])
        n = element_count(shape, isize)
        if n is None:
            efail("dims", f"shape {list(shape)} x {isize} bytes of {name!r} overflows a signed 64-bit size")
        if nbytes != n * isize:
            efail("nbytes", f"{nbytes} for {name!r}, but shape {list(shape)} x {dtype} is {n * isize} bytes")
        if offset % alignment:
            efail("offset", f"{offset} of {name!r} is not a multiple of the alignment {alignment}")
        if offset < expect:
            efail("offset", f"{offset} of {name!r} overlaps the previous tensor's data or padding "
                  f"(which end at {expect})")
        if offset > expect:
            efail("offset", f"{offset} of {name!r} leaves a gap: tensors are contiguous, expected {expect}")
        if nbytes > size - offset:
            efail("nbytes", f"{name!r} at {offset} + {nbytes} bytes runs past the end of the file ({size})")
        entries.append(TensorInfo(name, dtype, shape, offset, nbytes, crc, packing))
        expect = align_up(offset + nbytes, alignment)
        prev_name = raw
        pos += ENTRY_SIZE + padded_len
    if pos != dir_size:
        fail(dir_offset + pos, "directory", f"{dir_size - pos} bytes after the last of {count} entries")
    if expect != size:
        fail(expect, "file_size", f"file has {size - expect} bytes after the last tensor's padding "
             f"(must end at {expect})")
    try:
        metadata = parse_metadata(meta_raw, meta_offset)
    except KdtrError as e:
        fail(e.offset, e.field, e.reason)
    return head, entries, metadata, alignment


class Bundle:
    """An open KDTR bundle. `b[name]` is a read-only numpy view into the mapping (no copy);
    bf16 tensors come back as uint16 bit patterns (see `format.bf16_to_f32`)."""

    def __init__(self, buf, size: int, source: str, mm: mmap.mmap | None = None):
        self.source = source
        self._buf = buf
        self._mm = mm
        _, entries, self.metadata, self.alignment = _parse(buf, size, source)
        self.file_size = size
        self.version = VERSION
        self.tensors: list[TensorInfo] = entries
        self._index = {t.name: t for t in entries}

    # mapping-like access
    def __getitem__(self, name: str) -> np.ndarray:
        if self._buf is None:
            raise ValueError(f"{self.source}: bundle is closed")
        t = self._index[name]
        dt = t.numpy_dtype
        n = t.nbytes // dt.itemsize
        return np.frombuffer(self._buf, dtype=dt, count=n, offset=t.offset).reshape(t.shape)

    def release(self, name: str) -> None:
        """Drop this process's mapped pages of a tensor it has used (they are read again from the page
        cache if it is used again), so reading a bundle bigger than memory holds one tensor at a time."""
        if self._mm is not None and self._buf is not None:
            t = self._index[name]
            self._release_range(t.offset, t.offset + t.nbytes)

    def _release_range(self, start: int, end: int) -> None:
        start -= start % mmap.PAGESIZE  # whole pages only: a partial page stays
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self._index.keys()

    def info(self, name: str) -> TensorInfo:
        return self._index[name]

    def lines(self) -> list[str]:
        """The canonical table's rows, one per tensor (what `list` prints after its header line)."""
        return [t.line() for t in self.tensors]

    def verify(self, workers: int = 1) -> int:
        """Check every tensor's CRC-32 and that all padding is zero; raise KdtrError on the first
        problem (in file order). Returns the number of tensor bytes checked.

        zlib.crc32 releases the GIL, so `workers` > 1 checksums tensors on threads (for bundles
        over 32 MiB). The default is 1: on the 2-vCPU machine of bench/RESULTS.md two threads
        were no faster (~4 GB/s either way); try more on a bigger host."""
        if self._buf is None:
            raise ValueError(f"{self.source}: bundle is closed")
        mv = memoryview(self._buf)
        try:
            crc = lambda t: zlib.crc32(mv[t.offset: t.offset + t.nbytes])  # noqa: E731
            if workers > 1 and sum(t.nbytes for t in self.tensors) > _PARALLEL_BYTES:
                with ThreadPoolExecutor(workers) as ex:
                    crcs = ex.map(crc, self.tensors)
            else:  # a thread pool costs more than it saves on small bundles
                crcs = map(crc, self.tensors)
            prev_end = self.tensors[0].offset if self.tensors else self.file_size
            for i, (t, crc) in enumerate(zip(self.tensors, crcs)):
                if self._mm is not None:  # checked: its pages need not stay in this process
                    self._release_range(prev_end, t.offset + t.nbytes)
                self._check_zero(mv, prev_end, t.offset)
                if crc != t.crc32:
                    raise KdtrError(t.offset, f"dir[{i}].crc32",
                                    f"tensor {t.name!r} ({t.nbytes} bytes at {t.offset}) has CRC-32 "
                                    f"0x{crc:08x}, directory says 0x{t.crc32:08x}", self.source)
                prev_end = t.offset + t.nbytes
            self._check_zero(mv, prev_end, self.file_size)
            return sum(t.nbytes for t in self.tensors)
        finally:
            mv.release()

    def _check_zero(self, mv: memoryview, start: int, end: int) -> None:
        pad = bytes(mv[start:end])  # < alignment bytes
        if pad.count(0) != len(pad):
            i = next(i for i, b in enumerate(pad) if b)
            raise KdtrError(start + i, "padding", "non-zero byte in the padding after a tensor", self.source)

    def close(self) -> None:
        """Drop the mapping. Views handed out keep it alive until they are gone."""
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # live numpy views still export the buffer
                pass
            self._mm = None

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kdtr.Bundle {self.source} v{self.version} {len(self.tensors)} tensors {self.file_size} bytes>"


def open_bundle(path: str | os.PathLike, verify: bool = False) -> Bundle:
    """mmap and validate a bundle; with `verify=True` also check every tensor checksum."""
    source = os.fspath(path)
    with open(source, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise KdtrError(0, "header.magic", "file is 0 bytes, too short for the magic", source)
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        b = Bundle(mm, size, source, mm)
        if verify:
            b.verify()
    except BaseException:
        mm.close()
        raise
    return b


def open_bundle_buffer(data, verify: bool = False, source: str = "<buffer>") -> Bundle:
    """Like `open_bundle` over an in-memory buffer (bytes, bytearray, memoryview): no copy."""
    size = memoryview(data).nbytes
    b = Bundle(data, size, source)
    if verify:
        b.verify()
    return b
