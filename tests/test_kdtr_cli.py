"""`python -m k2vec.kdtr`: list, inspect, verify, diff, dump."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k2vec.digests import record_path, recorded, sha256_file, write_record
from k2vec.kdtr import bf16, bf16_to_f32, f32_to_bf16, int4, open_bundle, write_bundle
from k2vec.kdtr.cli import main

REPO = Path(__file__).resolve().parents[1]


def cli(*args):
    out = io.StringIO()
    rc = main([str(a) for a in args], out=out)
    return rc, out.getvalue()


def _changed():
    changed = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    changed[1, 2] += 0.25   # 1/11 -> 1/11 + 1/4: abs 0.25, rel 0.25 / max(|a|, |b|) = 0.7333
    changed[2, 3] = 2.0     # 1 -> 2: abs 1, rel 0.5
    return changed


@pytest.fixture
def pair(tmp_path):
    base = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    a = {"same": np.arange(5, dtype=np.int64), "f": base, "i": np.arange(10, dtype=np.int32),
         "bf": bf16(f32_to_bf16(base)), "shape": np.zeros((2, 2), np.float32), "gone": np.zeros(1, np.uint8),
         "q": int4(np.zeros(4, np.uint8))}
    changed = _changed()
    b = dict(a, f=changed, i=np.where(np.arange(10) == 3, 1000, np.arange(10)).astype(np.int32),
             bf=bf16(f32_to_bf16(changed)), shape=np.zeros((4,), np.float32), new=np.ones(2, np.float16))
    del b["gone"]
    meta_a = {"model": {"name": "tiny", "layers": 2}, "prompts": ["hi", "yo"], "old": True}
    meta_b = {"model": {"name": "tiny", "layers": 3}, "prompts": ["hi", "yo", "x"], "new": 1}
    write_bundle(tmp_path / "a.kdtr", a, meta_a, alignment=64)
    write_bundle(tmp_path / "b.kdtr", b, meta_b, alignment=64)
    return tmp_path / "a.kdtr", tmp_path / "b.kdtr"


def test_list_and_inspect_table_are_the_canonical_lines(pair):
    a, _ = pair
    rc, listed = cli("list", a)
    assert rc == 0
    header, *lines = listed.splitlines()
    assert header == "# name dtype shape offset nbytes crc32"
    assert [ln.split()[0] for ln in lines] == ["bf", "f", "gone", "i", "q", "same", "shape"]
    assert lines[1].split()[1:3] == ["f32", "[3,4]"] and len(lines[1].split()[-1]) == 8
    assert lines[4].split()[1] == "u8:int4"
    assert cli("inspect", "--table", a) == (0, listed)


def test_inspect_summarises_header_table_and_metadata(pair):
    rc, text = cli("inspect", pair[0])
    assert rc == 0
    assert "KDTR v1" in text and "alignment 64" in text and "7 tensors" in text
    assert text.splitlines()[1:3] == ["# name dtype shape offset nbytes crc32", cli("list", pair[0])[1].splitlines()[1]]
    assert "  model: object, 2 keys: layers, name" in text  # canonical JSON: sorted keys
    assert "  prompts: array, 2 items" in text and "  old: true" in text


def test_verify_exit_status(pair, tmp_path, capsys):
    rc, text = cli("verify", *pair)
    assert rc == 0 and text.count(": OK, ") == 2
    data = bytearray(pair[0].read_bytes())
    data[-1] ^= 0xFF
    bad = tmp_path / "bad.kdtr"
    bad.write_bytes(data)
    rc, _ = cli("verify", pair[0], bad)
    assert rc == 1
    assert f"{bad}: FAILED: " in capsys.readouterr().err
    assert cli("list", tmp_path / "nope.kdtr")[0] == 1


def test_verify_checks_the_sha256_record_beside_the_bundle(pair, tmp_path, capsys):
    a, b = pair
    write_record(a)
    rc, text = cli("verify", a, b)
    assert rc == 0
    assert f"{a}: OK, 7 tensors, " in text and "(crc32 of 7 tensors, sha256 record a.kdtr.sha256 OK)" in text
    assert f"{b}: OK, " in text and "(crc32 of 7 tensors, no .sha256 record beside it)" in text
    # b's bytes under a's name: every CRC holds, only the record can tell
    want, got = recorded(a), sha256_file(b)
    a.write_bytes(b.read_bytes())
    rc, text = cli("verify", a)
    err = capsys.readouterr().err
    assert rc == 1 and text == ""
    assert f"{a}: FAILED: " in err and "a.kdtr.sha256" in err and want in err and got in err
    record_path(a).write_text("not a record\n")
    assert cli("verify", a)[0] == 1 and "not a sha256 record of a.kdtr" in capsys.readouterr().err


def test_verify_of_a_sha256_record_points_at_its_bundle(pair, capsys):
    a, b = pair
    write_record(a)
    rc, text = cli("verify", record_path(a), b)
    assert rc == 2 and f"{b}: OK, " in text  # the other files are still verified
    assert f"{a}.sha256: this is a sha256 record; verify the bundle it describes: {a}\n" in capsys.readouterr().err


def test_diff_reports_tensors_and_metadata(pair):
    rc, text = cli("diff", *pair)
    assert rc == 1
    lines = text.splitlines()
    assert "- gone: only in A (u8 [1])" in lines
    assert "+ new: only in B (f16 [2])" in lines
    assert "~ shape: f32 [2,2] vs f32 [4]" in lines
    f = next(ln for ln in lines if ln.startswith("~ f "))
    assert f.endswith("2/12 elements differ, max_abs 1, max_rel 0.733333")
    # bf16 is compared by value: 1 -> 2 is bits 0x3f80 -> 0x4000 (128 apart; 245 at the other element),
    # a value difference of exactly 1
    bits_a, bits_b = f32_to_bf16(np.linspace(-1, 1, 12, dtype=np.float32)), f32_to_bf16(_changed())
    va, vb = [(x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for x in (bits_a, bits_b.ravel())]
    differ = va != vb
    rel = (np.abs(va - vb) / np.maximum(np.abs(va), np.abs(vb)))[differ].max()
    assert np.abs(bits_a.astype(np.int64) - bits_b.ravel()).max() == 245 and np.abs(va - vb).max() == 1
    assert f"~ bf bf16 [3,4]: 2/12 elements differ, max_abs 1, max_rel {rel:.6g}" in lines
    assert "~ i i32 [10]: 1/10 elements differ, 2/40 bytes differ" in lines  # 3 -> 1000 = 0x3e8
    assert not any(ln.startswith(("~ same", "~ q")) for ln in lines)
    assert "~ metadata model.layers: 2 vs 3" in lines
    assert "+ metadata prompts.2: only in B (\"x\")" in lines
    assert "- metadata old: only in A (true)" in lines and "+ metadata new: only in B (1)" in lines
    assert lines[-1] == "6 tensor differences, 4 metadata differences"


def test_diff_orders_list_indices_as_numbers(tmp_path):
    # Sorted as text, "prompts.10" would come before "prompts.2".
    prompts = [f"p{i}" for i in range(12)]
    changed = list(prompts)
    changed[2], changed[10] = "two", "ten"
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    write_bundle(a, {}, {"prompts": prompts, "x": {"10": 1, "9": 1}}, alignment=64)
    write_bundle(b, {}, {"prompts": changed, "x": {"10": 2, "9": 2}}, alignment=64)
    rc, text = cli("diff", a, b)
    assert rc == 1
    assert text.splitlines() == ['~ metadata prompts.2: "p2" vs "two"', '~ metadata prompts.10: "p10" vs "ten"',
                                 "~ metadata x.10: 1 vs 2", "~ metadata x.9: 1 vs 2",  # object keys stay text
                                 "0 tensor differences, 4 metadata differences"]


def test_diff_of_identical_bundles_is_clean(pair):
    rc, text = cli("diff", "--all", pair[0], pair[0])
    assert rc == 0
    assert "= f: identical" in text and text.splitlines()[-1] == "0 tensor differences, 0 metadata differences"


def test_diff_of_a_bad_bundle_is_status_2(pair, tmp_path):
    (tmp_path / "x.kdtr").write_bytes(b"KDTR")
    assert cli("diff", pair[0], tmp_path / "x.kdtr")[0] == 2


def test_module_entry_point(pair):
    r = subprocess.run([sys.executable, "-m", "k2vec.kdtr", "list", str(pair[0])], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=60)
    assert r.returncode == 0 and r.stdout == cli("list", pair[0])[1]


def test_tensor_diff_nan_inf_and_signed_zero():
    from k2vec.kdtr.cli import tensor_diff
    a = np.array([np.nan, 1.0, 0.0, 5.0], np.float32)
    assert tensor_diff(a, a.copy(), "f32") is None
    assert tensor_diff(a, np.array([np.nan, 1.0, -0.0, 5.0], np.float32), "f32").startswith(
        "0/4 elements differ in value")
    got = tensor_diff(a, np.array([np.nan, np.inf, 0.0, 4.0], np.float32), "f32")
    assert got == "2/4 elements differ, max_abs 1, max_rel 0.2, 1 inf/nan mismatches"
    got = tensor_diff(a, np.array([1.0, 1.0, 0.0, 5.0], np.float32), "f32")
    assert got == "1/4 elements differ, max_abs 0, max_rel 0, 1 inf/nan mismatches"


def test_list_into_a_closed_pipe_ends_quietly(tmp_path):
    # Enough tensors that the listing overflows the pipe's buffer after `head` has gone.
    path = tmp_path / "many.kdtr"
    write_bundle(path, {f"t{i:05d}": np.zeros(1, np.float32) for i in range(5000)}, {})
    res = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m k2vec.kdtr list {path} | head -1"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0 and res.stderr == "", (res.returncode, res.stderr)
    assert res.stdout.count("\n") == 1


@pytest.fixture
def dumpable(tmp_path):
    rng = np.random.default_rng(7)
    f = rng.standard_normal((3, 5)).astype(np.float32)  # values that need all 9 significant digits
    bits = f32_to_bf16(np.array([0.1, -3.5, np.nan, np.inf, -0.0, 1e-40], np.float32))
    tensors = {"f": f, "bf": bf16(bits), "i": np.arange(-12, 12, dtype=np.int32).reshape(3, 4, 2),
               "u": np.array([0, 2**64 - 1], np.uint64), "h": np.array([0.5, 65504.0], np.float16),
               "s": np.float64(-1.25), "layer.qw": int4(np.array([[0x80, 0x7f], [0x0f, 0xf0]], np.uint8))}
    meta = {"model": {"name": "tiny", "eps": 1e-05, "big": 2**63 - 1}, "prompts": ["héllo", "日本", "x\n\"y\""],
            "hf_config": {"layers": [{"i": i, "w": [0.1] * 40} for i in range(3)]}, "none": None, "ok": True}
    path = tmp_path / "d.kdtr"
    write_bundle(path, tensors, meta, alignment=64)
    return path, meta


def dumped(*args):
    rc, text = cli("dump", *args)
    assert rc == 0
    return json.loads(text)


def test_dump_meta_parses_as_the_bundles_metadata(dumpable):
    path, meta = dumpable
    got = dumped(path, "--meta")
    assert got == meta == open_bundle(path).metadata  # inspect summarises hf_config; dump keeps it whole
    assert "日本" in cli("dump", path, "--meta")[1]  # readable, not \u-escaped


@pytest.mark.parametrize("name", ["f", "i", "u", "h", "s"])
def test_dump_tensor_equals_the_readers(dumpable, name):
    with open_bundle(dumpable[0]) as b:
        want = np.array(b[name])
    got = np.array(dumped(dumpable[0], "--tensor", name), dtype=want.dtype)
    assert got.shape == want.shape and got.tobytes() == want.tobytes()


def test_dump_bf16_prints_the_float32_it_decodes_to(dumpable):
    with open_bundle(dumpable[0]) as b:
        want = bf16_to_f32(b["bf"])
    got = np.array(dumped(dumpable[0], "--tensor", "bf"), dtype=np.float32)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.signbit(got[4]) and got[5] == want[5] != 0  # -0.0 and a subnormal survive the text
    assert dumped(dumpable[0], "--tensor", "bf")[0] == 0.10009765625  # bf16 0.1, not its bits 15821
    assert dumped(dumpable[0], "--tensor", "bf", "--slice", "1:4:2") == [-3.5, float("inf")]


def test_dump_packed_tensor_prints_stored_bytes_and_says_so(dumpable, capsys):
    assert dumped(dumpable[0], "--tensor", "layer.qw") == [[0x80, 0x7f], [0x0f, 0xf0]]
    assert "layer.qw is int4-packed: these are its stored u8 bytes" in capsys.readouterr().err
    dumped(dumpable[0], "--tensor", "f")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("spec, index", [
    ("0:2,1:4", np.s_[0:2, 1:4]), ("1", np.s_[1]), ("-1", np.s_[-1]), ("::2, 3", np.s_[::2, 3]),
    ("..., -2", np.s_[..., -2]), ("1,2", np.s_[1, 2]), (":", np.s_[:]), ("5:1:-2", np.s_[5:1:-2]),
])
def test_dump_slice_equals_the_readers_slice(dumpable, spec, index):
    with open_bundle(dumpable[0]) as b:
        want_f, want_i = np.array(b["f"][index]), np.array(b["i"][index])
    got_f = np.array(dumped(dumpable[0], "--tensor", "f", "--slice", spec), np.float32)
    got_i = np.array(dumped(dumpable[0], "--tensor", "i", "--slice", spec), np.int32)
    assert got_f.shape == want_f.shape and got_f.tobytes() == want_f.tobytes()
    assert got_i.shape == want_i.shape and got_i.tobytes() == want_i.tobytes()


def test_dump_npy_to_a_file_and_to_stdout(dumpable, tmp_path):
    path = dumpable[0]
    with open_bundle(path) as b:
        want_bf, want_u = bf16_to_f32(b["bf"]), np.array(b["u"])
    rc, text = cli("dump", path, "--tensor", "bf", "--format", "npy", "-o", tmp_path / "bf")
    assert rc == 0 and text == ""
    got = np.load(tmp_path / "bf")  # written where asked: no ".npy" appended
    assert got.dtype == np.float32 and got.view(np.uint32).tobytes() == want_bf.view(np.uint32).tobytes()
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    assert main(["dump", str(path), "--tensor", "u", "--format", "npy", "--slice", "1:"], out=out) == 0
    got = np.load(io.BytesIO(out.buffer.getvalue()))
    assert got.dtype == np.uint64 and got.tolist() == want_u[1:].tolist() == [2**64 - 1]
    assert cli("dump", path, "--tensor", "i", "-o", tmp_path / "i.json")[0] == 0
    assert json.loads((tmp_path / "i.json").read_text()) == np.arange(-12, 12).reshape(3, 4, 2).tolist()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("args, message", [
    (["--tensor", "ff"], "no tensor 'ff' among its 7; did you mean 'f'?"),
    (["--tensor", "LAYER.QW"], "no tensor 'LAYER.QW' among its 7; did you mean 'layer.qw'?"),
    (["--tensor", "zzzzzz"], "no tensor 'zzzzzz' among its 7 (`kdtr list "),
    (["--tensor", "f", "--slice", "3"], "--slice '3' of tensor 'f' (shape [3,5]): index 3 is out of bounds for axis 0"),
    (["--tensor", "f", "--slice", "0,0,0"], "--slice '0,0,0' of tensor 'f' (shape [3,5]): too many indices"),
    (["--tensor", "f", "--slice", "__import__('os')"],
     "of tensor 'f' (shape [3,5]): \"__import__('os')\" is not an integer"),
    (["--tensor", "f", "--slice", "1:2:3:4"], "'1:2:3:4' has more than two ':'"),
    (["--tensor", "f", "--slice", "::0"], "slice step cannot be zero"),
    (["--tensor", "f", "--slice", "1,"], "an empty index"),
    (["--meta", "--format", "npy"], "go with --tensor NAME, not --meta"),
])
def test_dump_errors_name_the_tensor_and_shape(dumpable, capsys, args, message):
    assert cli("dump", dumpable[0], *args) == (2, "")
    err = capsys.readouterr().err
    assert err.startswith(f"error: {dumpable[0]}: ") and message in err


def test_dump_usage(dumpable, capsys):
    with pytest.raises(SystemExit) as e:
        cli("dump", dumpable[0])
    assert e.value.code == 2 and "one of the arguments --meta --tensor is required" in capsys.readouterr().err
    assert main(["dump", str(dumpable[0]), "--tensor", "f", "--format", "npy"], out=_Terminal()) == 2
    assert "not writing .npy bytes to a terminal" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["list"], ["inspect"], ["dump", "--meta"], ["diff", "OTHER"]],
                         ids=lambda c: c[0])
def test_a_sha256_record_given_for_a_bundle_is_named_as_such(tmp_path, capsys, command):
    """`kdtr list results/bundles/x.kdtr.sha256` (tab completion): not "magic is b'1e22'", but what it is."""
    from k2vec.digests import write_record
    from k2vec.kdtr.cli import main
    from k2vec.kdtr.writer import write_bundle

    bundle = tmp_path / "b.kdtr"
    write_bundle(bundle, [("w", np.arange(4, dtype=np.float32))], {"x": 1})
    write_record(bundle)
    record = f"{bundle}.sha256"
    argv = [command[0], record, *[str(bundle) if a == "OTHER" else a for a in command[1:]]]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"error: {record} is a sha256 record, not a bundle: give the bundle it "
                                       f"describes, {bundle}\n")
