"""The int4 golden model forced on the fp32 golden sequence, as a score-mode result."""
import os

# one BLAS thread per job, as the golden stage (set before numpy loads)
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(snakemake.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(snakemake.threads))

from k2vec.config.cases import read_json  # noqa: E402
from k2vec.stages.format_effect import format_effect_result, write_format_effect  # noqa: E402
from k2vec.stages.golden import open_weights  # noqa: E402
from k2vec.pipeline.stage import fail_to_stderr, stage_logging  # noqa: E402

fail_to_stderr()
with stage_logging(snakemake.log[0], "format_effect") as log:
    inp = snakemake.input
    result = format_effect_result(read_json(inp.model), open_weights("int4", inp.fp32, inp.int4), inp.golden)
    write_format_effect(snakemake.output[0], result)
    log.info("%s: int4 model forced on the fp32 golden, %d prompts", result["model"], len(result["runs"][0]["prompts"]))
