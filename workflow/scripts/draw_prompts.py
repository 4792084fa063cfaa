"""Draw one model's prompts, rejecting those near-tied at a prompt position (k2vec.prompts)."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))  # before numpy loads
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.cases import read_json, write_json  # noqa: E402
from k2vec.golden import open_weights, reference_model  # noqa: E402
from k2vec.prompts import draw_prompts  # noqa: E402
from k2vec.stage import fail_to_stderr, stage_logging  # noqa: E402

fail_to_stderr()
with stage_logging(snakemake.log[0], "prompts"):
    inp = snakemake.input
    model = read_json(inp.model)
    models = {p: reference_model(model, open_weights(p, inp.fp32, inp.int4)) for p in ("fp32", "int4")}
    write_json(snakemake.output[0], draw_prompts(read_json(inp.settings), model, models))
