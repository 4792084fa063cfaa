"""The KDTR reader and format rules: what mutmut (tools/mutmut.sh kdtr) found unchecked.

Every malformed bundle must be refused with the whole message a user reads (field, byte offset and the
numbers that say what is wrong); every value at the edge of an accepted range must still be accepted.
The base bundle of k2vec.kdtr.fuzz is laid out by hand below: header 88 bytes, 3 directory entries of
104 bytes (to 400), metadata {"model":"tiny"} (16 bytes, to 416), data from 448: a f32 [2,3] at 448,
b i32 [5] at 512, c u8 [7] at 576, file end 640 (alignment 64)."""
import struct
import zlib

import numpy as np
import pytest

from k2vec.kdtr import KdtrError, bf16_to_f32, f32_to_bf16, open_bundle, open_bundle_buffer, write_bundle
from k2vec.kdtr.format import itemsize
from k2vec.kdtr.fuzz import base_bundle, malformed_cases, reseal

CASES = {c[0]: c for c in malformed_cases()}
BASE = base_bundle()
NAME_RULE = "(allowed: printable ASCII except space, '/', '\\')"
CAP = "or over the cap 67108864"


def _crc(data: bytes, lo: int, hi: int) -> str:
    return f"0x{zlib.crc32(data[lo:hi]):08x}"


def _u32(data: bytes, at: int) -> str:
    return f"0x{struct.unpack_from('<I', data, at)[0]:08x}"


