"""Judge the mutation run beside the unmutated engine and write the mutation score (rule mutation_report)."""
from pathlib import Path

from k2vec.mutation.score import write_mutation_report
from k2vec.pipeline.stage import fail_to_stderr, stage_logging

fail_to_stderr()
p = snakemake.params
with stage_logging(snakemake.log[0], "mutation_report"):
    write_mutation_report(p.runs, p.goldens, Path(snakemake.output.html).parent, p.mutants, p.controls,
                          near_tie=p.near_tie, router_near_tie=p.router_near_tie,
                          fingerprint_rtol=p.fingerprint_rtol, budgets=p.budgets, noise=p.noise,
                          noise_rule=p.noise_rule)
