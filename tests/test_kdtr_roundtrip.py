"""KDTR writer + reader: round trips, canonical bytes, zero-copy views, streaming, write-side checks."""

import gc
import hashlib
import mmap
import tracemalloc
import weakref

import numpy as np
import pytest

from k2vec.errors import K2VecError
from k2vec.kdtr import (
    DEFAULT_ALIGNMENT, KdtrError, TensorData, bf16, bf16_to_f32, f32_to_bf16, int4, open_bundle,
    open_bundle_buffer, write_bundle,
)

NUMPY_DTYPES = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
                "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
                "f16": np.float16, "f32": np.float32, "f64": np.float64}
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 5), (1, 2, 1, 2, 1, 2, 1, 2)]


def _values(dtype, shape, rng):
    n = int(np.prod(shape))
    if np.dtype(dtype).kind == "f":
        v = rng.standard_normal(n) * 100
        if n >= 3:
            v[:3] = [np.nan, -np.inf, -0.0]
        return v.astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True).reshape(shape)


def test_round_trip_every_dtype_and_shape(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"{name}.{i}": _values(dt, shape, rng)
              for name, dt in NUMPY_DTYPES.items() for i, shape in enumerate(SHAPES)}
    bits = rng.integers(0, 1 << 16, size=(4, 3), dtype=np.uint16)
    write_bundle(tmp_path / "b.kdtr", {**arrays, "bf16.0": bf16(bits), "bf16.s": bf16(np.uint16(0x3F80))},
                 {"what": "round trip"})
    with open_bundle(tmp_path / "b.kdtr", verify=True) as b:
        assert b.metadata == {"what": "round trip"}
        assert len(b) == len(arrays) + 2
        for name, want in arrays.items():
            got = b[name]
            assert b.info(name).dtype == name.split(".")[0]
            assert got.dtype == want.dtype.newbyteorder("<") and got.shape == want.shape
            assert got.tobytes() == want.tobytes()  # bit-exact: NaN payloads, -0.0
        assert b.info("bf16.0").dtype == "bf16" and b["bf16.0"].dtype == np.uint16
        np.testing.assert_array_equal(b["bf16.0"], bits)
        assert b["bf16.s"].shape == () and bf16_to_f32(b["bf16.s"]) == 1.0


def test_big_endian_and_non_contiguous_inputs_are_stored_little_endian_c_order(tmp_path):
    a = np.arange(12, dtype=">i4").reshape(3, 4)
    write_bundle(tmp_path / "b.kdtr", {"be": a, "t": a.T}, {})
    with open_bundle(tmp_path / "b.kdtr", verify=True) as b:
        assert b["be"].dtype == np.dtype("<i4")
        np.testing.assert_array_equal(b["be"], a)
        np.testing.assert_array_equal(b["t"], a.T)


def test_bf16_conversion_rounds_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, np.inf, 3.4e38, 1e-40], np.float32)
    assert f32_to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0x7F80, 0x0001]
    nan = f32_to_bf16(np.array([np.nan], np.float32))
    assert np.isnan(bf16_to_f32(nan))[0]
    y = np.array([1.0, -0.5, 65280.0], np.float32)  # exactly representable
    np.testing.assert_array_equal(bf16_to_f32(f32_to_bf16(y)), y)


