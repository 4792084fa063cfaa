"""Golden data for one (model, precision) from the reference model."""
import os

# One BLAS thread per job: Snakemake already runs one job per core, and on small matrices extra
# BLAS threads only contend (measured 7x slower on 2 busy cores). Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.config.cases import read_json  # noqa: E402
from k2vec.stages.golden import make_golden, open_weights, write_golden  # noqa: E402
from k2vec.pipeline.stage import fail_to_stderr, stage_logging  # noqa: E402

fail_to_stderr()  # the message names the file at fault; the traceback is in the log
with stage_logging(snakemake.log[0], "golden"):
    inp = snakemake.input
    case = {section: read_json(inp[section]) for section in ("model", "prompts", "decoding")}
    precision = snakemake.wildcards.precision
    weights = open_weights(precision, inp.fp32, inp.get("int4"))
    tensors, metadata = make_golden(case, weights, precision)
    write_golden(snakemake.output[0], tensors, metadata)