def reasons() -> dict[str, str]:
    hc, dc, mc, cm = (CASES[c][1] for c in ("header-crc", "dir-crc", "meta-crc", "crc-mismatch"))
    return {
        "truncated-0": "file is 0 bytes, too short for the magic",
        "truncated-3": "file is 3 bytes, too short for the magic",
        "truncated-6": "file is 6 bytes, truncated inside the header",
        "truncated-50": "file is 50 bytes, truncated inside the 88-byte header",
        "truncated-87": "file is 87 bytes, truncated inside the 88-byte header",
        "truncated-200": "header says 640 bytes, the file has 200 (truncated)",
        "truncated-639": "header says 640 bytes, the file has 639 (truncated)",
        "truncated-with-fixed-size": "'c' at 576 + 7 bytes runs past the end of the file (580)",
        "bad-magic": "magic is b'GGUF', not b'KDTR': not a KDTR file",
        "unknown-version": "format version 2; this reader supports 1 only",
        "header-crc": f"header checksum {_u32(hc, 84)} does not match its bytes ({_crc(hc, 0, 84)}): corrupted header",
        "header-size": "96, expected 88",
        "alignment-0": "0 is not a power of two in [64, 65536]",
        "alignment-32": "32 is not a power of two in [64, 65536]",
        "alignment-96": "96 is not a power of two in [64, 65536]",
        "alignment-131072": "131072 is not a power of two in [64, 65536]",
        "trailing-bytes": "header says 640 bytes, the file has 704 (trailing bytes)",
        "header-reserved": "0x00000001, must be 0",
        "dir-offset": "96, must be 88 (right after the header)",
        "dir-size-past-end": f"640 bytes from offset 88 run past the end of the file (640) {CAP}",
        "dir-size-huge": f"{2**64 - 1} bytes from offset 88 run past the end of the file (640) {CAP}",
        "tensor-count-huge": f"{2**64 - 1} entries cannot fit in a 312-byte directory",
        "tensor-count-too-big-for-dir": "4 entries cannot fit in a 312-byte directory",
        "meta-offset": "408, must be 400 (right after the directory)",
        "meta-size-huge": f"{2**64 - 1} bytes from offset 400 run past the end of the file (640) {CAP}",
        "meta-size-past-end": f"241 bytes from offset 400 run past the end of the file (640) {CAP}",
        "data-offset": "512, must be 448 (metadata end 416 rounded up to 64) and inside the file (640)",
        "dir-crc": f"directory checksum {_u32(dc, 72)} does not match its bytes ({_crc(dc, 88, 400)})",
        "meta-crc": f"metadata checksum {_u32(mc, 76)} does not match its bytes ({_crc(mc, 400, 416)})",
        "meta-padding": "non-zero byte in the padding before the tensor data",
        "name-len-zero": "0, must be 1..256",
        "name-len-over-cap": "257, must be 1..256",
        "name-len-past-dir": "name of 200 bytes (padded 200) runs past the directory end",
        "name-nul": f"b'\\x00': name contains NUL {NAME_RULE}",
        "name-slash": f"b'/': name contains '/' {NAME_RULE}",
        "name-backslash": f"b'\\\\': name contains '\\' {NAME_RULE}",
        "name-space": f"b' ': name contains byte 0x20 {NAME_RULE}",
        "name-non-utf8": f"b'\\xff': name contains byte 0xff {NAME_RULE}",
        "name-non-ascii": f"b'\\xc3': name contains byte 0xc3 {NAME_RULE}",
        "name-dotdot": "b'..b': name contains '..'",
        "name-dot": "b'.': name is '.'",
        "name-padding": "name padding of 'b' is not zero",
        "name-duplicate": "'a' duplicates the previous name",
        "name-unsorted": "'y' sorts before the previous name 'z' (names must be strictly increasing)",
        "entry-past-dir": "entry needs 96 bytes, 0 left in the directory",
        "dtype-unknown": "unknown dtype code 0x24 for 'b'",
        "dtype-zero": "unknown dtype code 0x00 for 'b'",
        "rank-over-cap": "9 > 8 for 'b'",
        "packing-unknown": "unknown packing code 2 for 'c'",
        "packing-int4-on-f32": "packing int4 needs dtype u8, 'a' is f32",
        "packing-int4-0d": "packing int4 packs the last dimension; 'c' is 0-d",
        "entry-reserved": "reserved bytes of 'a' are not zero",
        "entry-reserved2": "reserved bytes of 'a' are not zero",
        "dims-beyond-rank": "dims beyond rank 1 of 'b' are not zero",
        "dims-overflow-u64": "shape [4294967296, 4294967296] x 4 bytes of 'a' overflows a signed 64-bit size",
        "dims-over-i64": f"shape [{2**63}] x 4 bytes of 'b' overflows a signed 64-bit size",
        "dims-zero-times-huge": f"shape [0, {2**62}] x 4 bytes of 'a' overflows a signed 64-bit size",
        "nbytes-mismatch": "24 for 'b', but shape [5] x i32 is 20 bytes",
        "offset-unaligned": "516 of 'b' is not a multiple of the alignment 64",
        "offset-overlap": "448 of 'b' overlaps the previous tensor's data or padding (which end at 512)",
        "offset-gap": "576 of 'b' leaves a gap: tensors are contiguous, expected 512",
        "offset-huge": f"{2**64 - 64} of 'b' leaves a gap: tensors are contiguous, expected 512",
        "tensor-past-end": "'c' at 576 + 100 bytes runs past the end of the file (640)",
        "directory-trailing": "104 bytes after the last of 2 entries",
        "data-trailing": "file has 64 bytes after the last tensor's padding (must end at 640)",
        "crc-mismatch": f"tensor 'b' (20 bytes at 512) has CRC-32 {_crc(cm, 512, 532)}, directory says "
                        f"{_u32(BASE, 88 + 104 + 88)}",
        "tensor-padding": "non-zero byte in the padding after a tensor",
        "final-padding": "non-zero byte in the padding after a tensor",
    }


def _error(data: bytes, stage: str = "open") -> KdtrError:
    with pytest.raises(KdtrError) as e:
        b = open_bundle_buffer(data, source="x.kdtr")
        if stage == "verify":
            b.verify()
    return e.value


@pytest.mark.parametrize("cid", sorted(reasons()))
def test_malformed_bundle_message_is_complete(cid):
    _, data, field, offset, stage = CASES[cid]
    err = _error(data, stage)
    assert str(err) == f"x.kdtr: offset {offset} ({field}): {reasons()[cid]}"
    assert (err.field, err.offset, err.reason, err.source) == (field, offset, reasons()[cid], "x.kdtr")


