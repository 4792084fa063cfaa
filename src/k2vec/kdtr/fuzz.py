"""Seed bundles and structure-aware mutations for fuzzing KDTR readers (Python and C).

Mutations re-seal the header/directory/metadata CRCs most of the time: otherwise nearly every
mutant would stop at a checksum and the deeper structural checks would go untested.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from k2vec.kdtr.format import ENTRY, ENTRY_SIZE, HEADER, HEADER_CRC_SPAN, HEADER_FIELDS, HEADER_SIZE, align_up
from k2vec.kdtr.writer import bf16, int4, write_bundle

_HEADER_WIDTHS = {"magic": 4, "version": 4, "header_size": 4, "alignment": 4, "file_size": 8,
                  "tensor_count": 8, "dir_offset": 8, "dir_size": 8, "meta_offset": 8,
                  "meta_size": 8, "data_offset": 8, "dir_crc32": 4, "meta_crc32": 4, "reserved": 4,
                  "header_crc32": 4}
_ENTRY_WIDTHS = [("name_len", 0, 2), ("dtype", 2, 1), ("rank", 3, 1), ("packing", 4, 1),
                 ("reserved", 5, 1), ("reserved", 7, 1)] + [(f"dims{k}", 8 + 8 * k, 8) for k in range(8)] + \
                [("offset", 72, 8), ("nbytes", 80, 8), ("crc32", 88, 4), ("reserved2", 92, 4)]


def bundle_bytes(tensors, metadata, alignment: int = 64) -> bytes:
    """Write a bundle to a temporary file and return its bytes."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "b.kdtr"
        write_bundle(p, tensors, metadata, alignment=alignment)
        return p.read_bytes()


