# Import of a checkpoint slice (docs/checkpoint-import.md): for a model entry with `checkpoint:`, the
# fp32 and int4 weights come from the user's compressed-tensors checkpoint instead of the weights
# and quantize stages (the INT4 codes and scales copied, never re-quantized).


rule import_checkpoint:
    input:
        model=case_section_json("model"),
        quantization=case_section_json("quantization"),
        source=import_sources,
    output:
        fp32=directory(weights_dir("fp32")),
        int4=directory(weights_dir("int4")),
    log:
        "results/logs/import_checkpoint/{model}.log",
    benchmark:
        "results/benchmarks/import_checkpoint/{model}.tsv"
    wildcard_constraints:
        model="|".join(IMPORTED_MODELS) or "^$",
    conda:
        "../envs/pipeline.yaml"
    params:
        code=stage_code(
            "import_checkpoint.py", "k2vec.stages.import_checkpoint", "k2vec.config.cases", "k2vec.pipeline.stage"
        ),
    script:
        "../scripts/import_checkpoint.py"


# An imported model's weights come from here only (the weights and quantize rules could also make them).
ruleorder: import_checkpoint > weights
ruleorder: import_checkpoint > quantize
