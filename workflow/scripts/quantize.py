"""INT4 .qw/.sc files for the weights that the quantization section selects."""
from k2vec.config.cases import read_json
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.pipeline.stage import fail_to_stderr, stage_logging

fail_to_stderr()  # the message names the file at fault; the traceback is in the log
with stage_logging(snakemake.log[0], "quantize") as log:
    index = quantize_checkpoint(snakemake.input.fp32, snakemake.output[0], read_json(snakemake.input.quantization))
    q = index["quantization"]
    log.info("%d tensors quantized (scheme %s, group %d, %s scales), %d left in fp32",
             len(index["tensors"]), q["scheme"], q["group_size"], q["scale_dtype"],
             len(index["unquantized"]["tensors"]))
