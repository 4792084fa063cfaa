# The noise model (k2vec.stages.noise): per golden and reduced precision that some engine declares,
# the reference under emulated rounding schedules, so the report judges such an engine by what correct
# engines of its precision show on the same case, not by its own errors (docs/report.md "Noise model").


rule noise:
    input:
        unpack(golden_weights),
        model=case_section_json("model"),
        golden=golden_kdtr(),
        golden_sha256=sha256_of(golden_kdtr()),
    output:
        noise_kdtr(),
        sha256_of(noise_kdtr()),
    log:
        "results/logs/noise/{model}/{precision}-{precision_class}.log",
    benchmark:
        "results/benchmarks/noise/{model}/{precision}-{precision_class}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    params:
        code=precision_code("noise.py", "k2vec.stages.noise", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/noise.py"
