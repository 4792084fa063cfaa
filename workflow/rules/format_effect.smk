# The format-effect run: the int4 golden model forced on the fp32 golden sequence (score mode),
# written as an engine result and judged by the report against the fp32 golden as the engine
# `int4-format` (k2vec.stages.format_effect).


rule format_effect:
    input:
        fp32=weights_dir("fp32"),
        int4=weights_dir("int4"),
        model=case_section_json("model"),
        golden=golden_kdtr("fp32"),
        golden_sha256=sha256_of(golden_kdtr("fp32")),
    output:
        format_effect_json(),
        # its sha256, checked by the report as a run result's
        sha256_of(format_effect_json()),
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
