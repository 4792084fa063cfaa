"""Judge the mutation run beside the unmutated engine and write the mutation score (rule mutation_report)."""
from k2vec.mutation.score import snakemake_main
from k2vec.pipeline.stage import fail_to_stderr

fail_to_stderr()
snakemake_main(snakemake)