def _edited(data: bytes, *edits: tuple[int, bytes], cut: int | None = None) -> bytes:
    """`data` with bytes replaced at the given offsets (and cut to `cut` bytes), CRCs recomputed."""
    buf = bytearray(data[:cut])
    for at, raw in edits:
        buf[at:at + len(raw)] = raw
    reseal(buf)
    return bytes(buf)


def _q(v: int) -> bytes:
    return struct.pack("<Q", v)


@pytest.mark.parametrize("data, field, offset, reason", [
    (b"KDTR", "header.version", 4, "file is 4 bytes, truncated inside the header"),
    (BASE[:8], "header", 8, "file is 8 bytes, truncated inside the 88-byte header"),
    (BASE[:88], "header.file_size", 16, "header says 640 bytes, the file has 88 (truncated)"),
    (_edited(BASE, (4, b"\xff\xff\xff\xff")), "header.version", 4,
     "format version 4294967295; this reader supports 1 only"),
])
def test_header_boundaries(data, field, offset, reason):
    err = _error(data)
    assert (err.field, err.offset, err.reason) == (field, offset, reason)


def test_edges_of_the_accepted_ranges(tmp_path, monkeypatch):
    from k2vec.kdtr import reader
    # alignment 65536, the largest allowed
    write_bundle(tmp_path / "a.kdtr", {"x": np.ones(3, np.float32)}, {}, alignment=65536)
    with open_bundle(tmp_path / "a.kdtr", verify=True) as b:
        assert b.alignment == 65536 and b["x"].tolist() == [1, 1, 1]
    # a tensor that ends exactly at the end of the file (no padding after it)
    write_bundle(tmp_path / "e.kdtr", {"x": np.arange(64, dtype=np.uint8)}, {}, alignment=64)
    with open_bundle(tmp_path / "e.kdtr", verify=True) as b:
        assert b.info("x").offset + 64 == b.file_size and b["x"][-1] == 63
    # metadata that runs exactly to the end of the file: 88 + 168 = 256 bytes, no tensor
    write_bundle(tmp_path / "m.kdtr", {}, {"k": "x" * 160}, alignment=64)
    assert (tmp_path / "m.kdtr").stat().st_size == 256
    assert open_bundle(tmp_path / "m.kdtr").metadata == {"k": "x" * 160}
    # caps are inclusive: a directory (312 bytes) and metadata (16 bytes) exactly at the cap
    monkeypatch.setattr(reader, "MAX_DIR_SIZE", 312)
    monkeypatch.setattr(reader, "MAX_META_SIZE", 16)
    assert len(open_bundle_buffer(BASE, verify=True)) == 3
    # a dim of exactly 2^63 - 1 is allowed (u8: 2^63 - 1 bytes): the error is the nbytes one
    c = 88 + 2 * 104
    err = _error(_edited(BASE, (c + 8, _q(2**63 - 1))))
    assert (err.field, err.offset) == ("dir[2].nbytes", c + 80)
    assert err.reason == f"7 for 'c', but shape [{2**63 - 1}] x u8 is {2**63 - 1} bytes"
    # a zero dim counts as 1 for the overflow check: [0, 2^60] x 4 bytes does not overflow
    err = _error(_edited(BASE, (88 + 8, _q(0) + _q(2**60)), (88 + 80, _q(0))))
    assert (err.field, err.reason) == ("dir[1].offset", "512 of 'b' leaves a gap: tensors are contiguous, expected 448")


def test_directory_that_ends_at_the_end_of_the_file():
    # one entry (a 72-byte name, 168 bytes), empty metadata, a 0-byte tensor at 256 = the file's end
    data = bytearray(write_bytes({"n" * 72: np.zeros(0, np.uint8)}, {}))
    assert len(data) == 320 and struct.unpack_from("<Q", data, 88 + 72)[0] == 320
    data = _edited(bytes(data), (16, _q(256)), (56, _q(0)), (64, _q(256)), (88 + 72, _q(256)), cut=256)
    err = _error(data)   # the directory may reach the end; the empty metadata is the fault
    assert (err.field, err.offset, err.reason) == ("metadata", 256,
                                                   "not valid JSON: Expecting value at metadata byte 0")


