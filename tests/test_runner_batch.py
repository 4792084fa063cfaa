"""A batch engine (docs/engine-contract.md section 2, "Several runs in one process"): one process serves
every run of a bundle, yet a run that hangs, crashes or writes nonsense fails alone, each run keeps its own
time limit, and what the runner writes per run is what a single-run engine's run gets."""
import json
import marshal
import sys
import textwrap
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from k2vec.engines.contract import result_cache
from k2vec.engines.runner import run_engine, run_engine_batch
from test_runner import EXPECT, good_result, tiny_bundle

MODES = ["greedy", "ddtree-b1", "ddtree-b4", "ddtree-b16", "ddtree-b64"]

# The engine: reads the batch listing, does each run as `plan` says (default: a valid result after
# `delay` seconds), writes each result under another name and renames it into place; every start of the
# process appends a line to starts.log.
ENGINE = """\
import json, os, sys, time
listing = json.load(open(sys.argv[1]))
plan, delay, starts = json.load(open(sys.argv[2])), float(sys.argv[3]), sys.argv[4]
with open(starts, "a") as fh:
    fh.write(" ".join(r["mode"] + str(r["budget"]) for r in listing["runs"]) + "\\n")
good = {good}
for run in listing["runs"]:
    name = run["mode"] if run["mode"] != "ddtree" else "ddtree-b" + str(run["budget"])
    what = plan.get(name, "ok")
    time.sleep(delay)
    if what == "crash":
        sys.stderr.write("illegal memory access in " + name + "\\n"); sys.exit(134)
    if what == "hang":
        time.sleep(3600)
    if what == "skip":
        continue
    text = "{{not json" if what == "garbage" else json.dumps(good[run["mode"]])
    with open(run["output"] + ".part", "w") as fh:
        fh.write(text)
    os.rename(run["output"] + ".part", run["output"])
"""


@dataclass(frozen=True)
class Case:
    name: str
    plan: dict[str, str]           # mode -> crash | hang | skip | garbage (default ok)
    failed: dict[str, str] = field(default_factory=dict)   # mode -> what its reason says
    starts: int = 1                # how many times the engine process is started


CASES = [
    Case("all ok", {}),
    Case("crash in the middle", {"ddtree-b4": "crash"}, {"ddtree-b4": "exited with code 134"}, starts=2),
    Case("hang in the middle", {"ddtree-b1": "hang"}, {"ddtree-b1": "timed out after 1.5 s"}, starts=2),
    Case("crash in the first run", {"greedy": "crash"}, {"greedy": "exited with code 134"}, starts=2),
    Case("crash in the last run", {"ddtree-b64": "crash"}, {"ddtree-b64": "exited with code 134"}),
    Case("two crashes", {"greedy": "crash", "ddtree-b16": "crash"},
         {"greedy": "exited with code 134", "ddtree-b16": "exited with code 134"}, starts=3),
    Case("a run it never writes", {"ddtree-b4": "skip"}, {"ddtree-b4": "wrote no result file"}),
    Case("invalid JSON for one run", {"ddtree-b16": "garbage"}, {"ddtree-b16": "not valid JSON"}),
]


def batch_run(tmp_path, plan, delay=0.05, timeout_s=1.5, modes=MODES, **extra):
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "engine.py"
    good = {"greedy": good_result("greedy"), "ddtree": good_result("ddtree")}
    script.write_text(ENGINE.format(good=repr(good)))
    starts = tmp_path / "starts.log"
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    command = f"{sys.executable} {script} {{batch}} {tmp_path / 'plan.json'} {delay} {starts}"
    outs = [tmp_path / "results" / f"{m}.json" for m in modes]
    finals = run_engine_batch(engine="fake", command=command, bundle=tiny_bundle(tmp_path),
                              runs=list(zip(modes, map(str, outs))), expect=EXPECT, gpus=0, devices=[],
                              lock_dir=str(tmp_path / "locks"), timeout_s=timeout_s,
                              stderr_path=str(tmp_path / "stderr.log"), max_result_mb=1.0,
                              scratch_dir=str(tmp_path / "scratch"), **extra)
    for out, final in zip(outs, finals):
        assert json.loads(out.read_text()) == final
    return dict(zip(modes, finals)), starts.read_text().splitlines()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_failing_run_fails_alone(tmp_path, case):
    finals, starts = batch_run(tmp_path, case.plan)
    for mode, final in finals.items():
        if mode in case.failed:
            assert final["status"] == "failed" and case.failed[mode] in final["reason"], (mode, final["reason"])
            assert final["runs"] == [] and final["scratch_kept"]
        else:
            assert final["status"] == "ok" and final["reason"] is None, (mode, final["reason"])
            assert final["runs"] == good_result("greedy" if mode == "greedy" else "ddtree")["runs"]
    assert len(starts) == case.starts, starts
    # a restart serves exactly the runs after the one that stopped the engine
    if case.starts > 1:
        stopped = [m for m in MODES if case.plan.get(m) in ("crash", "hang")][0]
        assert starts[1].split() == [m.replace("-b", "") for m in MODES[MODES.index(stopped) + 1:]]
    if "crash" in case.plan.values():
        crashed = [m for m, what in case.plan.items() if what == "crash"][0]
        assert f"illegal memory access in {crashed}" in finals[crashed]["stderr_tail"]
    assert (tmp_path / "scratch").exists() == bool(case.failed)


