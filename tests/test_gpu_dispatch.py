"""GPU engines in the pipeline: left out (with one notice) where the pool is empty, scheduled where it is
not, and the `gpu` resource capped at the pool's size so no job waits for a device while holding a core."""
import re

from conftest import REPO, default_config, snakemake, write_config
from test_workflow import scheduled_jobs

from k2vec.config.engines import engine_runs, engines_short_of_gpus, resolve_engines

NOTICE = "k2vec: no run of GPU engine(s) gpu_fp32, gpu_bf16: the GPU pool has 0 device(s)"
GPU_ENGINES = [name for name, e in default_config()["engines"].items() if e.get("gpus")]


def test_gpu_engines_left_out_of_runs_without_devices():
    cfg = default_config()
    engines = resolve_engines(cfg, str(REPO))
    budgets = cfg["decoding"]["ddtree"]["budgets"]
    assert engines_short_of_gpus(engines, 0) == GPU_ENGINES == ["gpu_fp32", "gpu_bf16"]
    assert engines_short_of_gpus(engines, 1) == []
    kept = engine_runs(engines, budgets, engines_short_of_gpus(engines, 0))
    assert {r[0] for r in kept} == {"numpy", "hf_fp32", "hf_bf16", "native", "llama_cpp", "vllm"}   # (packages aside)
    every = engine_runs(engines, budgets)
    assert sum(r[0] == "gpu_fp32" for r in every) == 2 * 2 * (2 + len(budgets))  # models x precisions x modes


def test_dry_run_without_devices_lists_no_gpu_job_and_one_notice(tmp_path):
    res = snakemake("-n", "--directory", str(tmp_path), cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count(NOTICE) == 1, res.stderr[-2000:]
    assert "results/runs/gpu_" not in res.stdout
    jobs = scheduled_jobs(res.stdout)
    # the numpy and transformers engines' bundles (batch engines) and the native engine's runs only
    assert {r: n for r, n in jobs.items() if r.startswith("engine_")} == {
        "engine_batch_numpy": 4, "engine_batch_hf_fp32": 4, "engine_batch_hf_bf16": 4, "engine_build": 1,
        "engine_run": 24}, jobs


def test_dry_run_with_fake_devices_schedules_gpu_engines(tmp_path):
    cfg = write_config(tmp_path / "devices.yaml", {"gpus": {"devices": [0, 1], "lock_dir": str(tmp_path / "locks")}})
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(cfg), cwd=tmp_path,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "k2vec: no run of GPU engine" not in res.stderr
    outputs = [o for line in re.findall(r"^\s+output: (.*)$", res.stdout, re.M) for o in line.split(", ")]
    assert sum(o.startswith("results/runs/gpu_fp32/") for o in outputs) == 24
    assert sum(o.startswith("results/runs/gpu_bf16/") for o in outputs) == 24
    jobs = scheduled_jobs(res.stdout)
    assert jobs["engine_batch_gpu_fp32"] == jobs["engine_batch_gpu_bf16"] == 4, jobs   # one job per bundle


def _max_running(log: str, rule: str) -> int:
    """Most jobs of `rule` running at once, from the order of Snakemake's start and finish lines."""
    running = peak = 0
    for line in log.splitlines():
        if re.match(rf"(local)?rule {rule}:", line):
            running += 1
            peak = max(peak, running)
        elif re.match(rf"Finished jobid: \d+ \(Rule: {rule}\)", line):
            running -= 1
    return peak


def test_gpu_resource_capped_at_pool_size(tmp_path):
    # Two devices, the profile's gpu=8 and 6 cores free: without the cap up to 6 GPU jobs would start and
    # 4 of them would wait for a device, each holding a core.
    fake = REPO / "tests" / "engines" / "fake_engine.py"
    records = tmp_path / "records"
    records.mkdir()
    cfg = default_config()
    cfg["models"] = {"tiny": cfg["models"]["tiny"]}
    cfg["engines"] = {"fakegpu": {
        "command": f"{{python}} {fake} ok {records} --bundle {{bundle}} --mode {{mode}} --budget {{budget}} "
                   f"--output {{output}}",
        "sources": [str(fake)], "gpus": 1, "precisions": ["fp32"], "sandbox": False}}   # it records outside its scratch
    cfg["gpus"] = {"devices": [0, 1], "lock_dir": str(tmp_path / "locks"), "jobs_per_device": 1}   # a GPU each
    path = write_config(tmp_path / "cap.yaml", cfg)
    targets = [f"results/runs/fakegpu/tiny-fp32-{m}.json" for m in ("greedy", "ddtree-b1", "ddtree-b4", "ddtree-b16")]
    res = snakemake(*targets, "--cores", "6", "--resources", "gpu=8", "--directory", str(tmp_path),
                    "--configfile", str(path), "--replace-workflow-config", cwd=tmp_path,
                    env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-3000:]
    log = res.stdout + res.stderr
    assert _max_running(log, "engine_run") == 2, log[-3000:]
    assert len(list(records.iterdir())) == 4
