"""The noise model of one golden for one reduced precision class."""
import os

# One BLAS thread per job, as the golden stage (workflow/scripts/golden.py says why). Set before numpy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.config.cases import read_json  # noqa: E402
from k2vec.pipeline.stage import fail_to_stderr, stage_logging  # noqa: E402
from k2vec.stages.golden import open_weights  # noqa: E402
from k2vec.stages.noise import golden_inputs, make_noise, write_noise  # noqa: E402

fail_to_stderr()
with stage_logging(snakemake.log[0], "noise"):
    inp = snakemake.input
    weights = open_weights(snakemake.wildcards.precision, inp.fp32, inp.get("int4"))
    tensors, metadata = make_noise(read_json(inp.model), weights, golden_inputs(inp.golden),
                                   snakemake.wildcards.precision_class)
    write_noise(snakemake.output[0], tensors, metadata)
