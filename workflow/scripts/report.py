"""Build the divergence report from every engine result and the golden data."""
from k2vec.report import snakemake_main

snakemake_main(snakemake)