def test_entry_of_exactly_96_bytes_left_is_parsed():
    # entry 0 has a 100-byte name (entry of 200 bytes); name_len 4 leaves 96 zero bytes for entry 1
    data = write_bytes({"abcd" + "n" * 96: np.zeros(1, np.uint8)}, {})
    data = _edited(data, (24, _q(2)), (88, struct.pack("<H", 4)), (88 + 96 + 4, bytes(96)))
    err = _error(data)
    assert (err.field, err.offset, err.reason) == ("dir[1].name_len", 88 + 104, "0, must be 1..256")


@pytest.mark.parametrize("name, at, reason", [
    (b"ab/cd", 2, "name contains '/' " + NAME_RULE),
    (b"a..b..c", 1, "name contains '..'"),
])
def test_bad_name_byte_offset_is_that_byte(name, at, reason):
    data = write_bytes({"x" * len(name): np.zeros(1, np.uint8)}, {})
    err = _error(_edited(data, (88 + 96, name)))
    assert (err.field, err.offset, err.reason) == ("dir[0].name", 88 + 96 + at, f"{name!r}: {reason}")


def write_bytes(tensors, metadata, alignment=64) -> bytes:
    from k2vec.kdtr.fuzz import bundle_bytes
    return bundle_bytes(tensors, metadata, alignment)


# ---- metadata: the strict JSON rules at their edges

def test_metadata_edges_are_accepted(tmp_path):
    deep = {"a": [[]]}
    for _ in range(125):   # the top object is level 1: 127 nested arrays reach level 128
        deep = {"a": [deep["a"]]}
    meta = {"deep": deep["a"], "n": 10**99, "f": 0.25}   # 10**99: a number of exactly 100 characters
    write_bundle(tmp_path / "m.kdtr", {}, meta)
    assert open_bundle(tmp_path / "m.kdtr").metadata == meta


@pytest.mark.parametrize("raw, reason", [
    (b'{"x":1,"a":1,"a":2}', "duplicate key 'a'"),
    (b'{"f":1.' + b"0" * 99 + b"}", "number of 101 characters (max 100)"),
    (b'{"f":' + b"[" * 100000 + b"]" * 100000 + b"}", "nested deeper than 128"),
])
def test_metadata_errors(raw, reason):
    from k2vec.kdtr.fuzz import replace_metadata
    err = _error(replace_metadata(BASE, raw))
    assert str(err) == f"x.kdtr: offset 400 (metadata): {reason}"


def test_writer_errors_name_the_metadata_or_the_tensor(tmp_path, monkeypatch):
    import k2vec.kdtr.format as fmt
    path = tmp_path / "b.kdtr"
    cases = [
        (lambda: write_bundle(path, {}, [1]), "(metadata): must be a dict, got list"),
        (lambda: write_bundle(path, {}, {"x": float("nan")}), "(metadata): cannot be written as strict JSON: "),
        (lambda: write_bundle(path, {}, {"big": 10**200}), "offset 0 (metadata): number of 201 characters (max 100)"),
        (lambda: write_bundle(path, [("", np.zeros(1))], {}), "(name): tensor name '': empty name (byte 0)"),
        (lambda: write_bundle(path, [("x" * 257, np.zeros(1))], {}),
         f"(name): tensor name '{'x' * 257}': name is 257 bytes, more than 256 (byte 0)"),
    ]
    for write, message in cases:
        with pytest.raises(KdtrError) as e:
            write()
        assert str(e.value).startswith(message) and e.value.source == "", str(e.value)
        assert e.value.field in ("metadata", "name")
    monkeypatch.setattr(fmt, "MAX_META_SIZE", 108)   # {"x":"yyy..."}: 8 + 100 bytes, exactly the cap
    write_bundle(path, {}, {"x": "y" * 100})
    with pytest.raises(KdtrError) as e:
        write_bundle(path, {}, {"x": "y" * 101})
    assert str(e.value) == "(metadata): 109 bytes of JSON, more than 108"


