"""Write one resolved case section (computed when the workflow is parsed) as canonical JSON."""
from k2vec.config.cases import write_json
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "case_section") as log:
    write_json(snakemake.output[0], snakemake.params.content)
    log.info("wrote %s", snakemake.output[0])
