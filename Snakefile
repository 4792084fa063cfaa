# k2vec: config expansion -> synthetic fp32 weights -> INT4 -> golden -> KDTR bundles -> engine runs -> report.
# Stages live in workflow/rules/<stage>.smk; their logic in the k2vec package under src/.
from snakemake.utils import min_version

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/cases.smk"
include: "workflow/rules/weights.smk"


rule all:
    default_target: True
    input:
        expand("results/cases/{model}.json", model=MODELS),
        expand("results/models/{model}/fp32", model=MODELS),
