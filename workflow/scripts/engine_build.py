"""Build one engine; the stamp records what was built."""
import os

from k2vec.engines.build import build_engine
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "engine_build"):
    build_engine(snakemake.wildcards.engine, snakemake.params.command, list(snakemake.params.sources),
                 snakemake.output[0], log_path=snakemake.log[0], timeout_s=snakemake.params.timeout_s,
                 # scriptdir: the directory of the rule's file, workflow/rules
                 repo=os.path.normpath(os.path.join(snakemake.scriptdir, "..", "..")))
