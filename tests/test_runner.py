"""The engine runner: every way an engine can fail becomes a failed result with its reason."""
import json
import os
import re
import sys
import textwrap
import time

import numpy as np
import pytest

from k2vec.digests import write_record
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.expectations import Expectations
from k2vec.engines.contract.modes import parse_mode
from k2vec.engines.runner import format_command, run_engine
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


def test_ddtree_needs_one_run_per_accuracy():
    check_result(good_result("ddtree"), "ddtree-b4", EXPECT)
    from k2vec.engines.contract.errors import InvalidResult
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


# ------------------------------------------------------------------- score mode (contract section 4)

SCORE_EXPECT = Expectations(n_prompts=2, max_new_tokens=3, vocab_size=100, accuracies=(0.9, 0.3),
                            prompt_lengths=(4, 2), layers=3, moe_layers=2, experts=8, experts_per_token=2)


def score_result():
    """A valid score result of SCORE_EXPECT: N = 3 steps, k = 2 logits, routing for P + N - 1 positions."""
    def prompt(P, first):
        return {"tokens": [first, 5, 6], "topk_ids": [[first, 1], [5, 2], [6, 3]],
                "topk_logits": [[2.0, 1.0], [3.0, 3.0], [1.0, -1.0]],
                "router_experts": [[[0, 1], [7, 2]]] * (P + 3 - 1),
                "fingerprints": [[[0.5] * 4] * 3] * 3}
    return {"format": "k2vec-engine-result", "version": 1,
            "runs": [{"drafter": None, "prompts": [prompt(4, 9), prompt(2, 8)]}]}


def test_score_mode_result_is_accepted():
    assert parse_mode("score") == ("score", 0)
    check_result(score_result(), "score", SCORE_EXPECT)


def _broken(edit):
    r = score_result()
    edit(r["runs"][0]["prompts"][1])
    return r


@pytest.mark.parametrize("what, edit, message", [
    ("no top-k", lambda p: p.pop("topk_logits"), "score mode requires topk_logits"),
    ("top-k for fewer steps", lambda p: p.update(topk_ids=p["topk_ids"][:2], topk_logits=p["topk_logits"][:2]),
     "must both be [max_new_tokens = 3][k >= 1]"),
    ("empty top-k rows", lambda p: p.update(topk_ids=[[]] * 3, topk_logits=[[]] * 3), "k >= 1"),
    ("ragged top-k", lambda p: p["topk_ids"][1].append(4), "rows of different lengths"),
    ("ascending logits", lambda p: p["topk_logits"][2].reverse(), "step 2: topk_logits are not in descending"),
    ("token not the argmax", lambda p: p["tokens"].__setitem__(1, 2), "step 1: tokens must be the engine's own argmax"),
    ("top-k id outside vocab", lambda p: p["topk_ids"][2].__setitem__(1, 100), "topk id 100 outside the vocabulary"),
    # prompt-position routing: P + N - 1 = 4 rows for prompt 1, not greedy's N = 3
    ("routing of the steps only", lambda p: p.update(router_experts=p["router_experts"][:3]),
     "router_experts is [3, 2, 2], expected [4, 2, 2]"),
    ("routing of one MoE layer", lambda p: p.update(router_experts=[[[0, 1]]] * 4), "expected [4, 2, 2]"),
    ("expert outside the model", lambda p: p.update(router_experts=[[[0, 8], [1, 2]]] * 4), "is not an expert"),
    ("expert chosen twice", lambda p: p.update(router_experts=[[[3, 3], [1, 2]]] * 4), "names an expert twice"),
    ("fingerprints of all layers missing", lambda p: p.update(fingerprints=[[[0.5] * 4] * 2] * 3),
     "expected [max_new_tokens = 3][layers = 3][hidden]"),
])
def test_score_mode_rules(what, edit, message):
    from k2vec.engines.contract.errors import InvalidResult
    with pytest.raises(InvalidResult, match=re.escape(message)) as err:
        check_result(_broken(edit), "score", SCORE_EXPECT)
    assert "prompt 1" in str(err.value)


def test_greedy_routing_is_one_row_per_step():
    """Greedy reports the experts of the token fed at each step (N rows); score mode's prompt rows are refused."""
    from k2vec.engines.contract.errors import InvalidResult
    r = score_result()
    for p in r["runs"][0]["prompts"]:
        p["router_experts"] = p["router_experts"][-3:]
    check_result(r, "greedy", SCORE_EXPECT)
    with pytest.raises(InvalidResult, match=re.escape("router_experts is [3, 2, 2], expected [6, 2, 2]")):
        check_result(r, "score", SCORE_EXPECT)
    with pytest.raises(InvalidResult, match=re.escape("expected [3, 2, 2]")):
        check_result(score_result(), "greedy", SCORE_EXPECT)


def test_score_expectations_come_from_the_bundle(tmp_path):
    """Prompt lengths and layer/expert counts are read from the bundle the engine is given."""
    from k2vec.engines.contract.expectations import expectations_from_bundle
    path = tmp_path / "b.kdtr"
    meta = {"golden": {"prompts": 2, "ddtree": {"accuracies": [0.9, 0.3]}}, "decoding": {"max_new_tokens": 3},
            "model": {"vocab_size": 100},
            "hf_config": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
                          "num_experts_per_tok": 2}}
    write_bundle(path, {"prompt.p0.tokens": np.arange(4, dtype=np.int32),
                        "prompt.p1.tokens": np.arange(2, dtype=np.int32)}, meta)
    write_record(path)
    assert expectations_from_bundle(path) == SCORE_EXPECT
    r = run_engine(engine="fake", command=fake_engine(tmp_path, f"json.dump({score_result()!r}, open(out, 'w'))"),
                   bundle=str(path), mode="score", output=str(tmp_path / "out.json"), gpus=0, devices=[],
                   lock_dir=str(tmp_path / "locks"), timeout_s=10.0, stderr_path=str(tmp_path / "err.log"),
                   max_result_mb=1.0, scratch_dir=str(tmp_path / "scratch"))
    assert r["status"] == "ok", r["reason"]


