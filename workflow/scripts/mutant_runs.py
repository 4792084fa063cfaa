"""Run one mutant on one bundle in each of its modes, through the engine runner (rule mutant_runs)."""
import sys
from pathlib import Path

from k2vec.atomic import atomic_directory
from k2vec.engines.runner import run_engine
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log.runner, "mutant_runs") as log, atomic_directory(snakemake.output[0]) as out:
    engine = snakemake.params.engine
    engine_log = Path(snakemake.log.engine)
    engine_log.write_text("")
    mode_log = engine_log.with_suffix(".mode.log")
    for mode in snakemake.params.modes:
        result = run_engine(
            engine=snakemake.params.name,
            command=engine["command"],
            bundle=snakemake.input.bundle,
            mode=mode,
            output=str(out / f"{mode}.json"),
            gpus=engine["gpus"],
            devices=snakemake.params.devices,
            lock_dir=snakemake.params.lock_dir,
            timeout_s=engine["timeout_s"],
            max_result_mb=engine["max_result_mb"],
            scratch_dir=f"{snakemake.params.scratch}/{mode}",
            sandbox=engine["sandbox"],
            sandbox_required=engine.get("sandbox_required", True),
            results_dir="results",
            stderr_path=str(mode_log),
            python=sys.executable,
        )
        with engine_log.open("a") as fh:
            fh.write(f"=== {mode}\n{mode_log.read_text()}")
        log.info("%s %s: %s%s (%.2f s)", result["engine"], mode, result["status"],
                 f" - {result['reason']}" if result["reason"] else "", result.get("wall_s", 0.0))
    mode_log.unlink(missing_ok=True)
