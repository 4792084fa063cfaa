"""A plain rerun after `kill -9`: the default profile, stale locks, temporaries of killed writes, and
which checkout's package the jobs run."""
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_workflow, default_config, write_config
from k2vec.atomic import HOLD_ENV, HOLD_SIGNAL_ENV, remove_dead_temporaries
from k2vec.digests import KEY_NAME, check_keyed_record, check_record, read_key

HOLD_ENGINE_ENV = "K2VEC_TEST_HOLD_ENGINE"


def tiny_config() -> dict:
    """One tiny model, one short prompt, one engine on int4 only: the whole pipeline in seconds."""
    config = default_config()
    config["models"] = {"tiny": config["models"]["tiny"]}
    config["prompts"].update(count=1, min_length=4, max_length=6)
    config["decoding"]["max_new_tokens"] = 3
    config["decoding"]["ddtree"].update(block_size=4, budgets=[2], accuracies=[0.9])
    engine = config["engines"]["numpy"]
    config["engines"] = {"numpy": engine}
    engine["precisions"] = ["int4"]
    # one run per process (rule engine_run): the hold below follows the greedy run's {mode}
    engine["command"] = ("OPENBLAS_NUM_THREADS=1 {python} -m k2vec.engines.numpy_engine --bundle {bundle} "
                         "--mode {mode} --budget {budget} --output {output}")
    # unsandboxed: the held engine announces its pid in a file outside its scratch directory
    engine["sandbox"] = False
    # With the variable set, the greedy run's engine stays alive after writing its result until killed.
    engine["command"] += (f' && if [ -n "${HOLD_ENGINE_ENV}" ] && [ {{mode}} = greedy ]; then'
                          f' echo $$ > "${HOLD_ENGINE_ENV}.tmp"'
                          f' && mv "${HOLD_ENGINE_ENV}.tmp" "${HOLD_ENGINE_ENV}"; exec sleep 600; fi')
    return config


def tiny_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    copy_workflow(dest)
    write_config(dest / "config.yaml", tiny_config())
    return dest


def plain_env() -> dict:
    """The environment of a user's shell: no test hook set."""
    return {k: v for k, v in os.environ.items() if k not in (HOLD_ENV, HOLD_SIGNAL_ENV, HOLD_ENGINE_ENV)}


def plain_snakemake(root: Path, *args: str, env: dict | None = None, timeout: int = 600):
    """`snakemake ARGS` typed in the workflow's directory: no --snakefile, no profile flags."""
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env=env or plain_env())


