"""Fail on a real divergence or a failed run (config report.strict: true), and on a left-out engine
(report.fail_on_left_out: true)."""
from k2vec.report.gate import check_strict
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "strict_gate"):
    check_strict(snakemake.input.csv, snakemake.output[0],
                 snakemake.input.engines_csv if snakemake.params.fail_on_left_out else None)