def test_each_run_has_its_own_time_limit(tmp_path):
    """Five runs of 0.5 s each under a 1.5 s limit: 2.5 s in all, yet none timed out; the spans tile the
    process's life, the first one holding the start-up."""
    finals, starts = batch_run(tmp_path, {}, delay=0.5, timeout_s=1.5)
    assert len(starts) == 1 and all(f["status"] == "ok" for f in finals.values()), finals
    spans = [(f["started_at"], f["ended_at"]) for f in finals.values()]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert spans[-1][1] - spans[0][0] > 2.5
    assert all(0.4 < f["wall_s"] < 1.5 for f in finals.values()), [f["wall_s"] for f in finals.values()]


def test_a_batch_run_records_what_a_single_run_records(tmp_path):
    """The same valid result through a batch engine and a single-run engine: the same keys, the same
    verdict, the same engine output; only the command and the clock differ."""
    batch, _ = batch_run(tmp_path / "b", {}, modes=["greedy"])
    single_dir = tmp_path / "s"
    single_dir.mkdir()
    script = single_dir / "engine.py"
    script.write_text(textwrap.dedent(f"""\
        import json, sys
        json.dump({good_result("greedy")!r}, open(sys.argv[1], "w"))
    """))
    single = run_engine(engine="fake", command=f"{sys.executable} {script} {{output}}", bundle=tiny_bundle(single_dir),
                        mode="greedy", output=str(single_dir / "r.json"), expect=EXPECT, gpus=0, devices=[],
                        lock_dir=str(single_dir / "locks"), timeout_s=5, stderr_path=str(single_dir / "e.log"),
                        max_result_mb=1.0, scratch_dir=str(single_dir / "scratch"))
    volatile = {"command", "started_at", "ended_at", "wall_s", "bundle", "inputs"}
    a, b = batch["greedy"], single
    assert a.keys() == b.keys()
    assert {k: v for k, v in a.items() if k not in volatile} == {k: v for k, v in b.items() if k not in volatile}
    assert "{batch}" not in a["command"] and "batch.json" in a["command"]


@pytest.mark.parametrize("plan", [{}, {"ddtree-b4": "crash", "ddtree-b16": "garbage"}], ids=["all ok", "some failed"])
def test_the_report_parses_no_result_the_runner_wrote(tmp_path, monkeypatch, plan):
    """With the report's parse cache, each result the runner writes, ok or failed, is parsed into it as written:
    the report's load then parses none of them, and gets exactly what parsing the file gives."""
    cache = tmp_path / "cache"
    finals, _ = batch_run(tmp_path, plan, parse_cache=str(cache))
    assert len(list(cache.glob("*.marshal"))) == len(MODES)
    parsed = []
    monkeypatch.setattr(result_cache, "json", SimpleNamespace(loads=lambda data: parsed.append(data)))
    report_side = result_cache.ResultCache(cache)
    for mode in MODES:
        path = tmp_path / "results" / f"{mode}.json"
        assert marshal.dumps(report_side.load(path)) == marshal.dumps(json.loads(path.read_bytes()))
    assert parsed == []
    assert {f["status"] for f in finals.values()} == ({"ok"} if not plan else {"ok", "failed"})


def test_an_unwritable_parse_cache_costs_no_result(tmp_path):
    """The parse cache is the report's shortcut: where it cannot be written, every result is still written."""
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory would be")
    finals, _ = batch_run(tmp_path, {}, parse_cache=str(blocked))
    assert all(f["status"] == "ok" for f in finals.values())
