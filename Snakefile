# k2vec: config expansion -> synthetic fp32 weights -> INT4 -> golden -> KDTR bundles -> engine runs -> report.
# Stages live in workflow/rules/<stage>.smk; their logic in the k2vec package under src/.
from snakemake.utils import min_version

min_version("9.0")


include: "workflow/rules/config.smk"  # configfile: config.yaml, after a strict read of every config file


include: "workflow/rules/common.smk"
include: "workflow/rules/cases.smk"
include: "workflow/rules/weights.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/golden.smk"
include: "workflow/rules/bundles.smk"
include: "workflow/rules/engines.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        expand("results/cases/{model}.json", model=MODELS),
        expand("results/models/{model}/int4", model=MODELS),
        expand("results/models/{model}/compressed-tensors", model=MODELS),
        expand("results/bundles/{model}-{precision}.kdtr", model=MODELS, precision=PRECISIONS),
        "results/report/divergence.html",
        "results/report/strict.ok" if config["report"]["strict"] else [],


onsuccess:
    summary = "results/report/summary.txt"
    if os.path.exists(summary):
        print(open(summary).read())
