# KDTR bundles: one self-contained file per (model, precision): weights as the engine sees them
# (fp32, or packed INT4 + scales + the unquantized fp32 tensors), prompts and golden data.


rule bundle:
    input:
        unpack(bundle_inputs),
        model=case_section_json("model"),
        decoding=case_section_json("decoding"),
        golden_sha256=sha256_of(golden_kdtr()),
    output:
        bundle_kdtr(),
        # its sha256, checked by the engine runner and the report
        sha256_of(bundle_kdtr()),
    log:
        "results/logs/bundle/{model}-{precision}.log",
    benchmark:
        "results/benchmarks/bundle/{model}-{precision}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        # per precision: the fp32 bundle does not run the quantizer
        code=precision_code("bundle.py", "k2vec.stages.bundle", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/bundle.py"
