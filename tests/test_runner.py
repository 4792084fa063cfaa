"""The engine runner: every way an engine can fail becomes a failed result with its reason."""
import json
import sys
import textwrap

import numpy as np
import pytest

from k2vec.digests import write_record
from k2vec.engines.runner import Expectations, check_result, format_command, parse_mode, run_engine
from k2vec.kdtr import write_bundle

EXPECT = Expectations(n_prompts=2, max_new_tokens=3, vocab_size=100, accuracies=(0.9, 0.3))


def good_result(mode="greedy", n_tokens=3):
    drafters = [None] if mode == "greedy" else [{"accuracy": 0.9}, {"accuracy": 0.3}]
    return {"format": "k2vec-engine-result", "version": 1, "device": "cpu",
            "runs": [{"drafter": d, "prompts": [{"tokens": [1] * n_tokens}, {"tokens": [2] * n_tokens}]}
                     for d in drafters]}


def fake_engine(tmp_path, body: str) -> str:
    """A python engine whose main body is `body`; it gets output path as argv[1]."""
    script = tmp_path / "engine.py"
    script.write_text("import json, sys, os, time\nout = sys.argv[1]\n" + textwrap.dedent(body))
    return f"{sys.executable} {script} {{output}}"


def tiny_bundle(tmp_path) -> str:
    """A valid bundle with its sha256 record: the runner verifies it before starting the engine."""
    path = tmp_path / "b.kdtr"
    write_bundle(path, {"x": np.zeros(4, np.float32)}, {"kind": "test"})
    write_record(path)
    return str(path)


def run(tmp_path, command, mode="greedy", timeout_s=10.0):
    out = tmp_path / "results" / "run.json"
    result = run_engine(engine="fake", command=command, bundle=tiny_bundle(tmp_path), mode=mode, output=str(out),
                        expect=EXPECT, gpus=0, devices=[], lock_dir=str(tmp_path / "locks"),
                        timeout_s=timeout_s, stderr_path=str(tmp_path / "stderr.log"), max_result_mb=1.0,
                        scratch_dir=str(tmp_path / "scratch"))
    assert json.loads(out.read_text()) == result
    # Nothing but the final result and its sha256 record is left beside it: no partial file under any name.
    assert sorted(p.name for p in out.parent.iterdir()) == ["run.json", "run.json.sha256"]
    return result


def test_good_engine_ok(tmp_path):
    r = run(tmp_path, fake_engine(tmp_path, f"json.dump({good_result()!r}, open(out, 'w'))"))
    assert r["status"] == "ok" and r["reason"] is None and r["runs"][0]["prompts"][1]["tokens"] == [2, 2, 2]
    assert r["wall_s"] > 0 and r["mode"] == "greedy"


@pytest.mark.parametrize("what, body, reason", [
    ("crash", "sys.stderr.write('segfault in kernel gemm_w4a16\\n'); sys.exit(139)", "exited with code 139"),
    ("signal", "os.kill(os.getpid(), 11)", "killed by signal 11"),
    ("no output", "pass", "wrote no result file"),
    ("invalid json", "open(out, 'w').write('{\"runs\": [')", "not valid JSON"),
    ("wrong schema", "json.dump({'format': 'k2vec-engine-result', 'version': 1, 'runs': 3}, open(out, 'w'))",
     "does not match the schema at runs"),
    ("too few tokens", f"json.dump({good_result(n_tokens=2)!r}, open(out, 'w'))", "2 tokens, expected"),
    ("token outside vocab", "r = " + repr(good_result()) + "; r['runs'][0]['prompts'][0]['tokens'][1] = 100; "
     "json.dump(r, open(out, 'w'))", "token 100 outside the vocabulary"),
])
def test_failures_become_failed_results(tmp_path, what, body, reason):
    r = run(tmp_path, fake_engine(tmp_path, body))
    assert r["status"] == "failed" and reason in r["reason"], r["reason"]
    assert r["runs"] == []
    if what == "crash":
        assert "segfault in kernel gemm_w4a16" in r["stderr_tail"]


def test_hang_is_killed_at_the_limit(tmp_path):
    # The engine leaves a grandchild too: the whole process group must go.
    body = "import subprocess; subprocess.Popen(['sleep', '60']); open(out, 'w').write('{'); time.sleep(60)"
    t = __import__("time").monotonic()
    r = run(tmp_path, fake_engine(tmp_path, body), timeout_s=1.0)
    assert __import__("time").monotonic() - t < 15
    assert r["status"] == "failed" and "timed out after 1 s" in r["reason"]


def test_ddtree_needs_one_run_per_accuracy():
    check_result(good_result("ddtree"), "ddtree-b4", EXPECT)
    from k2vec.engines.runner import InvalidResult
    with pytest.raises(InvalidResult, match="drafters"):
        check_result(good_result("greedy"), "ddtree-b4", EXPECT)


def test_modes_and_placeholders():
    assert parse_mode("greedy") == ("greedy", 0) and parse_mode("ddtree-b64") == ("ddtree", 64)
    for bad in ("ddtree", "ddtree-b0", "beam"):
        with pytest.raises(ValueError):
            parse_mode(bad)
    assert format_command("e --b {bundle} --o {output}", bundle="a b.kdtr", output="o") == "e --b 'a b.kdtr' --o o"
    with pytest.raises(ValueError, match="unknown placeholder"):
        format_command("e {bundel}", bundle="x")