def seed_bundles() -> list[bytes]:
    """Small, varied, valid bundles: every dtype, 0-d, empty, packed, odd metadata, no tensors."""
    rng = np.random.default_rng(1)
    all_dtypes = [(f"t.{np.dtype(d).name}", (rng.standard_normal(5) * 50).astype(d))
                  for d in ["f4", "f2", "f8", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8"]]
    meta = {"model": {"name": "tiny", "hidden": 64, "layers": [1, 2.5, -3e-7, True, None]},
            "prompts": ["héllo \u2603 \U0001F600", "tab\t\"quote\" \\ /"], "generator": "k2vec 0.1"}
    return [
        bundle_bytes(all_dtypes + [("bf", bf16(np.arange(3, dtype=np.uint16)))], meta),
        bundle_bytes([("a", np.float32(1.5)), ("b", np.zeros((0, 4), np.float32)),
                      ("c.q", int4(np.arange(8, dtype=np.uint8).reshape(2, 4))), ("d", np.zeros((2, 0), np.int64))],
                     {"k": {"nested": {"deeper": [[], {}, [[]]]}}, "e": ""}),
        bundle_bytes([("w", np.arange(100, dtype=np.float32).reshape(10, 10))], {"x": 1}, alignment=128),
        bundle_bytes([], {}),
    ]


def reseal(buf: bytearray, tensors: bool = False) -> None:
    """Recompute the header/directory/metadata CRCs (and with `tensors`, each tensor's CRC) from
    whatever the header claims, wherever those ranges lie inside the buffer."""
    if len(buf) < HEADER_SIZE:
        return
    h = HEADER.unpack_from(buf)
    dir_off, dir_size, meta_off, meta_size = h[6], h[7], h[8], h[9]
    if dir_off + dir_size <= len(buf):
        if tensors:
            pos, end = dir_off, dir_off + dir_size
            while end - pos >= ENTRY_SIZE:
                e = ENTRY.unpack_from(buf, pos)
                off, nb = e[13], e[14]
                if off + nb <= len(buf):
                    struct.pack_into("<I", buf, pos + 88, zlib.crc32(buf[off: off + nb]))
                pos += ENTRY_SIZE + align_up(e[0], 8)
        struct.pack_into("<I", buf, 72, zlib.crc32(buf[dir_off: dir_off + dir_size]))
    if meta_off + meta_size <= len(buf):
        struct.pack_into("<I", buf, 76, zlib.crc32(buf[meta_off: meta_off + meta_size]))
    struct.pack_into("<I", buf, 84, zlib.crc32(buf[:HEADER_CRC_SPAN]))


def entry_offsets(buf: bytes) -> list[int]:
    """Absolute offsets of the directory entries of a valid bundle."""
    h = HEADER.unpack_from(buf)
    out, pos = [], h[6]
    for _ in range(h[5]):
        out.append(pos)
        pos += ENTRY_SIZE + align_up(struct.unpack_from("<H", buf, pos)[0], 8)
    return out


def replace_metadata(buf: bytes, meta: bytes) -> bytes:
    """The same bundle with its metadata block replaced by arbitrary bytes (offsets fixed, resealed)."""
    h = list(HEADER.unpack_from(buf))
    alignment, old_data, meta_off = h[3], h[10], h[8]
    new_data = align_up(meta_off + len(meta), alignment)
    delta = new_data - old_data
    out = bytearray(buf[:meta_off]) + meta + bytes(new_data - meta_off - len(meta)) + buf[old_data:]
    for pos in entry_offsets(buf):
        struct.pack_into("<Q", out, pos + 72, struct.unpack_from("<Q", out, pos + 72)[0] + delta)
    h[4], h[9], h[10] = len(out), len(meta), new_data
    out[:HEADER_SIZE] = HEADER.pack(*h)
    reseal(out)
    return bytes(out)


_U64 = [0, 1, 2, 7, 8, 63, 64, 88, 95, 96, 127, 128, 255, 256, 4095, 4096, 0xFFFF, 0x10000,
        0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63,
        (1 << 64) - 1, (1 << 64) - 64]
_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x2E, 0x2F, 0x5C, 0x22, 0x7B, 0x7D, 0x5B, 0x5D,
          0x2C, 0x3A, 0x30, 0x39, 0x2D, 0x65, 0xC0, 0xED, 0xF4, 0xF5, 0xEF, 0xBF]


_KEY_PAIRS = [  # (key, key) spelled in JSON; equal after unescaping unless noted
    ('"dup"', '"dup"'), ('"dup"', '"d\\u0075p"'), ('"\\ud83d\\ude00"', '"\U0001F600"'),
    ('"a\\nb"', '"a\\u000Ab"'), ('"a\\/b"', '"a/b"'),
    ('"\\t\\b\\f\\r\\"\\\\"', '"\\u0009\\u0008\\u000c\\u000d\\u0022\\u005c"'),
    ('"\u00e9"', '"\\u00E9"'), ('"dup"', '"dUp"'), ('"e\u0301"', '"\u00e9"'), ('"ab"', '"a"'),
    ('"\\ud83d\\ude00"', '"\\ud83d\\ude01"'), ('"\U0001F600a"', '"\\ud83d\\ude00b"'),
]  # the last five pairs differ


def json_texts(rng: random.Random) -> bytes:
    """A metadata candidate: valid JSON of varied shape, often broken in one targeted way."""
    def value(depth):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice([0, -1, 1.5, 1e300, -0.0, True, False, None, "", "x", "\u00e9\u2603",
                               "\U0001F600", "\x00\x1f\"\\/", 10 ** 30])
        if r < 0.65:
            return {rng.choice("abcxyz") + str(i): value(depth + 1) for i in range(rng.randint(0, 4))}
        return [value(depth + 1) for _ in range(rng.randint(0, 4))]

    doc = {f"k{i}": value(1) for i in range(rng.randint(0, 5))}
    text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
    kind = rng.randrange(14)
    if kind == 0 and len(text) > 2:  # two keys equal or not once unescaped (C compares decoded keys)
        a, b = rng.choice(_KEY_PAIRS)
        text = "{" + a + ":1," + (text[1:-1] + "," if len(text) > 2 and rng.random() < 0.5 else "") + b + ":2}"
    elif kind == 1:  # depth at / past the limit
        n = rng.choice([127, 128, 129, 1100])
        text = '{"a":' + "[" * (n - 1) + "]" * (n - 1) + "}"
    elif kind == 2:  # number length at / past the limit
        n = rng.choice([99, 100, 101, 5000])
        text = '{"n":' + rng.choice(["1" * n, "-" + "1" * (n - 1), "1." + "0" * (n - 2), "1e" + "0" * (n - 2)]) + "}"
    elif kind == 3:  # surrogate escapes
        text = '{"s":"' + rng.choice(["\\ud83d\\ude00", "\\ud83d", "\\ude00", "\\ud83dx", "\\ud83d\\u0041",
                                       "\\uDBFF\\uDFFF", "\\ud800\\ud800"]) + '"}'
    elif kind == 4:  # not JSON that Python's json would take
        text = rng.choice(['{"a":NaN}', '{"a":-Infinity}', '{"a":Infinity}', "[]", '"x"', "1", "",
                           " ", '{"a":1,}', "{'a':1}", '{"a":01}', '{"a":1.}', '{"a":.5}', '{"a":1e}',
                           '{"a":+1}', '{"a":tru}', '{"a":"\\x"}', '{"a":"\\u12"}', "{}{}", "{} x",
                           '\ufeff{}', '{"a":"\t"}', '{"a":[1,]}', '{"a" 1}', '{,}', "{}\x00"])
    raw = text.encode("utf-8", "surrogatepass")
    if kind == 5:  # invalid UTF-8 inside a string
        bad = rng.choice([b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xff", b"\x80", b"\xc3",
                          b"\xe2", b"\xe2\x82", b"\xf0\x9f", b"\xf0\x9f\x98", b"\xe0\x80\x80", b"\xf5\x80\x80\x80"])
        raw = b'{"s":"' + bad + rng.choice([b'"}', b""])
    elif kind == 6 and raw:  # one random byte changed
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.choice(_BYTES)]) + raw[i + 1:]
    elif kind == 7:
        raw = b" \t\r\n" + raw + b" \n"
    elif kind == 8 and raw:  # cut short, possibly inside an escape or a UTF-8 sequence
        raw = raw[: rng.randrange(len(raw))]
    return raw


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One fuzz case derived from a random seed bundle."""
    src = rng.choice(seeds)
    buf = bytearray(src)
    h = HEADER.unpack_from(src)
    data_offset, size = h[10], len(src)
    entries = entry_offsets(src)
    kind = rng.randrange(13)
    seal = rng.random() < 0.85
    if kind == 0:  # a header field set to an interesting value
        name = rng.choice(list(_HEADER_WIDTHS))
        off, w = HEADER_FIELDS[name], _HEADER_WIDTHS[name]
        cur = int.from_bytes(buf[off: off + w], "little")
        v = rng.choice(_U64 + [cur, cur, size, size - 1, size + 1, h[10], h[10] + 64, h[8] + h[9]])
        v = (v + rng.choice([0, 0, 0, 1, -1, 64, -64])) % (1 << (8 * w))
        buf[off: off + w] = v.to_bytes(w, "little")
    elif kind in (1, 2) and entries:  # a directory field set to an interesting value
        pos = rng.choice(entries)
        _, off, w = rng.choice(_ENTRY_WIDTHS)
        cur = int.from_bytes(buf[pos + off: pos + off + w], "little")
        v = rng.choice(_U64 + [cur + 1, cur - 1, cur + 64, cur * 2, size, size - cur])
        buf[pos + off: pos + off + w] = (v % (1 << (8 * w))).to_bytes(w, "little")
    elif kind == 3 and entries:  # tensor names: bad bytes, swapped order, duplicates
        pos = rng.choice(entries)
        n = struct.unpack_from("<H", buf, pos)[0]
        r = rng.random()
        if r < 0.5:
            buf[pos + ENTRY_SIZE + rng.randrange(n)] = rng.choice(_BYTES + [0x2E])
        elif len(entries) > 1:
            a, b = rng.sample(entries, 2)
            na, nb = struct.unpack_from("<H", buf, a)[0], struct.unpack_from("<H", buf, b)[0]
            k = min(na, nb)
            ta, tb = bytes(buf[a + ENTRY_SIZE: a + ENTRY_SIZE + k]), bytes(buf[b + ENTRY_SIZE: b + ENTRY_SIZE + k])
            buf[a + ENTRY_SIZE: a + ENTRY_SIZE + k] = tb if r < 0.75 else ta
            buf[b + ENTRY_SIZE: b + ENTRY_SIZE + k] = ta
    elif kind == 4:  # bit flips, mostly in the header blocks
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(data_offset if rng.random() < 0.7 or size == data_offset else size)
            buf[i] ^= 1 << rng.randrange(8)
        seal = rng.random() < 0.5
    elif kind == 5:  # interesting bytes anywhere
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(size)] = rng.choice(_BYTES)
        seal = rng.random() < 0.5
    elif kind == 6:  # truncation (sometimes with file_size fixed up so the deeper checks run)
        cut = rng.choice([rng.randrange(size), rng.randrange(min(size, data_offset + 1)),
                          rng.choice([0, 3, 4, 7, 8, 87, 88])])
        del buf[min(cut, size):]
        if rng.random() < 0.5 and len(buf) >= HEADER_SIZE:
            buf[16:24] = len(buf).to_bytes(8, "little")
    elif kind == 7:  # trailing bytes
        buf += bytes(rng.choice([1, 63, 64, 4096])) if rng.random() < 0.5 else bytes([0xFF]) * rng.randint(1, 100)
        if rng.random() < 0.5:
            buf[16:24] = len(buf).to_bytes(8, "little")
    elif kind == 8:  # splice two bundles
        other = rng.choice(seeds)
        buf = bytearray(src[: rng.randrange(size + 1)] + other[rng.randrange(len(other) + 1):])
        if rng.random() < 0.5 and len(buf) >= HEADER_SIZE:
            buf[16:24] = len(buf).to_bytes(8, "little")
    elif kind == 9:  # metadata bytes (re-sealed: the JSON validator sees them)
        mo, ms = h[8], h[9]
        for _ in range(rng.randint(1, 3)):
            buf[mo + rng.randrange(ms)] = rng.choice(_BYTES)
        seal = True
    elif kind in (10, 11):  # metadata replaced by a crafted JSON text
        raw = json_texts(rng)
        if h[5] == 0 and rng.random() < 0.7:
            # no tensors: left-pad so the JSON ends exactly at the end of the file, where any
            # read past the metadata is a read past the buffer (ASan sees it)
            raw = b" " * (-(HEADER_SIZE + h[7] + len(raw)) % h[3]) + raw
        return replace_metadata(src, raw)
    else:  # tensor data or padding changed; half the time with the tensor CRCs fixed (valid file)
        if size > data_offset:
            for _ in range(rng.randint(1, 3)):
                buf[rng.randrange(data_offset, size)] ^= 1 << rng.randrange(8)
        reseal(buf, tensors=rng.random() < 0.5)
        return bytes(buf)
    if seal:
        reseal(buf)
    return bytes(buf)


_NASTY_JSON = ('{"k\\u00e9\\ud83d\\ude00":["\u00e9\u2603\U0001F600",-1.5e+10,0,true,false,null,'
               '{"":"\\"\\\\\\/\\b\\f\\n\\r\\t\\u0000"}],"n":-0.0E-5}').encode()


def json_prefix_cases() -> list[bytes]:
    """Every prefix of a JSON text using each escape, multi-byte UTF-8 and number form, as the
    metadata of a tensor-less bundle whose JSON ends at the end of the file: a validator that
    reads one byte too far inside an escape or a UTF-8 sequence reads past the buffer."""
    empty = bundle_bytes([], {})
    out = []
    for n in range(len(_NASTY_JSON) + 1):
        raw = _NASTY_JSON[:n]
        out.append(replace_metadata(empty, b" " * (-(HEADER_SIZE + len(raw)) % 64) + raw))
    return out


def cases(seed: int, n: int) -> list[bytes]:
    """The seeds, every JSON prefix case, then random mutants: n bundles in all."""
    rng = random.Random(seed)
    seeds = seed_bundles()
    fixed = seeds + json_prefix_cases()
    return fixed + [mutate(rng, seeds) for _ in range(n - len(fixed))]


def write_corpus(path: str | os.PathLike, bufs: list[bytes]) -> None:
    """The `kdtr_tool fuzz` input: records of [u64 LE length][bytes]."""
    with io.open(path, "wb") as fh:
        for b in bufs:
            fh.write(len(b).to_bytes(8, "little"))
            fh.write(b)


def base_bundle() -> bytes:
    """The bundle the malformed cases edit: tensors a (f32 [2,3]), b (i32 [5]), c (u8 [7])."""
    return bundle_bytes([("a", np.arange(6, dtype=np.float32).reshape(2, 3)),
                         ("b", np.arange(5, dtype=np.int32)), ("c", np.arange(7, dtype=np.uint8))],
                        {"model": "tiny"})


def malformed_cases() -> list[tuple[str, bytes, str, int, str]]:
    """(case id, file bytes, field, byte offset, 'open' | 'verify'): one case per reader rule.

    The offset and field are what both readers must report; each edit is re-sealed (CRCs fixed)
    unless the case is about a CRC, so the rule under test is the first one to fail."""
    base = base_bundle()
    h = HEADER.unpack_from(base)
    size, dir_off, meta_off, meta_size, data_off = len(base), h[6], h[8], h[9], h[10]
    e0, e1, e2 = entry_offsets(base)
    meta_end = meta_off + meta_size
    out = []

    def case(cid, field, offset, edit=None, stage="open", seal=True, data=None):
        buf = bytearray(base if data is None else data)
        if edit:
            edit(buf)
        if seal:
            reseal(buf)
        out.append((cid, bytes(buf), field, offset, stage))

    def put(off, width, value):
        return lambda b: b.__setitem__(slice(off, off + width), (value % (1 << (8 * width))).to_bytes(width, "little"))

    def seq(*edits):
        def run(b):
            for ed in edits:
                ed(b)
        return run

    for cut, field, off in [(0, "header.magic", 0), (3, "header.magic", 0), (6, "header.version", 4),
                            (50, "header", 50), (87, "header", 87), (200, "header.file_size", 16),
                            (size - 1, "header.file_size", 16)]:
        case(f"truncated-{cut}", field, off, data=base[:cut], seal=False)
    case("truncated-with-fixed-size", "dir[2].nbytes", e2 + 80,
         seq(lambda b: b.__delitem__(slice(580, None)), put(16, 8, 580)))
    case("bad-magic", "header.magic", 0, put(0, 4, int.from_bytes(b"GGUF", "little")), seal=False)
    case("unknown-version", "header.version", 4, put(4, 4, 2))
    case("header-crc", "header.header_crc32", 84, put(40, 1, base[40] ^ 1), seal=False)
    case("header-size", "header.header_size", 8, put(8, 4, 96))
    for a in (0, 32, 96, 1 << 17):
        case(f"alignment-{a}", "header.alignment", 12, put(12, 4, a))
    case("trailing-bytes", "header.file_size", 16, lambda b: b.extend(bytes(64)), seal=False)
    case("header-reserved", "header.reserved", 80, put(80, 4, 1))
    case("dir-offset", "header.dir_offset", 32, put(32, 8, 96))
    case("dir-size-past-end", "header.dir_size", 40, put(40, 8, size))
    case("dir-size-huge", "header.dir_size", 40, put(40, 8, (1 << 64) - 1))
    case("tensor-count-huge", "header.tensor_count", 24, put(24, 8, (1 << 64) - 1))
    case("tensor-count-too-big-for-dir", "header.tensor_count", 24, put(24, 8, 4))
    case("meta-offset", "header.meta_offset", 48, put(48, 8, meta_off + 8))
    case("meta-size-huge", "header.meta_size", 56, put(56, 8, (1 << 64) - 1))
    case("meta-size-past-end", "header.meta_size", 56, put(56, 8, size - meta_off + 1))
    case("data-offset", "header.data_offset", 64, put(64, 8, data_off + 64))
    case("dir-crc", "header.dir_crc32", 72, put(e1 + 3, 1, 2), seal=False)
    case("meta-crc", "header.meta_crc32", 76, put(meta_off + 2, 1, 0x4d), seal=False)
    case("meta-padding", "padding", meta_end + 3, put(meta_end + 3, 1, 7))
    case("name-len-zero", "dir[0].name_len", e0, put(e0, 2, 0))
    case("name-len-over-cap", "dir[0].name_len", e0, put(e0, 2, 257))
    case("name-len-past-dir", "dir[2].name_len", e2, put(e2, 2, 200))
    for cid, byte in [("nul", 0), ("slash", 0x2F), ("backslash", 0x5C), ("space", 0x20), ("non-utf8", 0xFF),
                      ("non-ascii", 0xC3)]:
        case(f"name-{cid}", "dir[1].name", e1 + ENTRY_SIZE, put(e1 + ENTRY_SIZE, 1, byte))
    case("name-dotdot", "dir[1].name", e1 + ENTRY_SIZE,
         seq(put(e1, 2, 3), put(e1 + ENTRY_SIZE, 3, int.from_bytes(b"..b", "little"))))
    case("name-dot", "dir[0].name", e0 + ENTRY_SIZE, put(e0 + ENTRY_SIZE, 1, ord(".")))
    case("name-padding", "dir[1].name", e1 + ENTRY_SIZE, put(e1 + ENTRY_SIZE + 5, 1, 1))
    case("name-duplicate", "dir[1].name", e1 + ENTRY_SIZE, put(e1 + ENTRY_SIZE, 1, ord("a")))
    case("name-unsorted", "dir[1].name", e1 + ENTRY_SIZE,
         seq(put(e0 + ENTRY_SIZE, 1, ord("z")), put(e1 + ENTRY_SIZE, 1, ord("y"))))
    # 6 entries of 112 bytes: a 672-byte directory "fits" floor(672 / 96) = 7 entries by the count check
    six = bundle_bytes([(f"tensor_{i}_", np.zeros(1, np.uint8)) for i in range(6)], {})
    case("entry-past-dir", "dir[6]", dir_off + 672, put(24, 8, 7), data=six)
    case("dtype-unknown", "dir[1].dtype", e1 + 2, put(e1 + 2, 1, 0x24))
    case("dtype-zero", "dir[1].dtype", e1 + 2, put(e1 + 2, 1, 0))
    case("rank-over-cap", "dir[1].rank", e1 + 3, put(e1 + 3, 1, 9))
    case("packing-unknown", "dir[2].packing", e2 + 4, put(e2 + 4, 1, 2))
    case("packing-int4-on-f32", "dir[0].packing", e0 + 4, put(e0 + 4, 1, 1))
    case("packing-int4-0d", "dir[2].packing", e2 + 4,
         seq(put(e2 + 4, 1, 1), put(e2 + 3, 1, 0), put(e2 + 8, 8, 0), put(e2 + 80, 8, 1)))
    case("entry-reserved", "dir[0].reserved", e0 + 5, put(e0 + 6, 1, 1))
    case("entry-reserved2", "dir[0].reserved", e0 + 5, put(e0 + 92, 4, 1))
    case("dims-beyond-rank", "dir[1].dims", e1 + 16, put(e1 + 16, 8, 5))
    case("dims-overflow-u64", "dir[0].dims", e0 + 8, seq(put(e0 + 8, 8, 1 << 32), put(e0 + 16, 8, 1 << 32)))
    case("dims-over-i64", "dir[1].dims", e1 + 8, put(e1 + 8, 8, 1 << 63))
    case("dims-zero-times-huge", "dir[0].dims", e0 + 8, seq(put(e0 + 8, 8, 0), put(e0 + 16, 8, 1 << 62)))
    case("nbytes-mismatch", "dir[1].nbytes", e1 + 80, put(e1 + 80, 8, 24))
    case("offset-unaligned", "dir[1].offset", e1 + 72, put(e1 + 72, 8, 512 + 4))
    case("offset-overlap", "dir[1].offset", e1 + 72, put(e1 + 72, 8, 448))
    case("offset-gap", "dir[1].offset", e1 + 72, put(e1 + 72, 8, 576))
    case("offset-huge", "dir[1].offset", e1 + 72, put(e1 + 72, 8, (1 << 64) - 64))
    case("tensor-past-end", "dir[2].nbytes", e2 + 80, seq(put(e2 + 8, 8, 100), put(e2 + 80, 8, 100)))
    case("directory-trailing", "directory", e2, put(24, 8, 2))
    case("data-trailing", "file_size", size, seq(lambda b: b.extend(bytes(64)), put(16, 8, size + 64)))

    def with_meta(raw):
        return replace_metadata(base, raw)
    # every metadata problem is reported at the metadata's start (docs/kdtr-format.md §7 rule 23)
    for cid, raw in [("meta-utf8", b'{"model":"\xff"}'), ("meta-json", b'{"model":tiny}'),
                     ("meta-not-object", b'["model"]'), ("meta-dup-key", b'{"a":1,"a":2}'),
                     ("meta-dup-key-escaped", b'{"a":1,"\\u0061":2}'), ("meta-nan", b'{"a":NaN}'),
                     ("meta-depth", b'{"a":' + b"[" * 128 + b"]" * 128 + b"}"),
                     ("meta-long-number", b'{"a":' + b"1" * 101 + b"}"),
                     ("meta-lone-surrogate", b'{"a":"\\ud800"}'), ("meta-empty", b"")]:
        out.append((cid, with_meta(raw), "metadata", meta_off, "open"))
    last = HEADER.unpack_from(base)[4]
    case("crc-mismatch", "dir[1].crc32", 512, put(512, 1, 99), stage="verify")
    case("tensor-padding", "padding", 512 + 20, put(512 + 20, 1, 1), stage="verify")
    case("final-padding", "padding", last - 1, put(last - 1, 1, 1), stage="verify")
    return out
