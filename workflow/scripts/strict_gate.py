"""Fail on a real divergence or a failed run (config report.strict: true)."""
from k2vec.report.gate import check_strict
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "strict_gate"):
    check_strict(snakemake.input.csv, snakemake.output[0])
