"""Every reader rule, one malformed bundle each: KdtrError naming the field and the byte offset.

The cases live in k2vec.kdtr.fuzz.malformed_cases so that tests/test_kdtr_c.py holds the C
reader to the very same field and offset."""

import struct
import tracemalloc

import pytest

from k2vec.kdtr import KdtrError, open_bundle, open_bundle_buffer
from k2vec.kdtr.fuzz import base_bundle, malformed_cases

CASES = malformed_cases()
ALLOC_SLACK = 64 << 10  # Python objects for a handful of entries; nothing that scales with a length field


def test_base_bundle_is_valid_so_each_case_fails_for_its_own_reason():
    base = base_bundle()
    b = open_bundle_buffer(base, verify=True)
    assert [t.name for t in b.tensors] == ["a", "b", "c"]
    assert len({c[0] for c in CASES}) == len(CASES)
    assert all(c[1] != base for c in CASES)


@pytest.mark.parametrize("cid, data, field, offset, stage", CASES, ids=[c[0] for c in CASES])
def test_malformed_bundle_is_rejected(tmp_path, cid, data, field, offset, stage):
    tracemalloc.start()
    try:
        if stage == "verify":
            b = open_bundle_buffer(data)  # the structure is fine; only the bytes are wrong
            with pytest.raises(KdtrError) as e:
                b.verify()
        else:
            with pytest.raises(KdtrError) as e:
                open_bundle_buffer(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = e.value
    assert (err.field, err.offset) == (field, offset)
    assert f"offset {err.offset} ({field}):" in str(err)
    assert peak < len(data) + ALLOC_SLACK
    # the same verdict through the mmap path
    path = tmp_path / f"{cid}.kdtr"
    path.write_bytes(data)
    with pytest.raises(KdtrError) as e2:
        open_bundle(path, verify=True)
    assert (e2.value.field, e2.value.offset) == (err.field, err.offset)
    assert str(path) in str(e2.value)


@pytest.mark.parametrize("cid, reason", [
    ("meta-utf8", "not valid UTF-8 (invalid start byte) at metadata byte 10"),
    ("meta-json", "not valid JSON: Expecting value at metadata byte 9"),
    ("meta-not-object", "top level is a JSON list, not an object"),
    ("meta-dup-key", "duplicate key 'a'"),
    ("meta-dup-key-escaped", "duplicate key 'a'"),
    ("meta-nan", "NaN is not JSON"),
    ("meta-depth", "nested deeper than 128"),
    ("meta-long-number", "number of 101 characters (max 100)"),
    ("meta-lone-surrogate", "string with an unpaired UTF-16 surrogate escape"),
    ("meta-empty", "not valid JSON: Expecting value at metadata byte 0"),
])
def test_metadata_errors_are_at_the_block_start(cid, reason):
    """A metadata error's offset is meta_offset, the block's start (docs/kdtr-format.md, rule 23): the
    Python and C JSON parsers stop at different bytes for some texts, so the offset both must agree on
    is the block's; where the parser knows the byte inside the block, the reason names it."""
    data = next(c[1] for c in CASES if c[0] == cid)
    meta_offset = struct.unpack_from("<Q", data, 48)[0]   # header field meta_offset
    with pytest.raises(KdtrError) as e:
        open_bundle_buffer(data)
    assert (e.value.field, e.value.offset) == ("metadata", meta_offset)
    assert str(e.value).endswith(f"offset {meta_offset} (metadata): {reason}")


def test_every_case_has_an_offset():
    assert all(type(c[3]) is int and 0 <= c[3] <= len(c[1]) for c in CASES), \
        [c[0] for c in CASES if type(c[3]) is not int]


def test_rules_from_the_spec_each_have_a_case():
    ids = {c[0] for c in CASES}
    for needed in ["truncated-0", "bad-magic", "unknown-version", "dir-size-past-end", "meta-size-past-end",
                   "tensor-count-huge", "dims-overflow-u64", "tensor-past-end", "offset-overlap",
                   "offset-unaligned", "name-duplicate", "name-nul", "name-slash", "name-dotdot",
                   "name-non-utf8", "name-len-zero", "dtype-unknown", "nbytes-mismatch", "crc-mismatch",
                   "meta-utf8", "meta-json", "meta-not-object", "meta-dup-key", "header-crc", "dir-crc",
                   "meta-crc", "trailing-bytes", "data-trailing", "offset-gap", "final-padding"]:
        assert needed in ids


def test_empty_file(tmp_path):
    (tmp_path / "e.kdtr").write_bytes(b"")
    with pytest.raises(KdtrError, match=r"offset 0 \(header.magic\): file is 0 bytes"):
        open_bundle(tmp_path / "e.kdtr")
