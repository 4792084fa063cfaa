# Prompts: drawn per model from the prompt settings, re-drawn where the golden would be near-tied at a
# prompt position under the fp32 or int4 weights (k2vec.prompts); both goldens of a model read them.


rule prompts:
    input:
        model="results/cases/{model}/model.json",
        settings="results/cases/{model}/prompts.json",
        fp32="results/models/{model}/fp32",
        int4="results/models/{model}/int4",
        code=sources("k2vec.prompts", "k2vec.golden", "k2vec.cases", "k2vec.stage"),
    output:
        "results/prompts/{model}.json",
    log:
        "results/logs/prompts/{model}.log",
    benchmark:
        "results/benchmarks/prompts/{model}.tsv"
    threads: 1
    conda:
        "../envs/pipeline.yaml"
    script:
        "../scripts/draw_prompts.py"