# ------------------------------------------------------------------- the time limit: whole group, TERM then KILL

def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


GRANDCHILD = """
import subprocess
child = subprocess.Popen(['sleep', '60'])   # same process group as the engine
open({pidfile!r}, 'w').write(str(child.pid))
time.sleep(60)
"""


def test_hang_is_killed_at_the_limit(tmp_path):
    # The engine leaves a grandchild too: the whole process group must go.
    body = "open(out, 'w').write('{')" + GRANDCHILD.format(pidfile=str(tmp_path / "sleep.pid"))
    t = time.monotonic()
    r = run(tmp_path, fake_engine(tmp_path, body), timeout_s=2.0)
    assert time.monotonic() - t < 15
    assert r["status"] == "failed" and r["reason"] == "timed out after 2 s (killed)"
    assert _gone(int((tmp_path / "sleep.pid").read_text()))


def test_the_group_kill_alone_ends_the_grandchild(tmp_path, monkeypatch):
    """Without the leftover reaper (not Linux: no subreaper) the group signal is all there is: a
    `sleep 60` in the engine's group must still die at the limit, not only the engine process."""
    from k2vec.engines import runner

    class NoReaper:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def kill_leftovers(self):
            return None, None

    monkeypatch.setattr(runner, "Reaper", NoReaper)
    pidfile = tmp_path / "sleep.pid"
    argv = ["bash", "-c", fake_engine(tmp_path, GRANDCHILD.format(pidfile=str(pidfile))).replace("{output}", "x")]
    done = runner._run_with_limit(argv, dict(os.environ), tmp_path, tmp_path / "err.log", 2.0)
    pid = int(pidfile.read_text())
    try:
        assert done.rc is None
        assert _wait_gone(pid), "the engine's grandchild outlived the time limit"
    finally:
        if not _gone(pid):
            os.kill(pid, 9)


LIMIT_S = 1.5   # room for the engine to start and install its handler on a busy machine
TRAPS_TERM = """
import signal
def on_term(sig, frame):
    open({marker!r}, 'w').write(repr(time.monotonic()))
    {then}
signal.signal(signal.SIGTERM, on_term)
open({ready!r}, 'w').write('')
time.sleep({sleep})
"""


def _limit_run(tmp_path, then: str, sleep: float, timeout_s: float = LIMIT_S):
    from k2vec.engines import runner
    marker, ready = tmp_path / "got_term", tmp_path / "ready"
    body = TRAPS_TERM.format(marker=str(marker), ready=str(ready), then=then, sleep=sleep)
    argv = ["bash", "-c", fake_engine(tmp_path, body).replace("{output}", "x")]
    done = runner._run_with_limit(argv, dict(os.environ), tmp_path, tmp_path / "err.log", timeout_s)
    assert ready.exists(), (tmp_path / "err.log").read_text()   # the handler was in place before the limit
    return done, marker


def test_an_engine_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, monkeypatch):
    from k2vec.engines import runner
    assert runner.KILL_GRACE_S == 5.0   # docs/engine-contract.md: SIGKILL 5 s after SIGTERM
    monkeypatch.setattr(runner, "KILL_GRACE_S", 0.6)
    # the engine notes the SIGTERM, carries on, and would only end by itself after 8 s
    done, marker = _limit_run(tmp_path, then="pass", sleep=8)
    assert marker.exists(), "the engine was not sent SIGTERM first"
    assert done.rc is None
    assert LIMIT_S + 0.6 <= done.wall_s < LIMIT_S + 0.6 + 3.0, done.wall_s   # the grace was given, then SIGKILL


def test_an_engine_that_exits_on_sigterm_gets_sigterm_first(tmp_path, monkeypatch):
    from k2vec.engines import runner
    monkeypatch.setattr(runner, "KILL_GRACE_S", 3.0)
    done, marker = _limit_run(tmp_path, then="sys.exit(3)", sleep=60)
    assert marker.exists(), "the engine was killed without SIGTERM first"
    assert done.rc is None and done.wall_s < LIMIT_S + 2.0   # it exited on SIGTERM: no waiting for the grace


# ------------------------------------------------------------------- reasons as the user reads them

def test_no_result_file_reason_names_the_real_path(tmp_path):
    r = run(tmp_path, fake_engine(tmp_path, "pass"))
    partial = (tmp_path / "scratch" / "out" / "result.json").resolve()
    assert r["reason"] == f"engine exited 0 but wrote no result file at {partial}"


def test_stderr_tail_is_the_last_20_lines(tmp_path):
    body = "for i in range(1, 51): print(f'stderr line {i}', file=sys.stderr)\nsys.exit(1)"
    r = run(tmp_path, fake_engine(tmp_path, body))
    assert r["status"] == "failed" and r["reason"] == "engine exited with code 1"
    assert r["stderr_tail"].splitlines() == [f"stderr line {i}" for i in range(31, 51)]
