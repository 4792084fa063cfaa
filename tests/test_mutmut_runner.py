"""The engine runner's checks: what mutmut (tools/mutmut.sh runner) found unchecked.

An engine's result is refused with the whole reason a user reads in the FAILED row (where, what, the
expected shape); results at the edge of what is allowed are accepted; the bundle's metadata is read
with the same care. All in-process: no engine is started here."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_runner import EXPECT, SCORE_EXPECT, good_result, score_result

from k2vec.digests import write_record
from k2vec.engines import runner
from k2vec.engines.contract.modes import parse_mode
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.expectations import expectations_from_bundle
from k2vec.engines.contract import files
from k2vec.engines.contract.files import json_nesting
from k2vec.kdtr import write_bundle


def reason(result, mode="score", expect=SCORE_EXPECT) -> str:
    with pytest.raises(InvalidResult) as e:
        check_result(result, mode, expect)
    return str(e.value)


def prompt1(edit, mode="score"):
    r = score_result()
    edit(r["runs"][0]["prompts"][1])
    return r


def greedy_routing(rows):
    """A score result made greedy (N = 3 routing rows per prompt) whose prompt 1 has `rows` instead."""
    r = score_result()
    for p in r["runs"][0]["prompts"]:
        p["router_experts"] = p["router_experts"][-3:]
    r["runs"][0]["prompts"][1]["router_experts"] = rows
    return r


def greedy(edit):
    r = good_result()
    edit(r)
    return r


@pytest.mark.parametrize("result, mode, message", [
    ([], "greedy", "result does not match the schema at (top level): [] is not of type 'object'"),
    (greedy(lambda r: r.update(device=5)), "greedy",
     "result does not match the schema at device: 5 is not of type 'string'"),
    (greedy(lambda r: r.update(timing={"load_s": -1.5})), "greedy",
     "result does not match the schema at timing/load_s: -1.5 is less than the minimum of 0"),
    (greedy(lambda r: r["runs"][0]["prompts"].pop()), "greedy", "run 0: 1 prompts, the bundle has 2"),
    (prompt1(lambda p: (p.pop("topk_ids"), p.pop("topk_logits"))), "score",
     "prompt 1: score mode requires topk_ids and topk_logits (at least 1 per step)"),
    (prompt1(lambda p: p.pop("topk_ids")), "score", "prompt 1: score mode requires topk_ids (at least 1 per step)"),
    (prompt1(lambda p: p.update(topk_ids=[[9]] * 3)), "score",
     "prompt 1: topk_ids [3, 1] and topk_logits [3, 2] must both be [max_new_tokens = 3][k >= 1]"),
    (prompt1(lambda p: p.update(topk_ids=[[2**70]] * 3, topk_logits=[[1.0]] * 3)), "score",
     "result does not match the schema at runs/0/prompts/1/topk_ids/0/0: 1180591620717411303424 is greater than "
     "the maximum of 2147483647 (integers of the contract fit in int32)"),
    (prompt1(lambda p: p.update(topk_logits=[[2.0, 1.5], [3.0, 3.0], [1.0, 1.5]])), "score",
     "prompt 1 step 2: topk_logits are not in descending order"),
    (prompt1(lambda p: p.update(topk_logits=[[2.0, 1.0], [3.0, 3.5], [1.0, 1.5]])), "score",
     "prompt 1 step 1: topk_logits are not in descending order"),
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [7, 2]]] * 3)), "score",
     "prompt 1: router_experts is [3, 2, 2], expected [4, 2, 2]: "
     "[P + N - 1 fed positions (prompt, then golden tokens)][MoE layers][num_experts_per_tok]"),
    (greedy_routing([[[0, 1], [7, 2]]] * 4), "greedy",
     "prompt 1: router_experts is [4, 2, 2], expected [3, 2, 2]: [N steps][MoE layers][num_experts_per_tok]"),
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [7, 2]], [[0, 1], [7, 2]], [[0, 9], [7, 2]],
                                                [[0, 1], [8, 2]]])),
     "score", "prompt 1: router_experts[2, 0, 1] = 9 is not an expert (n_routed_experts = 8)"),
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [7, 2]], [[0, 1], [7, 7]], [[0, 1], [7, 2]],
                                                [[1, 1], [7, 2]]])),
     "score", "prompt 1: router_experts[1, 1] names an expert twice"),
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [7, 2]], [[0, 1], [7, 2]], [[0, 1], [2, 7]],
                                                [[1, 2], [0, 2]]])),
     "score", None),   # the same expert in two layers, or at two positions, is fine
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [7, 2]], [[2, 1], [1, 2]], [[0, 1], [7, 2]],
                                                [[1, 2], [0, 2]]])),
     "score", None),   # experts listed in any order; sorting across layers would see a repeat
    (prompt1(lambda p: p.update(router_experts=[[[0, 2**70], [7, 2]]] * 4)), "score",
     "result does not match the schema at runs/0/prompts/1/router_experts/0/0/1: 1180591620717411303424 is "
     "greater than the maximum of 2147483647 (integers of the contract fit in int32)"),
    (greedy(lambda r: r["runs"][0]["prompts"][0].update(topk_ids=[[1]] * 3)), "greedy",
     "prompt 0: topk_ids [3, 1] and topk_logits [0] must both be [max_new_tokens = 3][k >= 1]"),
    (greedy(lambda r: r["runs"][0]["prompts"][0].update(topk_logits=[[1.0]] * 3)), "greedy",
     "prompt 0: topk_ids [0] and topk_logits [3, 1] must both be [max_new_tokens = 3][k >= 1]"),
    (prompt1(lambda p: p.update(router_experts=[[[0, 1], [2]]] * 4)), "score",
     "prompt 1 router_experts: rows of different lengths (expected a rectangular array)"),
    (prompt1(lambda p: p.update(fingerprints=[[[0.5], [0.5, 1], [1]]] * 3)), "score",
     "prompt 1 fingerprints: rows of different lengths (expected a rectangular array)"),
    (prompt1(lambda p: p.update(topk_logits=[[1.0, 0.5], [1.0], [1.0, 0.0]])), "score",
     "prompt 1 topk_logits: rows of different lengths (expected a rectangular array)"),
])
def test_result_refusals_are_complete(result, mode, message):
    if message is None:
        check_result(result, mode, SCORE_EXPECT)
    else:
        assert reason(result, mode) == message


def test_edges_of_accepted_results():
    # a single top-k entry per step, and logits that stay level (not rising) by less than 1
    r = prompt1(lambda p: p.update(topk_ids=[[8], [5], [6]], topk_logits=[[0.0], [0.0], [0.0]]))
    check_result(r, "score", SCORE_EXPECT)
    r = prompt1(lambda p: p.update(topk_logits=[[2.0, 2.0], [3.0, 3.0], [1.0, 1.0]]))
    check_result(r, "score", SCORE_EXPECT)
    with pytest.raises(InvalidResult, match=re.escape("prompt 1 step 0: topk_logits are not in descending order")):
        check_result(prompt1(lambda p: p.update(topk_logits=[[2.0, 2.5], [3.0, 3.0], [1.0, 1.0]])), "score",
                     SCORE_EXPECT)
    # a DDTree prompt's per-step arrays are checked as greedy's: one row per generated token
    r = good_result("ddtree")
    for run in r["runs"]:
        for p in run["prompts"]:
            p.update(topk_ids=[[p["tokens"][0]]] * 3, topk_logits=[[1.0]] * 3)
    check_result(r, "ddtree-b4", EXPECT)
    r["runs"][1]["prompts"][0].update(topk_ids=[[1]], topk_logits=[[1.0]])
    with pytest.raises(InvalidResult, match=re.escape("prompt 0: topk_ids [1, 1] and topk_logits [1, 1] must both")):
        check_result(r, "ddtree-b4", EXPECT)


def test_the_engine_sees_its_gpus_in_pci_order():
    assert runner._gpu_environment(["0", "3"]) == {"CUDA_VISIBLE_DEVICES": "0,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


# ---- nesting scan: where it stops

def test_json_nesting_without_brackets_and_its_early_stop(monkeypatch):
    assert json_nesting(b"") == (0, -1) and json_nesting(b'"[{"') == (0, -1)
    monkeypatch.setattr(files, "_SCAN_CHUNK", 1)
    text = b" " * 40 + b"[" * 34 + b"]" * 34
    # stops at the first chunk deeper than the limit: 33 deep at byte 72, not before
    assert json_nesting(text, stop_above=32) == (33, 72)
    assert json_nesting(text) == (34, 73)


# ---- the bundle's metadata

def bundle(tmp_path, golden_prompts=2, prompts=2, max_new_tokens=3, accuracies=(0.9, 0.3), hf_config=None):
    meta = {"golden": {"prompts": golden_prompts, "ddtree": {"accuracies": accuracies}},
            "decoding": {"max_new_tokens": max_new_tokens}, "model": {"vocab_size": 100},
            "hf_config": hf_config if hf_config is not None else
            {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2}}
    path = tmp_path / "b.kdtr"
    write_bundle(path, [(f"prompt.p{i}.tokens", np.arange(4 - 2 * (i % 2), dtype=np.int32)) for i in range(prompts)]
                 + [("w", np.arange(64, dtype=np.float32))], meta)
    write_record(path)
    return path


def test_expectations_at_their_edges(tmp_path):
    dense = {"num_hidden_layers": 3, "first_k_dense_replace": 3, "n_routed_experts": 8, "num_experts_per_tok": 2}
    e = expectations_from_bundle(bundle(tmp_path, max_new_tokens=1, accuracies=[], hf_config=dense))
    assert (e.max_new_tokens, e.accuracies, e.moe_layers, e.prompt_lengths) == (1, (), 0, (4, 2))


@pytest.mark.parametrize("settings, message", [
    ({"golden_prompts": 0}, "metadata golden.prompts is 0, expected a positive integer"),
    ({"accuracies": ""}, "metadata golden.ddtree.accuracies is '', expected a list of numbers"),
    ({"hf_config": {"num_hidden_layers": 3}},
     "metadata hf_config lacks integer num_hidden_layers, first_k_dense_replace, n_routed_experts, "
     "num_experts_per_tok"),
    ({"golden_prompts": 3}, "tensor prompt.p2.tokens is missing (metadata golden.prompts = 3)"),
    ({"golden_prompts": 2, "prompts": 1}, "tensor prompt.p1.tokens is missing (metadata golden.prompts = 2)"),
])
def test_bundle_metadata_refusals_name_the_bundle(tmp_path, settings, message):
    path = bundle(tmp_path, **settings)
    with pytest.raises(InvalidResult) as e:
        expectations_from_bundle(path)
    assert str(e.value) == f"bundle {path}: {message}"


def test_expectations_verify_the_bundle_by_default(tmp_path):
    path = bundle(tmp_path)
    data = bytearray(path.read_bytes())
    data[-4] ^= 1   # inside the last tensor: only its checksum can tell
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidResult) as e:
        expectations_from_bundle(path)
    assert str(e.value).startswith(f"bundle {path} failed verification, the engine was not run: {path}: offset ")
    assert expectations_from_bundle(path, verify=False).n_prompts == 2


# ---- reading the result file (in-process: the file is written here, no engine runs)

def test_result_file_edges(tmp_path):
    from k2vec.engines.contract.files import MAX_RESULT_NESTING, read_result
    exact = tmp_path / "exact.json"
    exact.write_text("[" * MAX_RESULT_NESTING + "]" * MAX_RESULT_NESTING)   # exactly the nesting limit
    value = read_result(exact, 1 << 20)
    for _ in range(MAX_RESULT_NESTING - 1):
        value = value[0]
    assert value == []
    big = tmp_path / "big.json"   # more than one 16 MiB read
    big.write_bytes(b'{"x": 1' + b" " * (17 << 20) + b"}")
    assert read_result(big, 18 << 20) == {"x": 1}


def test_result_file_refusals(tmp_path):
    from k2vec.engines.contract.files import read_result
    (tmp_path / "file").write_text("{}")
    deep = tmp_path / "deep.json"   # 40 deep in the first 4 MiB scanned: the scan stops there
    deep.write_bytes(b"[" * 40 + b" " * (4 << 20) + b"[" * 60)
    cases = [
        (tmp_path / "file" / "x.json", 1 << 20,
         f"the result at {tmp_path / 'file' / 'x.json'} is unreadable (Not a directory); write a regular file"),
        # a file that holds more than its size says (as one still being written does)
        (Path("/proc/self/smaps"), 100, "result file grew past the limit of 100 bytes while read"),
        (deep, 8 << 20, "result file nests arrays/objects 40 deep (reached at byte 39); the limit is 32"),
    ]
    for path, limit, message in cases:
        with pytest.raises(InvalidResult) as e:
            read_result(path, limit)
        assert str(e.value) == message


def test_unknown_placeholder_lists_the_known_ones():
    from k2vec.engines.runner import format_command
    with pytest.raises(ValueError) as e:
        format_command("run {nope}", bundle="b")
    assert str(e.value) == ("engine command 'run {nope}' uses an unknown placeholder 'nope'; "
                            "known: {bundle}, {mode}, {budget}, {output}, {batch}, {gpus}, {python}")


def test_stderr_tail_is_bounded_and_survives_bad_bytes(tmp_path):
    from k2vec.engines.runner import _tail
    log = tmp_path / "err.log"
    data = b"".join(b"%03d" % i + b"x" * 3996 + b"\n" for i in range(30))   # 30 lines of 4000 bytes
    log.write_bytes(data)
    assert _tail(log) == data[-64 * 1024:-1].decode()   # the last 64 KiB only, cut mid-line
    log.write_bytes(b"CUDA error \xff\xfe\n")
    assert _tail(log) == "CUDA error \ufffd\ufffd"
    assert _tail(tmp_path / "missing.log") == ""


def test_changed_bundle_reason(tmp_path):
    from k2vec.engines.runner import check_bundle_unchanged
    missing = tmp_path / "gone.kdtr"
    with pytest.raises(InvalidResult) as e:
        check_bundle_unchanged(str(missing), "abc")
    assert str(e.value) == (f"the input bundle {missing} changed during the run (sha256 abc before, unreadable "
                            f"(No such file or directory) after): the engine or another process wrote into it; "
                            f"the result is not trusted")


def test_run_engine_argument_checks_and_new_directories(tmp_path):
    from k2vec.engines.runner import run_engine
    args = dict(engine="e", command="true", bundle=str(bundle(tmp_path)), mode="greedy", gpus=0, devices=[],
                lock_dir=str(tmp_path / "locks"), timeout_s=10.0, max_result_mb=1.0, expect=EXPECT)
    with pytest.raises(ValueError) as e:
        run_engine(**args, output=str(tmp_path / "o.json"), stderr_path=str(tmp_path / "e.log"),
                   scratch_dir=str(tmp_path / "s"), sandbox=True)
    assert str(e.value) == "sandbox needs results_dir: the directory hidden from the engine"
    out, err = tmp_path / "new" / "runs" / "o.json", tmp_path / "logs" / "new" / "e.log"
    r = run_engine(**args, output=str(out), stderr_path=str(err), scratch_dir=str(tmp_path / "s"))
    assert r["status"] == "failed" and r["reason"].startswith("engine exited 0 but wrote no result file at ")
    assert out.exists() and err.exists()
    scratch = (tmp_path / "s").resolve()
    assert (r["format"], r["version"], r["runs"], r["command"], r["leftover_processes_killed"], r["scratch_kept"]) == \
        ("k2vec-engine-result", 1, [], "true", 0, str(scratch))
    assert scratch.is_dir()   # kept for inspection after a failed run
    assert out.read_text() == json.dumps(r, sort_keys=True) + "\n"


def test_json_nesting_escape_run_after_a_chunk_that_ended_in_a_backslash(monkeypatch):
    # chunks of 4 bytes: '["a\' | 'n\"[' | '" ]': the first chunk's backslash escapes 'n'; the next
    # backslash starts a run of its own, so the quote after it is escaped and '[' is inside the string
    monkeypatch.setattr(files, "_SCAN_CHUNK", 4)
    assert json_nesting(b'["a\\n\\"[" ]') == (1, 0)


def test_run_record_and_what_the_engine_is_given(tmp_path, monkeypatch):
    """Every placeholder filled, the environment the engine sees, and the run's record in the result."""
    import hashlib

    import os
    import sys

    from k2vec.engines.runner import run_engine
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = bundle(tmp_path)
    seen = tmp_path / "seen.json"
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'python': sys.executable, 'tmp': os.environ['TMPDIR'], "
        f"'workdir': os.environ['K2VEC_WORKDIR'], 'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), "
        f"'cwd': os.getcwd()}}, "
        f"open({str(seen)!r}, 'w'))\nprint('to stdout')\n"
        f"json.dump({good_result('ddtree')!r}, open(sys.argv[4], 'w'))\n")
    err = tmp_path / "e.log"
    err.write_text("an older attempt's log\n")
    r = run_engine(engine="e", command=f"{{python}} {script} {{bundle}} {{mode}} {{budget}} {{output}} {{gpus}}",
                   bundle=str(path), mode="ddtree-b4", output=str(tmp_path / "o.json"), gpus=0, devices=[],
                   lock_dir=str(tmp_path / "locks"), timeout_s=30.0, stderr_path=str(err), max_result_mb=1.0,
                   scratch_dir=str(tmp_path / "s"), expect=EXPECT)
    assert r["status"] == "ok", r["reason"]
    assert (r["engine"], r["bundle"], r["mode"], r["budget"], r["sandbox"]) == ("e", str(path), "ddtree-b4", 4, False)
    assert r["inputs"] == {"bundle": {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
    got = json.loads(seen.read_text())
    scratch = (tmp_path / "s").resolve()
    assert got["argv"] == [str(path.resolve()), "ddtree", "4", str(scratch / "out" / "result.json"), ""]
    assert got["python"] == sys.executable and got["cuda"] is None
    assert got["tmp"] == str(scratch / "tmp") and got["workdir"] == os.getcwd() and got["cwd"] == str(scratch / "work")
    assert err.read_text() == "to stdout\n"   # this run's output only, standard output included
    assert not scratch.exists()   # removed after an ok run
    assert (tmp_path / "o.json").read_text() == json.dumps(r, sort_keys=True) + "\n"


def test_sandbox_problem_fails_sandboxed_runs_only(tmp_path, monkeypatch):
    from k2vec.engines.runner import run_engine
    monkeypatch.setattr(runner, "sandbox_problem", lambda: "bubblewrap cannot create a user namespace here")
    args = dict(engine="e", command="true", bundle=str(bundle(tmp_path)), mode="greedy", gpus=0, devices=[],
                lock_dir=str(tmp_path / "locks"), timeout_s=10.0, max_result_mb=1.0, expect=EXPECT,
                stderr_path=str(tmp_path / "e.log"), scratch_dir=str(tmp_path / "s"), results_dir=str(tmp_path))
    plain = run_engine(**args, output=str(tmp_path / "plain.json"))
    assert plain["reason"].startswith("engine exited 0 but wrote no result file")   # the engine did run
    boxed = run_engine(**args, output=str(tmp_path / "boxed.json"), sandbox=True)
    assert boxed["reason"] == "sandbox: true, but bubblewrap cannot create a user namespace here"


@pytest.mark.skipif(runner.sandbox_problem() is not None, reason="bubblewrap cannot run here")
def test_sandboxed_run_hides_the_results_directory(tmp_path):
    from k2vec.engines.runner import run_engine
    results = tmp_path / "results"
    results.mkdir()
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, os, sys\n"
        f"try:\n    open({str(results / 'escape.txt')!r}, 'w').write('out')\nexcept OSError:\n    pass\n"
        "os.makedirs(os.environ['HOME'], exist_ok=True)\n"
        f"json.dump({good_result()!r}, open(sys.argv[2], 'w'))\n")
    r = run_engine(engine="e", command=f"{{python}} {script} {{bundle}} {{output}}", bundle=str(bundle(tmp_path)),
                   mode="greedy", output=str(results / "run.json"), gpus=0, devices=[],
                   lock_dir=str(tmp_path / "locks"), timeout_s=30.0, stderr_path=str(results / "e.log"),
                   max_result_mb=1.0,
                   scratch_dir=str(tmp_path / "s"), expect=EXPECT, sandbox=True, results_dir=str(results))
    assert r["status"] == "ok", (r["reason"], r.get("stderr_tail"))
    assert r["sandbox"] is True and not (results / "escape.txt").exists()


def test_modes_at_their_edges():
    assert parse_mode("ddtree-b1") == ("ddtree", 1)   # a one-node tree is a real budget
    for bad in ("ddtree-b0", "ddtree-b", "beam"):
        with pytest.raises(ValueError) as e:
            parse_mode(bad)
        assert str(e.value) == f"unknown mode {bad!r}: expected 'greedy', 'score' or 'ddtree-b<budget>'"


def engine_run(tmp_path, body: str, mode="greedy", gpus=0, devices=()):
    """run_engine on this module's bundle with a Python engine whose argv[1] is {output}, argv[2] {gpus}."""
    import sys

    script = tmp_path / "engine.py"
    script.write_text("import json, sys\n" + body)
    return runner.run_engine(engine="e", command=f"{sys.executable} {script} {{output}} '{{gpus}}'",
                             bundle=str(bundle(tmp_path)), mode=mode, output=str(tmp_path / "o.json"), gpus=gpus,
                             devices=list(devices), lock_dir=str(tmp_path / "locks"), timeout_s=30.0,
                             stderr_path=str(tmp_path / "e.log"), max_result_mb=1.0,
                             scratch_dir=str(tmp_path / "s"), expect=EXPECT)


def test_the_engine_reads_nothing_from_the_runners_stdin(tmp_path):
    """An engine that reads standard input gets end-of-file at once: it neither blocks on nor consumes
    the input of the process that runs it (Snakemake's, a user's terminal)."""
    import os

    seen = tmp_path / "stdin.txt"
    body = (f"open({str(seen)!r}, 'w').write(repr(sys.stdin.read()))\n"
            f"json.dump({good_result()!r}, open(sys.argv[1], 'w'))\n")
    read_end, write_end = os.pipe()
    os.write(write_end, b"the runner's own input\n")
    os.close(write_end)
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        r = engine_run(tmp_path, body)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(read_end)
    assert r["status"] == "ok", r["reason"]
    assert seen.read_text() == "''"


def test_an_engine_given_two_gpus_gets_both_in_its_gpus_placeholder(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "identify", lambda assigned: ([], None))
    seen = tmp_path / "gpus.txt"
    r = engine_run(tmp_path, f"open({str(seen)!r}, 'w').write(sys.argv[2])\n"
                             f"json.dump({good_result()!r}, open(sys.argv[1], 'w'))\n", gpus=2, devices=["3", "5"])
    assert r["status"] == "ok", r["reason"]
    assert seen.read_text() == "3,5" and r["gpus"] == ["3", "5"]


def test_a_number_too_large_for_a_float_in_a_free_key_is_refused_with_its_reason(tmp_path):
    text = json.dumps(good_result())[:-1] + ', "timing": {"note": 1e999}}'
    r = engine_run(tmp_path, f"open(sys.argv[1], 'w').write({text!r})\n")
    assert r["status"] == "failed"
    assert r["reason"] == "result holds a number too large for a float (read as infinity)"