def test_int4_packing_is_recorded_in_the_directory(tmp_path):
    q = np.arange(16, dtype=np.uint8).reshape(2, 8)
    write_bundle(tmp_path / "b.kdtr", {"w.qw": int4(lambda: q), "w.sc": np.ones((2, 1), np.float32)}, {})
    with open_bundle(tmp_path / "b.kdtr") as b:
        assert b.info("w.qw").packing == "int4" and b.info("w.sc").packing == ""
        assert b.lines()[0].startswith("w.qw u8:int4 [2,8] ")
        np.testing.assert_array_equal(b["w.qw"], q)
    with pytest.raises(KdtrError, match="packing 'int4' needs dtype u8"):
        write_bundle(tmp_path / "c.kdtr", {"x": TensorData(np.zeros(2, np.int8), packing="int4")}, {})


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_identical_inputs_give_byte_identical_files(tmp_path):
    rng = np.random.default_rng(3)
    arrays = [(f"layer.{i}.w", rng.standard_normal((i + 1, 5)).astype(np.float32)) for i in range(12)]
    meta = {"model": {"name": "tiny", "dims": [1, 2]}, "prompts": ["a", "b"], "version": "0.1"}
    write_bundle(tmp_path / "a.kdtr", arrays, meta)
    # same content: reversed order, callables instead of arrays, metadata keys in another order
    write_bundle(tmp_path / "b.kdtr", [(n, (lambda a=a: a.copy())) for n, a in reversed(arrays)],
                 {"version": "0.1", "prompts": ["a", "b"], "model": {"dims": [1, 2], "name": "tiny"}})
    assert _sha(tmp_path / "a.kdtr") == _sha(tmp_path / "b.kdtr")
    write_bundle(tmp_path / "c.kdtr", arrays, {**meta, "version": "0.2"})
    assert _sha(tmp_path / "a.kdtr") != _sha(tmp_path / "c.kdtr")


