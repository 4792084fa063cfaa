"""Join a case's sections into results/cases/{model}.json."""
from k2vec.config.cases import merge_sections
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "case") as log:
    merge_sections(snakemake.input.sections, snakemake.output[0])
    log.info("wrote %s", snakemake.output[0])
