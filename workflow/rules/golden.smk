# Golden data: the numpy reference model's greedy tokens, top-k logits, margins, per-layer
# fingerprints, router choices, recorded DDTree drafts and DDTree round traces, on exactly the
# weights an engine of that precision sees (docs/golden-format.md).


rule golden:
    input:
        unpack(golden_weights),
        model="results/cases/{model}/model.json",
        prompts="results/prompts/{model}-{precision}.json",
        decoding="results/cases/{model}/decoding.json",
    output:
        "results/golden/{model}/{precision}.kdtr",
        # its sha256, checked by the bundle stage and the report
        "results/golden/{model}/{precision}.kdtr.sha256",
    log:
        "results/logs/golden/{model}/{precision}.log",
    benchmark:
        "results/benchmarks/golden/{model}/{precision}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    params:
        # per precision: the fp32 golden does not run the quantizer
        code=precision_code("golden.py", "k2vec.stages.golden", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/golden.py"
