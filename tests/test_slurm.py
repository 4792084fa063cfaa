"""The `slurm` profile on a real one-node SLURM cluster (tests/slurm/cluster.sh: slurmctld, slurmd and
munged on loopback, 4 fake GPUs of type `fake`): every job goes through sbatch, every GPU run gets its
own device, and the outputs are byte-identical to a local run's but for timings and device ids.

Opt-in (`-m slurm`): needs root, apt (Debian's slurmctld, slurmd, munge) and
snakemake-executor-plugin-slurm importable (`pip install -e '.[slurm]'`); README says how to run it.
"""
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, copy_workflow, default_config, write_config
from test_resume import comparable

pytestmark = pytest.mark.slurm

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
PROBE = REPO / "tests" / "slurm" / "probe_engine.py"
GPUS = 4
PARTITION = "k2vec"     # cluster.sh's partition
GPU_MODEL = "fake"      # cluster.sh's GPU type
# Result fields that say when and on which device a run ran, not what it computed.
RUN_PLACE_FIELDS = ("gpus", "gpu_devices", "probe")
REPORT_PLACE_COLUMNS = ("gpu", "gpu_uuid")   # the report's label of the GPU a run used


def slurm_config(lock_dir: Path) -> dict:
    """The tiny model, short prompts; the numpy engine (CPU) and the probe engine (1 GPU) on both
    precisions and every mode: 8 GPU runs for 4 devices, so SLURM must queue and reuse them."""
    config = default_config()
    config["models"] = {"tiny": config["models"]["tiny"]}
    config["prompts"].update(count=2, min_length=4, max_length=6)
    config["decoding"]["max_new_tokens"] = 6
    config["decoding"]["ddtree"].update(block_size=4, budgets=[1, 4], accuracies=[0.9])
    numpy_engine = config["engines"]["numpy"]
    numpy_engine["modes"] = ["greedy"]
    config["engines"] = {
        "numpy": numpy_engine,
        "probe": {"command": f"OPENBLAS_NUM_THREADS=1 {{python}} {PROBE} --bundle {{bundle}} --mode {{mode}} "
                             f"--budget {{budget}} --output {{output}}",
                  "sources": [str(PROBE), "src/k2vec/engines/numpy_engine.py"], "gpus": 1, "timeout_s": 600},
    }
    config["gpus"] = {"devices": list(range(GPUS)), "lock_dir": str(lock_dir)}
    config["slurm"] = {"partition": PARTITION, "gpu_partition": None, "gpu_model": GPU_MODEL}
    return config


def workflow_copy(dest: Path) -> Path:
    dest.mkdir(parents=True)
    copy_workflow(dest)
    write_config(dest / "config.yaml", slurm_config(dest / "gpu-locks"))
    return dest


def outputs(root: Path) -> dict[str, object]:
    """Every output as compared between the runs (test_resume.comparable: timings dropped, the checkout's
    path masked), engine results and the report also without the device each run used: the local pool
    and SLURM hand out devices in different orders."""
    found = {}
    for path in sorted(p for p in (root / "results").rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("results/logs/", "results/benchmarks/")):
            continue
        content = comparable(path, rel)
        if rel.startswith("results/runs/") and isinstance(content, dict):
            content = {k: v for k, v in content.items() if k not in RUN_PLACE_FIELDS}
        elif rel == "results/report/divergence.csv":
            content = [{k: v for k, v in row.items() if k not in REPORT_PLACE_COLUMNS} for row in content]
        elif rel == "results/report/divergence.html":
            content = re.sub(r"GPU \d+ ", "GPU # ", content)
        found[rel] = content
    return found


def probe_runs(root: Path) -> list[dict]:
    runs = []
    for path in sorted((root / "results" / "runs" / "probe").glob("*.json")):
        result = json.loads(path.read_text())
        assert result["status"] == "ok", (path, result.get("reason"))
        runs.append({"name": path.stem, "gpus": result["gpus"], **result["probe"]})
    return runs


