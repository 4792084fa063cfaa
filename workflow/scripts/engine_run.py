"""Run one engine on one bundle through the contract: one run (rule engine_run), or every run of the bundle
in one process (rules engine_batch_<engine>); always writes a result per run (ok or failed)."""
import sys

from k2vec.engines.contract.result_cache import report_cache_dir
from k2vec.engines.gpus import device_pool
from k2vec.engines.runner import run_engine_batch
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log.runner, "engine_run") as log:
    engine = snakemake.params.engine
    # rule engine_run: the {mode} wildcard; a batch rule: every mode of the engine, as its outputs are ordered
    modes = snakemake.params.modes if snakemake.params.modes else [snakemake.wildcards.mode]
    results = run_engine_batch(
        engine=snakemake.params.name,
        command=engine["command"],
        bundle=snakemake.input.bundle,
        runs=list(zip(modes, snakemake.output)),
        gpus=engine["gpus"],
        # The pool (config `gpus`) is read here, not declared as params: which devices are visible is no
        # input of a result (the one used is recorded in it), so changing them must rerun nothing.
        devices=device_pool(snakemake.config["gpus"]["devices"]) if engine["gpus"] else [],
        lock_dir=snakemake.config["gpus"]["lock_dir"],
        jobs_per_device=snakemake.config["gpus"]["jobs_per_device"],
        timeout_s=engine["timeout_s"],
        max_result_mb=engine["max_result_mb"],
        scratch_dir=snakemake.params.scratch,
        sandbox=engine["sandbox"],
        sandbox_required=engine.get("sandbox_required", True),
        results_dir="results",
        parse_cache=str(report_cache_dir("results")),   # the report parses none of this job's results
        stderr_path=snakemake.log.engine,
        python=sys.executable,
    )
    for result in results:
        log.info("%s %s: %s%s (%.2f s)", result["engine"], result["mode"], result["status"],
                 f" - {result['reason']}" if result["reason"] else "", result.get("wall_s", 0.0))
