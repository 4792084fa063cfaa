"""Draw one model's prompts for one precision, rejecting those near-tied at a prompt position (k2vec.stages.prompts)."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))  # before numpy loads
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.config.cases import read_json, write_json  # noqa: E402
from k2vec.stages.golden import open_weights, reference_model  # noqa: E402
from k2vec.stages.prompts import draw_prompts  # noqa: E402
from k2vec.pipeline.stage import fail_to_stderr, stage_logging  # noqa: E402

fail_to_stderr()
with stage_logging(snakemake.log[0], "prompts"):
    inp, precision = snakemake.input, snakemake.wildcards.precision
    model = read_json(inp.model)
    if precision == "fp32":
        weights, start_from = open_weights("fp32", inp.weights, None), None
    else:  # start each index from the fp32 choice: the goldens share every prompt not blind under int4
        weights = open_weights("int4", inp.fp32_weights, inp.weights)
        start_from = read_json(inp.fp32_prompts)
    models = {precision: reference_model(model, weights)}
    write_json(snakemake.output[0], draw_prompts(read_json(inp.settings), model, models, start_from))
