"""Build the divergence report from every engine result and the golden data."""
from pathlib import Path

from k2vec.report import write_report
from k2vec.pipeline.stage import fail_to_stderr, stage_logging

fail_to_stderr()  # a damaged golden is named in the message; the traceback is in the log
p = snakemake.params
with stage_logging(snakemake.log[0], "report"):
    # every output is written next to divergence.html (k2vec.report.OUTPUTS)
    write_report(p.runs, p.goldens, Path(snakemake.output.html).parent, near_tie=p.near_tie,
                 router_near_tie=p.router_near_tie, fingerprint_rtol=p.fingerprint_rtol, budgets=p.budgets,
                 noise=p.noise, conventions=p.conventions, noise_rule=p.noise_rule, left_out=p.left_out,
                 fail_on_left_out=p.fail_on_left_out, integrity_key=p.integrity_key, cache=p.cache,
                 mutation_resolution=p.mutation_resolution, float32_engines=p.float32_engines)
