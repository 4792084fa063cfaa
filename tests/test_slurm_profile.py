"""The `slurm` profile and config `slurm:` without a cluster: which resources each job carries for the SLURM
executor plugin, and that a run without `slurm:` settings carries none of them (the default profile's jobs
are as before). The cluster itself: tests/test_slurm.py (-m slurm)."""
import re
from importlib.util import find_spec

import pytest
import yaml

from conftest import REPO, snakemake, write_config


def job_resources(stdout: str) -> dict[str, dict[str, str]]:
    """{output: {resource: value}} of every output of every job in a dry run's listing (a batch engine's job
    has an output per run)."""
    jobs = {}
    for block in re.split(r"\n(?=\[[^\]]+\]\n(?:local)?rule )", stdout):
        output = re.search(r"^    output: (.*)$", block, re.M)
        resources = re.search(r"^    resources: (.*)$", block, re.M)
        if output and resources:
            for path in output[1].split(", "):
                jobs[path] = dict(item.split("=", 1) for item in resources[1].split(", "))
    return jobs


# A GPU engine's runs, a CPU engine's run and every stage before them (the whole default DAG takes
# much longer to list).
TARGETS = [f"results/runs/{engine}/tiny-int4-{mode}.json" for engine in ("gpu_fp32", "gpu_bf16")
           for mode in ("greedy", "score")] + ["results/runs/numpy/tiny-int4-greedy.json",
                                               "results/format-effect/tiny.json"]


def dry_run(tmp_path, overlay: dict) -> dict[str, dict[str, str]]:
    path = write_config(tmp_path / "overlay.yaml", {"gpus": {"devices": [0, 1], "lock_dir": str(tmp_path / "locks")},
                                                    **overlay})
    res = snakemake("-n", *TARGETS, "--directory", str(tmp_path), "--configfile", str(path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = job_resources(res.stdout)
    assert set(TARGETS) <= set(jobs), res.stdout[-2000:]
    return jobs


def test_partitions_and_gpu_model_reach_the_jobs(tmp_path):
    jobs = dry_run(tmp_path, {"slurm": {"partition": "cpu", "gpu_partition": "gpu", "gpu_model": "h200"}})
    gpu_runs = {o: r for o, r in jobs.items() if o.startswith("results/runs/gpu_")}
    assert {t for t in TARGETS if t.startswith("results/runs/gpu_")} <= set(gpu_runs)
    assert all(r["gpu"] == "1" and r["gpu_model"] == "h200" and r["slurm_partition"] == "gpu"
               for r in gpu_runs.values())
    cpu_runs = {o: r for o, r in jobs.items() if o.startswith("results/runs/") and o not in gpu_runs}
    assert cpu_runs and all(r["gpu"] == "0" and "gpu_model" not in r and r["slurm_partition"] == "cpu"
                            for r in cpu_runs.values())
    stages = {o: r for o, r in jobs.items() if not o.startswith("results/runs/")}
    assert {o.split("/")[1] for o in stages} == {"cases", "models", "prompts", "golden", "bundles", "format-effect"}
    assert all(r["slurm_partition"] == "cpu" and "gpu_model" not in r for r in stages.values())


def test_without_slurm_settings_no_job_carries_slurm_resources(tmp_path):
    jobs = dry_run(tmp_path, {})
    assert not any({"slurm_partition", "gpu_model"} & set(r) for r in jobs.values())
    assert {r.get("gpu") for o, r in jobs.items() if o.startswith("results/runs/gpu_")} == {"1"}


def test_bad_gpu_model_names_the_key(tmp_path):
    path = write_config(tmp_path / "overlay.yaml", {"slurm": {"gpu_model": "'h200'"}})
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(path), cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "config key 'slurm.gpu_model'" in out, out[-2000:]


def test_slurm_profile_differs_from_the_default_only_in_placement():
    default = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    slurm = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm" and "cores" not in slurm and "resources" not in slurm
    placement = {"cores", "resources", "executor", "jobs", "latency-wait"}
    assert {k: v for k, v in default.items() if k not in placement} == {
        k: v for k, v in slurm.items() if k not in placement}


@pytest.mark.skipif(find_spec("snakemake_executor_plugin_slurm") is None, reason="pip install -e '.[slurm]'")
def test_slurm_profile_loads(tmp_path):
    res = snakemake("-n", "results/cases/tiny.json", "--workflow-profile", str(REPO / "profiles" / "slurm"),
                    "--directory", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"Using workflow specific profile {REPO / 'profiles' / 'slurm'}" in res.stdout + res.stderr


def test_a_jobs_own_snakemake_leaves_temporaries_alone(tmp_path):
    # Under SLURM each job's Snakemake parses the Snakefile on its node (--mode remote). A temporary named
    # for a pid that is dead here may be a live writer's on another node: only the submitting process,
    # whose writers all run on its own host or are its jobs, may sweep.
    pid = 4194305   # above Linux's largest pid_max (2**22): never alive on this host
    planted = tmp_path / "results" / "cases" / f".tiny.json.{pid}.x1y2.tmp"
    planted.parent.mkdir(parents=True)
    planted.write_text("being written on another node")
    res = snakemake("-n", "--mode", "remote", "results/cases/tiny/model.json", "--directory", str(tmp_path),
                    cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert planted.exists()
    assert not (tmp_path / ".snakemake" / "k2vec-owners").exists()
    # The started Snakemake does sweep it (k2vec.pipeline.setup): the writer is dead on the only host it serves.
    res = snakemake("-n", "results/cases/tiny/model.json", "--directory", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not planted.exists()
