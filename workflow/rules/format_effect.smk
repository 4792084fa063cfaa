# The format-effect run: the int4 golden model forced on the fp32 golden sequence (score mode),
# written as an engine result and judged by the report against the fp32 golden as the engine
# `int4-format` (k2vec.stages.format_effect).


rule format_effect:
    input:
        fp32="results/models/{model}/fp32",
        int4="results/models/{model}/int4",
        model="results/cases/{model}/model.json",
        golden="results/golden/{model}/fp32.kdtr",
        golden_sha256="results/golden/{model}/fp32.kdtr.sha256",
    output:
        "results/format-effect/{model}.json",
        # its sha256, checked by the report as a run result's
        "results/format-effect/{model}.json.sha256",
    log:
        "results/logs/format-effect/{model}.log",
    benchmark:
        "results/benchmarks/format-effect/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    params:
        code=stage_code("format_effect.py", "k2vec.stages.format_effect", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/format_effect.py"
