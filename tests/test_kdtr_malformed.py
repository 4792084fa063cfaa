"""Every reader rule, one malformed bundle each: KdtrError naming the field and the byte offset.

The cases live in k2vec.kdtr.fuzz.malformed_cases so that tests/test_kdtr_c.py holds the C
reader to the very same field and offset."""

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
    assert err.field == field
    if offset is not None:
        assert err.offset == offset
    assert f"offset {err.offset} ({field}):" in str(err)
    assert peak < len(data) + ALLOC_SLACK
    # the same verdict through the mmap path
    path = tmp_path / f"{cid}.kdtr"
    path.write_bytes(data)
    with pytest.raises(KdtrError) as e2:
        open_bundle(path, verify=True)
    assert (e2.value.field, e2.value.offset) == (err.field, err.offset)
    assert str(path) in str(e2.value)


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
