# Config expansion: one small file per case section, so that each stage depends only on the
# sections it reads (changing the quantization scheme must not regenerate fp32 weights), and
# the fully resolved case for people and engines.


rule case_section:
    output:
        case_section_json(),
    log:
        "results/logs/cases/{model}/{section}.log",
    benchmark:
        "results/benchmarks/cases/{model}/{section}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        content=lambda wc: CASES[wc.model][wc.section],
        code=stage_code("write_json.py", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/write_json.py"


rule case:
    input:
        sections=[case_section_json(s) for s in ("model", "quantization", "prompts", "decoding")],
    output:
        case_json(),
    log:
        "results/logs/cases/{model}.log",
    benchmark:
        "results/benchmarks/cases/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        code=stage_code("merge_case.py", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/merge_case.py"
