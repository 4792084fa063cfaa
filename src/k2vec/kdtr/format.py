"""KDTR v1 byte layout: constants, dtype/packing codes, the strict rules shared by writer and reader.

docs/kdtr-format.md is the normative spec; this module and include/kdtr.h implement it and
must change together (tests/test_kdtr_c.py holds them to the same verdict on fuzzed files).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

import numpy as np

from k2vec.errors import K2VecError

MAGIC = b"KDTR"
VERSION = 1

# Fixed header, 88 bytes, little-endian (offsets in the comments):
#   0 magic[4]  4 version u32  8 header_size u32  12 alignment u32  16 file_size u64
#  24 tensor_count u64  32 dir_offset u64  40 dir_size u64  48 meta_offset u64  56 meta_size u64
#  64 data_offset u64  72 dir_crc32 u32  76 meta_crc32 u32  80 reserved u32 (0)  84 header_crc32 u32
HEADER = struct.Struct("<4sIIIQQQQQQQIIII")
HEADER_SIZE = HEADER.size
HEADER_CRC_SPAN = 84  # header_crc32 covers bytes [0, 84)
HEADER_FIELDS = {  # field name -> byte offset, for error messages
    "magic": 0, "version": 4, "header_size": 8, "alignment": 12, "file_size": 16,
    "tensor_count": 24, "dir_offset": 32, "dir_size": 40, "meta_offset": 48, "meta_size": 56,
    "data_offset": 64, "dir_crc32": 72, "meta_crc32": 76, "reserved": 80, "header_crc32": 84,
}

# Directory entry: 96 fixed bytes, then the name, zero-padded to a multiple of 8.
#   0 name_len u16  2 dtype u8  3 rank u8  4 packing u8  5 reserved[3]  8 dims[8] u64 (unused = 0)
#  72 offset u64 (absolute)  80 nbytes u64  88 crc32 u32  92 reserved u32
# Fixed-capacity dims make the directory size a function of the names alone, so the writer can
# place the data before it has seen any tensor (streaming) and fill the directory in at the end.
ENTRY = struct.Struct("<HBBB3s8QQQII")
ENTRY_SIZE = ENTRY.size
ENTRY_FIELDS = {"name_len": 0, "dtype": 2, "rank": 3, "packing": 4, "reserved": 5, "dims": 8,
                "offset": 72, "nbytes": 80, "crc32": 88, "reserved2": 92, "name": 96}
MAX_RANK = 8
MAX_NAME_LEN = 256

# Alignment of every tensor's data offset (and of the file length). Readers accept any power of
# two in [64, 65536]; the writer's default is 4096. See docs/kdtr-format.md §3.
MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 65536
DEFAULT_ALIGNMENT = 4096

# Caps, checked on write and on read: a reader never parses or allocates more than this for the
# header blocks, whatever the file says (safetensors' 100 MB header cap, ggml's bounded counts).
MAX_DIR_SIZE = 64 << 20
MAX_META_SIZE = 64 << 20
MAX_JSON_DEPTH = 128
MAX_JSON_NUMBER_LEN = 100  # also keeps Python's int(str) digit limit (4300) out of reach
I64_MAX = (1 << 63) - 1

# dtype codes: high nibble = kind (1 unsigned, 2 signed, 3 IEEE float, 4 bfloat), low nibble =
# log2(itemsize), so a code is readable in a hex dump. 0 is invalid (a zeroed entry is rejected).
DTYPES: dict[int, tuple[str, str]] = {  # code -> (name, numpy dtype string); bf16 reads as uint16
    0x10: ("u8", "<u1"), 0x11: ("u16", "<u2"), 0x12: ("u32", "<u4"), 0x13: ("u64", "<u8"),
    0x20: ("i8", "<i1"), 0x21: ("i16", "<i2"), 0x22: ("i32", "<i4"), 0x23: ("i64", "<i8"),
    0x31: ("f16", "<f2"), 0x32: ("f32", "<f4"), 0x33: ("f64", "<f8"),
    0x41: ("bf16", "<u2"),
}
DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}
FLOAT_DTYPES = frozenset({"f16", "f32", "f64", "bf16"})

# packing codes. 1 = int4: a u8 tensor of two 4-bit codes per byte along the last dim, in the
# `int4-offset8-lownibble-first` layout of docs/int4-format.md (byte = (q0 + 8) | (q1 + 8) << 4).
# Group size and scales live in the metadata; a different bit layout would get a new code.
PACKINGS: dict[int, str] = {0: "", 1: "int4"}
PACKING_CODES = {name: code for code, name in PACKINGS.items()}
PACKING_DTYPES = {"int4": "u8"}  # packing -> the only storage dtype it allows


class KdtrError(K2VecError):
    """A malformed bundle (or an invalid write): names the byte offset and the field at fault."""

    def __init__(self, offset: int | None, field: str, reason: str, source: str = ""):
        self.offset = offset
        self.field = field
        self.reason = reason
        self.source = source
        where = f"offset {offset} ({field})" if offset is not None else f"({field})"
        super().__init__(f"{source + ': ' if source else ''}{where}: {reason}")


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def entry_size(name_len: int) -> int:
    return ENTRY_SIZE + align_up(name_len, 8)


def itemsize(dtype: str) -> int:
    return np.dtype(DTYPES[DTYPE_CODES[dtype]][1]).itemsize


_NAME_OK = frozenset(range(0x21, 0x7F)) - {ord("/"), ord("\\")}


def name_problem(raw: bytes) -> tuple[int, str] | None:
    """(byte index, reason) of the first rule a tensor name breaks, else None.

    Names are 1..256 bytes of printable ASCII without space, '/', '\\' or '..' (and not '.'):
    they appear in a whitespace-separated table shared with C, are compared with memcmp (no
    Unicode normalisation questions), and are safe as file names if a tool extracts tensors.
    """
    if not raw:
        return 0, "empty name"
    if len(raw) > MAX_NAME_LEN:
        return 0, f"name is {len(raw)} bytes, more than {MAX_NAME_LEN}"
    for i, b in enumerate(raw):
        if b not in _NAME_OK:
            what = {0: "NUL", 0x2F: "'/'", 0x5C: "'\\'"}.get(b, f"byte 0x{b:02x}")
            return i, f"name contains {what} (allowed: printable ASCII except space, '/', '\\')"
    i = raw.find(b"..")
    if i >= 0:
        return i, "name contains '..'"
    if raw == b".":
        return 0, "name is '.'"
    return None


def element_count(dims: tuple[int, ...], isize: int) -> int | None:
    """Element count, or None when dims*itemsize (zero dims counted as 1, as numpy does) > I64_MAX."""
    total = isize
    count = 1
    for d in dims:
        if d > I64_MAX:
            return None
        total *= max(d, 1)
        count *= d
        if total > I64_MAX:
            return None
    return count


def format_line(name: str, dtype: str, packing: str, shape: tuple[int, ...], offset: int,
                nbytes: int, crc32: int) -> str:
    """The canonical one-line-per-tensor table row shared with `kdtr_tool list` (byte-identical)."""
    dt = f"{dtype}:{packing}" if packing else dtype
    return f"{name} {dt} [{','.join(str(d) for d in shape)}] {offset} {nbytes} {crc32:08x}"


# ---- metadata JSON: strict RFC 8259, the same verdicts as the C validator in kdtr.h ----

class _JsonReject(Exception):
    pass


def _pairs(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _JsonReject(f"duplicate key {k!r}")
            seen.add(k)
    return d


def _number(kind):
    def parse(token: str):
        if len(token) > MAX_JSON_NUMBER_LEN:
            raise _JsonReject(f"number of {len(token)} characters (max {MAX_JSON_NUMBER_LEN})")
        return kind(token)
    return parse


def _constant(token: str):
    raise _JsonReject(f"{token} is not JSON")


_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_metadata(raw: bytes, offset: int = 0) -> dict:
    """Strictly parse the metadata block; raise KdtrError at `offset`, the block's start.

    Every metadata error is reported at the block's start, as the C reader does: the two parsers
    stop at different bytes for some malformed texts, so the position inside the block, where the
    parser knows it, goes into the reason only."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KdtrError(offset, "metadata", f"not valid UTF-8 ({e.reason}) at metadata byte {e.start}") from None
    try:
        obj = json.loads(text, object_pairs_hook=_pairs, parse_int=_number(int),
                         parse_float=_number(float), parse_constant=_constant)
    except json.JSONDecodeError as e:
        pos = len(text[: e.pos].encode("utf-8"))
        raise KdtrError(offset, "metadata", f"not valid JSON: {e.msg} at metadata byte {pos}") from None
    except _JsonReject as e:
        raise KdtrError(offset, "metadata", str(e)) from None
    except RecursionError:
        raise KdtrError(offset, "metadata", f"nested deeper than {MAX_JSON_DEPTH}") from None
    if not isinstance(obj, dict):
        raise KdtrError(offset, "metadata", f"top level is a JSON {type(obj).__name__}, not an object")
    # Python keeps unpaired \ud800 escapes and nests up to the recursion limit; C rejects both.
    stack = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise KdtrError(offset, "metadata", f"nested deeper than {MAX_JSON_DEPTH}")
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            for s in (k, x):
                if isinstance(s, str) and _SURROGATE.search(s):
                    raise KdtrError(offset, "metadata", "string with an unpaired UTF-16 surrogate escape")
            if isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
    return obj


def dump_metadata(metadata) -> bytes:
    """Canonical metadata bytes: sorted keys, no spaces, UTF-8; re-parsed so the reader accepts it."""
    if not isinstance(metadata, dict):
        raise KdtrError(None, "metadata", f"must be a dict, got {type(metadata).__name__}")
    try:
        raw = json.dumps(metadata, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                         allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        raise KdtrError(None, "metadata", f"cannot be written as strict JSON: {e}") from None
    if len(raw) > MAX_META_SIZE:
        raise KdtrError(None, "metadata", f"{len(raw)} bytes of JSON, more than {MAX_META_SIZE}")
    parse_metadata(raw)  # e.g. an int of 200 digits, nesting deeper than 128
    return raw


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One directory entry. `dtype` is a KDTR dtype name; `packing` is '' or e.g. 'int4'."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int
    packing: str = ""

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[DTYPE_CODES[self.dtype]][1])

    def line(self) -> str:
        return format_line(self.name, self.dtype, self.packing, self.shape, self.offset,
                           self.nbytes, self.crc32)


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """Widen bf16 bits (uint16, as the reader returns them) to float32 (exact; copies)."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits (uint16), round-to-nearest-even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
