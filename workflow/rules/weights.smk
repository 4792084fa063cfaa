# Synthetic fp32 weights: an HF DeepseekV3 checkpoint per model (docs in k2vec/stages/weights.py).


rule weights:
    input:
        model=case_section_json("model"),
    output:
        directory(weights_dir("fp32")),
    log:
        "results/logs/weights/{model}.log",
    benchmark:
        "results/benchmarks/weights/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        code=stage_code("make_weights.py", "k2vec.stages.weights", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/make_weights.py"