def overlapping(runs: list[dict]) -> list[tuple[dict, dict]]:
    return [(a, b) for a, b in itertools.combinations(runs, 2) if a["start"] < b["end"] and b["start"] < a["end"]]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the SLURM test starts slurmd and installs packages: needs root")
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="pip install -e '.[slurm]'")
    # munged wants a socket directory every user can search: not under pytest's private tmp.
    state = Path(tempfile.mkdtemp(prefix="k2vec-slurm-"))
    env = {**os.environ, "K2VEC_SLURM_GPUS": str(GPUS)}
    started = subprocess.run([str(CLUSTER), "start", str(state)], capture_output=True, text=True, env=env,
                             timeout=600)
    if started.returncode != 0:
        shutil.rmtree(state, ignore_errors=True)
        pytest.fail(f"cluster.sh start failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield {"SLURM_CONF": str(state / "slurm.conf")}
    finally:
        stopped = subprocess.run([str(CLUSTER), "stop", str(state)], capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        assert not state.exists()


@pytest.fixture(scope="module")
def base():
    # Not under pytest's tmp tree: a concurrent pytest session of the same user may prune it while the
    # minutes of this test run.
    path = Path(tempfile.mkdtemp(prefix="k2vec-slurm-run-"))
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def runs(cluster, base):
    """The same workflow run locally (default profile) and through SLURM (profiles/slurm)."""
    local, remote = workflow_copy(base / "local"), workflow_copy(base / "remote")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2"], cwd=local, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    local_s, started = time.monotonic() - started, time.monotonic()
    env = {**os.environ, **cluster}
    # Status by squeue (no accounting database here: MinJobAge keeps finished jobs listed), polled
    # from 2 s on instead of the plugin's 40 s; no account to charge.
    res = subprocess.run([sys.executable, "-m", "snakemake", "--workflow-profile", str(REPO / "profiles" / "slurm"),
                          "--jobs", "8", "--slurm-status-command", "squeue",
                          "--slurm-init-seconds-before-status-checks", "2", "--slurm-no-account",
                          "--latency-wait", "5"],
                         cwd=remote, capture_output=True, text=True, timeout=1500, env=env)
    slurm_s = time.monotonic() - started
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    # Every job of the run (MinJobAge keeps finished ones listed): what it asked for, how it ended.
    jobs = subprocess.run(["squeue", "-h", "-t", "all", "-O", "JobID:|,Partition:|,tres-per-job:|,State:|,WorkDir:|"],
                          capture_output=True, text=True, env=env, check=True).stdout.split()
    probes = probe_runs(remote)
    # for the record (pytest -rP): wall times, jobs, and which device each GPU run got
    print(f"local run {local_s:.0f} s; SLURM run {slurm_s:.0f} s, {len(jobs)} sbatch jobs; GPU runs (job: device): "
          + ", ".join(f"{p['slurm_job_id']}: {p['cuda_visible_devices']}" for p in probes)
          + f"; {len(overlapping(probes))} overlapping pairs")
    return {"local": local, "remote": remote, "log": res.stdout + res.stderr,
            "jobs": [dict(zip(("id", "partition", "tres", "state", "workdir"), j.split("|"))) for j in jobs]}


def test_every_job_went_through_sbatch_with_its_partition_and_gpus(runs):
    submitted = re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", runs["log"])
    jobs = {j["id"]: j for j in runs["jobs"]}
    assert submitted and len(submitted) == len(jobs), runs["log"][-3000:]
    assert all(j["state"] == "COMPLETED" and j["partition"] == PARTITION for j in jobs.values()), jobs
    # config slurm.partition reached every rule, the trivial ones ran in the main process
    assert {re.search(r"rule_(\w+)/", line)[1]
            for line in re.findall(r"has been submitted with SLURM jobid.*", runs["log"])} \
        == {"weights", "quantize", "export_compressed_tensors", "golden", "bundle", "format_effect",
            "engine_batch_numpy", "engine_run", "report"}
    assert all(j["workdir"] == str(runs["remote"]) for j in jobs.values()), jobs
    # sbatch --gpus=fake:1 for each probe run, no GPU for anything else
    gpu_jobs = {p["slurm_job_id"] for p in probe_runs(runs["remote"])}
    assert len(gpu_jobs) == 8
    for job_id, job in jobs.items():
        assert job["tres"] == ("gres:gpu:fake:1" if job_id in gpu_jobs else "N/A"), job


def test_every_gpu_run_saw_its_own_device(runs):
    probes = probe_runs(runs["remote"])
    for p in probes:
        # the device SLURM gave the job's step is the one the runner passed on and the engine saw
        assert p["slurm_job_id"] and p["slurm_step_gpus"] is not None, p
        assert p["cuda_visible_devices"] == p["slurm_step_gpus"] and p["gpus"] == [p["cuda_visible_devices"]], p
        assert p["cuda_visible_devices"] in {str(i) for i in range(GPUS)}, p
    pairs = overlapping(probes)
    assert pairs, "no two GPU runs overlapped: the check below would prove nothing"
    for a, b in pairs:
        assert a["cuda_visible_devices"] != b["cuda_visible_devices"], (a, b)
    assert len({p["cuda_visible_devices"] for p in probes}) > 1


def test_local_run_leased_distinct_devices_too(runs):
    probes = probe_runs(runs["local"])
    assert all(p["slurm_job_id"] is None and p["gpus"] == [p["cuda_visible_devices"]] for p in probes), probes
    for a, b in overlapping(probes):
        assert a["cuda_visible_devices"] != b["cuda_visible_devices"], (a, b)


def test_outputs_under_slurm_are_identical_to_a_local_run(runs):
    local, remote = outputs(runs["local"]), outputs(runs["remote"])
    assert sorted(local) == sorted(remote)
    assert any(rel.startswith("results/golden/") for rel in local) and any(
        rel.startswith("results/runs/probe/") for rel in local)
    differ = [rel for rel in local if local[rel] != remote[rel]]
    assert differ == []


def test_nothing_to_rerun_after_the_slurm_run(runs, cluster):
    # Snakemake records each job's metadata (params included) in the submitting process: a plain rerun
    # on the submit host finds everything current.
    res = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--workflow-profile",
                          str(REPO / "profiles" / "slurm"), "--slurm-no-account"],
                         cwd=runs["remote"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **cluster})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Nothing to be done" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
