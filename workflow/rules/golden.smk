# Golden data: the numpy reference model's greedy tokens, top-k logits, margins, per-layer
# fingerprints, router choices, recorded DDTree drafts and DDTree round traces, on exactly the
# weights an engine of that precision sees (docs/golden-format.md).


rule golden:
    input:
        unpack(golden_weights),
        model=case_section_json("model"),
        prompts=prompts_json(),
        decoding=case_section_json("decoding"),
    output:
        golden_kdtr(),
        # its sha256, checked by the bundle stage and the report
        sha256_of(golden_kdtr()),
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
