# Config expansion: one small file per case section, so that each stage depends only on the
# sections it reads (changing the quantization scheme must not regenerate fp32 weights), and
# the fully resolved case for people and engines.


rule case_section:
    input:
        code=sources("k2vec.cases", "k2vec.stage"),
    output:
        "results/cases/{model}/{section}.json",
    params:
        content=lambda wc: CASES[wc.model][wc.section],
    log:
        "results/logs/cases/{model}/{section}.log",
    benchmark:
        "results/benchmarks/cases/{model}/{section}.tsv"
    conda:
        "../envs/pipeline.yaml"
    script:
        "../scripts/write_json.py"


rule case:
    input:
        sections=expand(
            "results/cases/{{model}}/{section}.json",
            section=["model", "quantization", "prompts", "decoding"],
        ),
        code=sources("k2vec.cases", "k2vec.stage"),
    output:
        "results/cases/{model}.json",
    log:
        "results/logs/cases/{model}.log",
    benchmark:
        "results/benchmarks/cases/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    script:
        "../scripts/merge_case.py"
