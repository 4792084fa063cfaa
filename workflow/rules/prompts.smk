# Prompts: drawn per model and precision from the prompt settings, re-drawn where the golden would be
# near-tied at a prompt position (k2vec.stages.prompts). The fp32 prompts read the fp32 weights only; the
# int4 prompts start from the fp32 ones and re-draw only those blind under the int4 weights, so a
# quantizer edit never reaches the fp32 golden.


rule prompts:
    input:
        unpack(prompts_inputs),
        model=case_section_json("model"),
        settings=case_section_json("prompts"),
    output:
        prompts_json(),
    log:
        "results/logs/prompts/{model}-{precision}.log",
    benchmark:
        "results/benchmarks/prompts/{model}-{precision}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    params:
        # per precision: the fp32 prompts do not run the quantizer
        code=precision_code(
            "draw_prompts.py",
            "k2vec.stages.prompts",
            "k2vec.stages.golden",
            "k2vec.config.cases",
            "k2vec.pipeline.stage",
        ),
    script:
        "../scripts/draw_prompts.py"
