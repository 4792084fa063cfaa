"""Synthetic fp32 HF checkpoint for one model."""
from k2vec.config.cases import read_json
from k2vec.pipeline.stage import fail_to_stderr, stage_logging
from k2vec.stages.weights import write_checkpoint

fail_to_stderr()  # the message names the file at fault; the traceback is in the log
with stage_logging(snakemake.log[0], "weights") as log:
    model = read_json(snakemake.input.model)
    index = write_checkpoint(model, snakemake.output[0])
    log.info("%s: %d tensors, %d bytes", model["name"], len(index["weight_map"]), index["metadata"]["total_size"])
