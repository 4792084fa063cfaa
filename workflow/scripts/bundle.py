"""One KDTR bundle per (model, precision)."""
import os

from k2vec.stages.bundle import write_case_bundle
from k2vec.config.cases import read_json
from k2vec.pipeline.stage import fail_to_stderr, stage_logging

fail_to_stderr()  # the message names the file at fault; the traceback is in the log
with stage_logging(snakemake.log[0], "bundle") as log:
    inp = snakemake.input
    write_case_bundle(snakemake.output[0], model=read_json(inp.model), decoding=read_json(inp.decoding),
                      precision=snakemake.wildcards.precision, fp32_dir=inp.fp32, int4_dir=inp.get("int4"),
                      golden_path=inp.golden)
    log.info("wrote %s (%d bytes)", snakemake.output[0], os.path.getsize(snakemake.output[0]))
