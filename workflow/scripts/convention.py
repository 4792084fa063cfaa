"""The golden of one convention variant of the reference, for one (model, precision)."""
import os

# One BLAS thread per job, as the golden stage (workflow/scripts/golden.py says why). Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.config.cases import read_json  # noqa: E402
from k2vec.pipeline.stage import fail_to_stderr, stage_logging  # noqa: E402
from k2vec.stages.convention import make_variant  # noqa: E402
from k2vec.stages.golden import open_weights, write_golden  # noqa: E402

fail_to_stderr()
with stage_logging(snakemake.log[0], "convention"):
    inp = snakemake.input
    case = {section: read_json(inp[section]) for section in ("model", "prompts", "decoding")}
    precision = snakemake.wildcards.precision
    weights = open_weights(precision, inp.fp32, inp.get("int4"))
    tensors, metadata = make_variant(case, weights, precision, inp.golden,
                                     snakemake.wildcards.convention.split("+"))
    write_golden(snakemake.output[0], tensors, metadata)