def start_held(root: Path, stage: str, signal_file: Path) -> subprocess.Popen:
    """`snakemake --cores 2` in its own process group, set to stop inside `stage` until killed."""
    env = plain_env()
    if stage == "engine_run":
        env[HOLD_ENGINE_ENV] = str(signal_file)
    else:
        env[HOLD_ENV] = HELD_WRITES[stage]
        env[HOLD_SIGNAL_ENV] = str(signal_file)
    return subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2"], cwd=root, env=env,
                            stdout=open(root / "held-run.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for_hold(proc: subprocess.Popen, signal_file: Path, root: Path, timeout: float = 300) -> int:
    """Wait until the held stage announces itself; return the pid it wrote."""
    deadline = time.monotonic() + timeout
    while not (signal_file.exists() and signal_file.read_text().strip()):
        if proc.poll() is not None:
            pytest.fail(f"snakemake exited ({proc.returncode}) before the hold:\n"
                        f"{(root / 'held-run.log').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the held stage never started")
        time.sleep(0.05)
    return int(signal_file.read_text().split()[0])


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def process_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat[stat.rfind(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


# The write each stage is stopped in (k2vec.atomic's test hook): a temporary exists when it is killed.
HELD_WRITES = {
    "weights": "results/models/tiny/fp32",
    "quantize": "results/models/tiny/int4",
    "golden": "results/golden/tiny/int4.kdtr",
    "bundle": "results/bundles/tiny-int4.kdtr",
    "report": "results/report/divergence.csv",
}
STAGES = ["weights", "quantize", "golden", "bundle", "engine_run", "report"]

# Whatever is timing rather than content; everything else must be byte-identical.
TIMING_CSV_COLUMNS = ("tokens_per_s", "decode_tokens_per_s", "wall_s")


def temporaries(results: Path) -> list[Path]:
    """Every hidden entry under results/ other than Snakemake's directory timestamps and the integrity key
    (all of k2vec's temporaries are hidden: `.{name}.{pid}.{random}.tmp`, a scratch directory's
    `.in-use.{pid}`), and anything named like a temporary."""
    found = {p.parent if p.name.startswith(".in-use.") else p   # a killed run's scratch directory
             for p in results.rglob("*")
             if (p.name.startswith(".") and p.name not in (".snakemake_timestamp", KEY_NAME))
             or p.name.endswith((".tmp", ".partial", ".part"))}
    return sorted(found)


def comparable(path: Path, rel: str) -> bytes | object:
    """A file's content as compared between runs: its bytes, less timings where it records them.

    Not compared: results/logs/ and results/benchmarks/ (timings and timestamps throughout).
    results/runs/*.json: `wall_s`, `timing`, `started_at`, `ended_at` dropped, the checkout's path in
    `command` masked; its `.sha256` record
    (of those timings too) is compared as "matches its result".
    results/report/divergence.csv: the timing columns dropped. summary.txt: the throughput line dropped.
    divergence.html: decimal numbers masked (they are the CSV's, compared above, and its timings)."""
    data = path.read_bytes()
    if rel.startswith("results/runs/") and rel.endswith(".sha256"):
        check_record(path.with_name(path.name[: -len(".sha256")]))   # raises unless it matches
        return "matches its result"
    if rel == f"results/{KEY_NAME}":
        return "a key"   # drawn at random per results tree; the keyed records are checked against it
    if rel.startswith("results/runs/") and rel.endswith(".hmac"):
        key = read_key(path.parents[rel.count("/") - 1] / KEY_NAME)
        check_keyed_record(path.with_name(path.name[: -len(".hmac")]), key)   # raises unless it matches
        return "matches its result under the tree's key"
    if rel.startswith("results/runs/"):
        result = json.loads(data)
        for timing in ("wall_s", "timing", "started_at", "ended_at"):
            result.pop(timing, None)
        # the command names the bundle and the scratch directory by absolute path: the checkout's differs
        root = str(path.parents[rel.count("/")])
        result["command"] = result.get("command", "").replace(root, "ROOT")
        return result
    if rel == "results/report/divergence.csv":
        rows = list(csv.DictReader(io.StringIO(data.decode())))
        return [{k: v for k, v in row.items() if k not in TIMING_CSV_COLUMNS} for row in rows]
    if rel == "results/report/summary.txt":
        return [line for line in data.decode().splitlines() if "throughput:" not in line]
    if rel == "results/report/divergence.html":
        return re.sub(r"\d+\.\d+", "#", data.decode())
    return data


def outputs(root: Path) -> dict[str, object]:
    files = sorted(p for p in (root / "results").rglob("*") if p.is_file())
    rels = {p: p.relative_to(root).as_posix() for p in files}
    # the report's parses of results are named by the results' bytes, which hold the runs' clocks: counted only
    parses = [rel for rel in rels.values() if rel.startswith("results/report-cache/") and rel.endswith(".marshal")]
    return {"results/report-cache/*.marshal": len(parses)} | {
        rel: comparable(p, rel) for p, rel in rels.items()
        if not rel.startswith(("results/logs/", "results/benchmarks/")) and rel not in parses}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    root = tiny_workflow(tmp_path_factory.mktemp("clean"))
    res = plain_snakemake(root, "--cores", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    return outputs(root)


# ------------------------------------------------------------------------------ default profile

def test_plain_snakemake_loads_the_default_profile(tmp_path):
    root = tiny_workflow(tmp_path / "wf")
    res = plain_snakemake(root, "-n")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert "Using workflow specific profile profiles/default" in out
    assert "Shell command:" in out  # the profile's printshellcmds
    # The same dry run without the profile prints neither: both lines come from it.
    res = plain_snakemake(root, "-n", "--workflow-profile", "none")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Using workflow specific profile" not in res.stdout + res.stderr
    assert "Shell command:" not in res.stdout + res.stderr
    # Its cores and gpu limit are in effect in a real run, and Snakemake finds it beside the Snakefile
    # when started from another directory.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = plain_snakemake(elsewhere, "--snakefile", str(root / "Snakefile"), "results/cases/tiny/model.json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert f"Using workflow specific profile {root / 'profiles/default'}" in out
    assert "Provided cores: 8" in out and 'Provided resources: gpu=Resource("gpu", 8)' in out


# ------------------------------------------------------------------------------ kill and resume

def test_sigkill_in_each_stage_in_turn_then_plain_rerun_completes_identically(clean_run, tmp_path):
    """Snakemake is SIGKILLed (with its process group) inside each stage in turn; every run after the
    first is the user's plain `snakemake --cores 2` resuming the killed one, and the last completes.
    Each stage is held in its write (k2vec.atomic's test hook, or the engine sleeping after writing
    its result), so every kill leaves a temporary and Snakemake's lock behind."""
    root = tiny_workflow(tmp_path / "wf")
    left: list[Path] = []
    for n, stage in enumerate(STAGES):
        signal_file = tmp_path / f"held-{stage}"
        proc = start_held(root, stage, signal_file)
        held_pid = wait_for_hold(proc, signal_file, root)
        log = (root / "held-run.log").read_text()
        if n:  # this run resumed the one killed in the previous stage: its leftovers are gone
            assert "removed the Snakemake lock left by a killed run" in log, log[-3000:]
            assert "temporary file(s) or directories of killed runs" in log and str(left[0].relative_to(root)) in log
            assert not any(p.exists() for p in left)
        kill_group(proc.pid)  # Snakemake and its running job
        if stage == "engine_run":
            kill_group(held_pid)  # the runner starts the engine in its own session: kill it as a reboot would
        proc.wait()
        assert process_gone(held_pid), f"{stage}: the held job survived the kill"
        left = temporaries(root / "results")
        assert left, f"{stage}: the kill left no temporary: it did not hit a write"
        assert list((root / ".snakemake/locks").glob("*.lock")), f"{stage}: the kill left no Snakemake lock"

    res = plain_snakemake(root, "--cores", "2")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "removed the Snakemake lock left by a killed run" in res.stderr
    assert ("temporary file(s) or directories of killed runs" in res.stderr
            and str(left[0].relative_to(root)) in res.stderr)
    assert temporaries(root / "results") == []
    assert not list((root / ".snakemake/locks").glob("*.lock"))
    resumed = outputs(root)
    assert sorted(resumed) == sorted(clean_run)
    assert [rel for rel in clean_run if resumed[rel] != clean_run[rel]] == []
    res = plain_snakemake(root, "-n")
    assert "Nothing to be done" in res.stdout + res.stderr, res.stdout[-2000:]


def test_second_snakemake_is_refused_while_the_first_runs(tmp_path):
    root = tiny_workflow(tmp_path / "wf")
    signal_file = tmp_path / "held"
    first = start_held(root, "weights", signal_file)
    try:
        wait_for_hold(first, signal_file, root)
        locks = sorted((root / ".snakemake/locks").glob("*.lock"))
        assert locks
        res = plain_snakemake(root, "--cores", "2")
        assert res.returncode != 0
        assert "Directory cannot be locked" in res.stdout + res.stderr, res.stderr[-2000:]
        assert f"Snakemake process(es) {first.pid} still running in this directory" in res.stderr
        assert sorted((root / ".snakemake/locks").glob("*.lock")) == locks  # the live run's lock is kept
        assert first.poll() is None
    finally:
        kill_group(first.pid)
        first.wait()


def test_only_dead_writers_temporaries_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = os.getpid()
    names = {
        f".fp32.{dead.pid}.ab_12xyz.tmp": False,  # a killed directory write
        f".tiny-int4.kdtr.{dead.pid}.k3j9a0qq.tmp": False,
        f".tiny-int4.kdtr.{live}.k3j9a0qq.tmp": True,  # a live concurrent writer's
        f".x.{dead.pid}.kdtr.{live}.abcdefgh.tmp": True,  # the pid is the last number but one
        ".snakemake_timestamp": True,
        "model.json": True,
    }
    folder = tmp_path / "results" / "models"
    folder.mkdir(parents=True)
    for name in names:
        if name.startswith(".fp32."):
            (folder / name).mkdir()
            (folder / name / "model-00001.safetensors").write_bytes(b"x")
        else:
            (folder / name).write_bytes(b"x")
    # Engine scratch directories: a killed runner's goes whole, a live runner's and a failed run's
    # (kept for inspection, no marker) stay.
    scratch = tmp_path / "results" / "scratch" / "numpy"
    for run, marker in (("killed", f".in-use.{dead.pid}"), ("running", f".in-use.{live}"), ("failed", None)):
        (scratch / run / "out").mkdir(parents=True)
        (scratch / run / "out" / "result.json").write_bytes(b"{}")
        if marker:
            (scratch / run / marker).touch()
    removed = remove_dead_temporaries(tmp_path / "results")
    assert sorted(p.name for p in removed) == sorted([*(n for n, keep in names.items() if not keep), "killed"])
    assert sorted(p.name for p in folder.iterdir()) == sorted(n for n, keep in names.items() if keep)
    assert sorted(p.name for p in scratch.iterdir()) == ["failed", "running"]


# ------------------------------------------------------------------------------ the checkout's own package

def test_jobs_import_the_snakefiles_checkout_not_the_installed_one(tmp_path):
    """Clone A is what the environment resolves `k2vec` to (PYTHONPATH is stronger than an editable
    install's path entry); running clone B's Snakefile must run B's package, in stage scripts and in
    engine commands."""
    clone_a, clone_b = tiny_workflow(tmp_path / "a"), tiny_workflow(tmp_path / "b")
    config = tiny_config()
    config["engines"]["probe"] = {
        "command": "{python} -c 'pass' {bundle} {output}",
        "build": f"{sys.executable} -c 'import k2vec; print(\"engine imports\", k2vec.__file__)'",
    }
    write_config(clone_b / "config.yaml", config)
    env = {**plain_env(), "PYTHONPATH": str(clone_a / "src")}
    res = plain_snakemake(clone_b, "--cores", "1", "results/cases/tiny/model.json",
                          "results/engines/probe/build.stamp", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    stage_log = (clone_b / "results/logs/cases/tiny/model.log").read_text()
    assert f"package k2vec from {clone_b / 'src/k2vec'}" in stage_log, stage_log
    build_log = (clone_b / "results/logs/engines/probe/build.log").read_text()
    assert f"engine imports {clone_b / 'src/k2vec/__init__.py'}" in build_log, build_log
    assert str(clone_a) not in stage_log + build_log


def test_timers_left_waiting_at_the_end_of_a_run_are_cancelled():
    """Snakemake's scheduler leaves a non-daemon 1 s `threading.Timer` behind after a run that ran jobs; Python
    waits for it at exit. `cancel_timers` (the Snakefile's onsuccess and onerror) ends it without firing it."""
    import threading

    from k2vec.pipeline.setup import cancel_timers

    fired = threading.Event()
    timer = threading.Timer(60, fired.set)
    timer.start()
    assert cancel_timers() >= 1
    timer.join(5)
    assert not timer.is_alive() and not fired.is_set()
    assert cancel_timers() == 0