# ---- the reader's objects

def test_errors_without_a_source_name_the_buffer():
    with pytest.raises(KdtrError) as e:
        open_bundle_buffer(b"GGUF")
    assert str(e.value) == "<buffer>: offset 0 (header.magic): magic is b'GGUF', not b'KDTR': not a KDTR file"


def test_verify_after_close_names_the_file(tmp_path):
    write_bundle(tmp_path / "b.kdtr", {"x": np.zeros(1)}, {})
    b = open_bundle(tmp_path / "b.kdtr")
    b.close()
    b.close()   # closing twice is harmless (a `with` block after an explicit close)
    with pytest.raises(ValueError) as e:
        b.verify()
    assert str(e.value) == f"{tmp_path / 'b.kdtr'}: bundle is closed"
    assert str(tmp_path / "b.kdtr") not in open("/proc/self/maps").read()   # the mapping is gone


def test_verify_of_an_empty_last_tensor(tmp_path):
    # the empty tensor starts at the file's end, where its (empty) page range is
    write_bundle(tmp_path / "b.kdtr", {"a": np.ones(4096, np.uint8), "z": np.zeros(0, np.uint8)}, {})
    with open_bundle(tmp_path / "b.kdtr") as b:
        assert b.info("z").offset == b.file_size == 8192
        assert b.verify() == 4096
        b.release("z")


def _resident_kib(path) -> int:
    """Resident memory (kB) of this process's mappings of `path`, from /proc/self/smaps."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            inside = line.rstrip("\n").endswith(str(path))
        elif inside and first == "Rss:":
            total += int(line.split()[1])
    return total


def test_release_and_verify_drop_the_pages_they_are_done_with(tmp_path):
    """Reading a bundle bigger than memory holds one tensor at a time: release() drops exactly that
    tensor's pages, verify() drops each tensor's pages once checked."""
    path = tmp_path / "b.kdtr"
    write_bundle(path, {"a": np.ones(1 << 20, np.float32), "b": np.full(1 << 20, 2, np.float32)}, {})
    with open_bundle(path) as b:
        assert b["a"].sum() + b["b"].sum() == 3 << 20
        assert _resident_kib(path) >= 8000
        b.release("a")
        assert 4096 <= _resident_kib(path) <= 4096 + 16   # all of b's 4 MiB stay, a's are gone
        assert b["b"][-1] == 2 and b["a"][0] == 1          # and the data is still there
    with open_bundle(path) as b:
        b.verify()
        assert _resident_kib(path) <= 16                   # the header page at most


def test_release_of_a_buffer_bundle_is_a_no_op():
    b = open_bundle_buffer(BASE)
    b.release("a")   # nothing mapped by the reader: nothing to drop
    assert b["a"].tolist() == [[0, 1, 2], [3, 4, 5]]


# ---- dtype helpers

def test_itemsize_of_kdtr_dtypes():
    assert [itemsize(d) for d in ("u8", "i16", "f32", "bf16", "f64")] == [1, 2, 4, 2, 8]


def test_bf16_helpers_take_plain_lists():
    # array-likes are converted to the documented dtype first (uint16 bits; float32 values)
    assert bf16_to_f32([0x3F80, 0xC020, 0x7F80]).tolist() == [1.0, -2.5, float("inf")]
    assert f32_to_bf16([1.0, -2.5]).tolist() == [0x3F80, 0xC020]


def test_f32_to_bf16_keeps_every_nan_a_quiet_nan():
    # the top 16 bits with the quiet bit 0x0040 set: a signalling NaN must not round to inf
    # (0x7F800001) or carry into the sign (0x7FFFFFFF), and no other bit is added
    nans = np.array([0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0x7FC00000], np.uint32).view(np.float32)
    assert f32_to_bf16(nans).tolist() == [0x7FC0, 0x7FFF, 0xFFC0, 0x7FC0]
