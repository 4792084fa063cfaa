"""Judge the mutation run beside the unmutated engine and write the mutation score (rule mutation_report)."""
from k2vec.report.mutation import snakemake_main
from k2vec.stage import fail_to_stderr

fail_to_stderr()
snakemake_main(snakemake)
