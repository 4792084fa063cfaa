"""Build the divergence report from every engine result and the golden data."""
from k2vec.report import snakemake_main
from k2vec.pipeline.stage import fail_to_stderr

fail_to_stderr()  # a damaged golden is named in the message; the traceback is in the log
snakemake_main(snakemake)
