"""A slice of the user's compressed-tensors checkpoint as the pipeline's fp32 and int4 weights."""
from k2vec.config.cases import read_json
from k2vec.stages.import_checkpoint import import_checkpoint
from k2vec.pipeline.stage import fail_to_stderr, stage_logging

fail_to_stderr()  # the message names the file and tensor at fault; the traceback is in the log
with stage_logging(snakemake.log[0], "import_checkpoint") as log:
    model = read_json(snakemake.input.model)
    index = import_checkpoint(model, read_json(snakemake.input.quantization), snakemake.output.fp32,
                              snakemake.output.int4)
    log.info("%s: layers %s, experts %s of %s: %d weights copied as INT4 (%s scales), %d as fp32",
             model["name"], model["source"]["layers"], model["source"]["experts"], model["source"]["checkpoint"],
             len(index["tensors"]), index["quantization"]["scale_dtype"], len(index["unquantized"]["tensors"]))
