# Convention variants (k2vec.stages.convention): per golden, the golden of the reference with a named
# convention's settings (k2vec.model.conventions, e.g. the latent norms' epsilon = rms_norm_eps, as vLLM computes
# it), for each convention an engine declares, and each known one where an engine declares none: the report
# names an engine that matches a variant where it fails the golden (docs/report.md "Conventions").


rule convention:
    input:
        unpack(golden_weights),
        model=case_section_json("model"),
        prompts=prompts_json(),
        decoding=case_section_json("decoding"),
        golden=golden_kdtr(),
        golden_sha256=sha256_of(golden_kdtr()),
    output:
        convention_kdtr(),
        sha256_of(convention_kdtr()),
    log:
        "results/logs/conventions/{model}/{precision}-{convention}.log",
    benchmark:
        "results/benchmarks/conventions/{model}/{precision}-{convention}.tsv"
    conda:
        "../envs/pipeline.yaml"
    threads: 1
    params:
        code=precision_code("convention.py", "k2vec.stages.convention", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/convention.py"