def test_layout_is_sorted_contiguous_aligned_and_has_no_trailing_bytes(tmp_path):
    rng = np.random.default_rng(4)
    names = ["z", "a.b", "a", "m.0", "m.10", "m.2", "empty"]
    tensors = {n: rng.standard_normal(rng.integers(0, 3000)).astype(np.float32) for n in names}
    tensors["empty"] = np.zeros(0, np.float32)
    infos = write_bundle(tmp_path / "b.kdtr", tensors, {})
    size = (tmp_path / "b.kdtr").stat().st_size
    assert [t.name for t in infos] == sorted(names, key=str.encode)
    assert all(t.offset % DEFAULT_ALIGNMENT == 0 for t in infos)
    for prev, nxt in zip(infos, infos[1:]):
        assert nxt.offset == -(-(prev.offset + prev.nbytes) // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    last = infos[-1]
    assert size == -(-(last.offset + last.nbytes) // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
    with open_bundle(tmp_path / "b.kdtr") as b:
        assert b.tensors == infos


def test_small_alignment_keeps_tiny_bundles_small(tmp_path):
    t = {f"t{i}": np.zeros(3, np.float32) for i in range(10)}
    write_bundle(tmp_path / "64.kdtr", t, {}, alignment=64)
    write_bundle(tmp_path / "4k.kdtr", t, {})
    assert (tmp_path / "64.kdtr").stat().st_size < 2000
    assert (tmp_path / "4k.kdtr").stat().st_size == 11 * 4096
    with open_bundle(tmp_path / "64.kdtr", verify=True) as b:
        assert b.alignment == 64


def test_reader_returns_read_only_views_into_the_mapping(tmp_path):
    write_bundle(tmp_path / "b.kdtr", {"x": np.arange(1000, dtype=np.float32)}, {}, alignment=64)
    b = open_bundle(tmp_path / "b.kdtr")
    x = b["x"]
    assert not x.flags.owndata and not x.flags.writeable
    root = x
    while isinstance(root, np.ndarray):
        root = root.base
    assert isinstance(root.obj if isinstance(root, memoryview) else root, mmap.mmap)
    assert np.shares_memory(x, b["x"])
    # over a caller's buffer the view sees later writes: no copy was made
    data = bytearray((tmp_path / "b.kdtr").read_bytes())
    view = open_bundle_buffer(data)["x"]
    data[b.info("x").offset: b.info("x").offset + 4] = np.float32(42).tobytes()
    assert view[0] == 42
    b.close()
    assert x[999] == 999  # a live view keeps the mapping alive after close()
    with pytest.raises(ValueError, match="closed"):
        b["x"]


def test_writer_streams_callables_one_tensor_at_a_time(tmp_path):
    calls, alive = [], []

    def make(name):
        def produce():
            gc.collect()
            assert all(ref() is None for ref in alive), "previous tensor still referenced"
            calls.append(name)
            arr = np.full(1000, len(calls), np.float64)
            alive.append(weakref.ref(arr))
            return arr
        return produce

    names = ["c", "a", "b", "d"]
    write_bundle(tmp_path / "b.kdtr", [(n, make(n)) for n in names], {})
    assert calls == ["a", "b", "c", "d"]  # once each, in canonical order


def test_failed_write_leaves_neither_file_nor_temp(tmp_path):
    (tmp_path / "b.kdtr").write_bytes(b"old")

    def boom():
        raise RuntimeError("generator failed")

    with pytest.raises(RuntimeError):
        write_bundle(tmp_path / "b.kdtr", {"a": np.zeros(3), "b": boom}, {})
    assert (tmp_path / "b.kdtr").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.kdtr"]


@pytest.mark.parametrize("name", ["", "a/b", "a..b", "..", ".", "a\0b", "a b", "tab\t", "é", "a\\b", "x" * 257, 3])
def test_writer_rejects_bad_names(tmp_path, name):
    with pytest.raises(KdtrError, match="name"):
        write_bundle(tmp_path / "b.kdtr", [(name, np.zeros(1))], {})
    assert not (tmp_path / "b.kdtr").exists()


def test_writer_accepts_longest_name(tmp_path):
    write_bundle(tmp_path / "b.kdtr", [("x" * 256, np.zeros(1))], {})
    assert open_bundle(tmp_path / "b.kdtr").tensors[0].name == "x" * 256


@pytest.mark.parametrize("tensors, match", [
    ([("a", np.zeros(1)), ("a", np.zeros(1))], "duplicate tensor name"),
    ({"a": np.zeros(2, bool)}, "unsupported numpy dtype bool"),
    ({"a": np.zeros(2, np.complex64)}, "unsupported numpy dtype"),
    ({"a": np.array(["x"], object)}, "unsupported numpy dtype"),
    ({"a": np.zeros((1,) * 9)}, "rank 9"),
    ({"a": [1, 2]}, "numpy array"),
    ({"a": lambda: 5}, "numpy array"),
    ({"a": bf16(np.zeros(2, np.float32))}, "cannot be stored as bf16"),
    ({"a": TensorData(np.zeros(2), dtype="q8")}, "unknown KDTR dtype"),
    ({"a": TensorData(np.zeros(2, np.uint8), packing="int3")}, "unknown packing"),
    ({"a": int4(np.uint8(3))}, "0-d"),
    ([("a", np.zeros(1), "extra")], "pairs"),
])
def test_writer_rejects_bad_tensors(tmp_path, tensors, match):
    with pytest.raises(KdtrError, match=match):
        write_bundle(tmp_path / "b.kdtr", tensors, {})
    assert not (tmp_path / "b.kdtr").exists()


def _nested(depth):
    v = []
    for _ in range(depth - 1):
        v = [v]
    return v


@pytest.mark.parametrize("metadata, match", [
    ([1], "must be a dict"),
    ({"x": float("nan")}, "strict JSON"),
    ({"x": object()}, "strict JSON"),
    ({1: "a", "1": "b"}, "strict JSON"),  # mixed key types cannot be sorted
    ({"big": 10**200}, "number of 201 characters"),
    ({"s": "\ud800"}, "strict JSON"),
    ({"deep": _nested(130)}, "deeper than 128"),
])
def test_writer_rejects_metadata_the_reader_would_reject(tmp_path, metadata, match):
    with pytest.raises(KdtrError, match=match):
        write_bundle(tmp_path / "b.kdtr", {}, metadata)


@pytest.mark.parametrize("alignment", [0, 32, 96, 1 << 17])
def test_writer_rejects_bad_alignment(tmp_path, alignment):
    with pytest.raises(KdtrError, match="alignment"):
        write_bundle(tmp_path / "b.kdtr", {}, {}, alignment=alignment)


def test_empty_bundle(tmp_path):
    write_bundle(tmp_path / "b.kdtr", [], {})
    assert (tmp_path / "b.kdtr").stat().st_size == 4096
    with open_bundle(tmp_path / "b.kdtr", verify=True) as b:
        assert len(b) == 0 and b.metadata == {} and b.lines() == []


def test_open_reads_no_tensor_data_and_verify_finds_corruption(tmp_path):
    big = np.arange(8 << 20, dtype=np.float32)  # 32 MiB
    write_bundle(tmp_path / "b.kdtr", {"a": np.ones(10, np.float32), "big": big, "z": np.ones(3)}, {})
    path = tmp_path / "b.kdtr"
    with open_bundle(path) as b:
        off = b.info("big").offset
    with open(path, "r+b") as fh:  # corrupt the big tensor and the last one
        fh.seek(off + 12345)
        fh.write(b"\xff")
    tracemalloc.start()
    b = open_bundle(path)  # structure is fine: opening never looks at tensor bytes
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256 << 10
    with pytest.raises(KdtrError) as e:
        b.verify(workers=2)  # threaded path (> 32 MiB)
    assert e.value.field == "dir[1].crc32" and e.value.offset == off and "'big'" in str(e.value)
    assert isinstance(e.value, K2VecError)
    with pytest.raises(KdtrError, match=r"dir\[1\]\.crc32"):
        open_bundle(path, verify=True)


def test_verify_reports_the_first_bad_tensor_in_file_order(tmp_path):
    write_bundle(tmp_path / "b.kdtr", {n: np.full(100, i, np.int32) for i, n in enumerate("abcd")}, {}, alignment=64)
    data = bytearray((tmp_path / "b.kdtr").read_bytes())
    b = open_bundle_buffer(bytes(data))
    for name in ("d", "b"):
        data[b.info(name).offset] ^= 1
    for workers in (1, 4):
        with pytest.raises(KdtrError, match=r"dir\[1\]\.crc32.*'b'"):
            open_bundle_buffer(bytes(data)).verify(workers=workers)


def test_missing_tensor_is_a_key_error(tmp_path):
    write_bundle(tmp_path / "b.kdtr", {"a": np.zeros(1)}, {})
    with open_bundle(tmp_path / "b.kdtr") as b:
        assert "a" in b and "b" not in b and list(b) == ["a"]
        with pytest.raises(KeyError):
            b["b"]


def test_spec_worked_example_is_what_the_writer_writes(tmp_path):
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "kdtr-format.md").read_text()
    block = doc.split("<!-- kdtr-example-begin -->")[1].split("<!-- kdtr-example-end -->")[0]
    want = bytes(int(h, 16) for line in block.strip().strip("`").strip().splitlines()
                 for h in line.split(":", 1)[1].split("  ")[0].split())
    write_bundle(tmp_path / "tiny.kdtr", {"w": np.array([1.0, -2.0], np.float32)}, {"model": "tiny"}, alignment=64)
    assert (tmp_path / "tiny.kdtr").read_bytes() == want
    assert open_bundle(tmp_path / "tiny.kdtr").lines() == ["w f32 [2] 256 8 c3872656"]


def test_writer_enforces_the_header_caps_readers_enforce(tmp_path, monkeypatch):
    import k2vec.kdtr.format as fmt
    import k2vec.kdtr.writer as wr
    monkeypatch.setattr(wr, "MAX_DIR_SIZE", 20 * 104 - 1)
    with pytest.raises(KdtrError, match=r"20 tensors need a 2080-byte directory"):
        write_bundle(tmp_path / "b.kdtr", {f"t{i:02d}": np.zeros(1) for i in range(20)}, {})
    monkeypatch.setattr(fmt, "MAX_META_SIZE", 100)
    with pytest.raises(KdtrError, match=r"bytes of JSON, more than 100"):
        write_bundle(tmp_path / "b.kdtr", {}, {"x": "y" * 100})
    assert not (tmp_path / "b.kdtr").exists()
