# INT4 W4A16 quantization (docs/int4-format.md): .qw/.sc per quantized weight, and the same model
# exported in compressed-tensors' pack-quantized layout for vLLM / SGLang.


rule quantize:
    input:
        fp32=weights_dir("fp32"),
        quantization=case_section_json("quantization"),
    output:
        directory(weights_dir("int4")),
    log:
        "results/logs/quantize/{model}.log",
    benchmark:
        "results/benchmarks/quantize/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        code=stage_code("quantize.py", "k2vec.model.int4_checkpoint", "k2vec.config.cases", "k2vec.pipeline.stage"),
    script:
        "../scripts/quantize.py"


rule export_compressed_tensors:
    input:
        fp32=weights_dir("fp32"),
        int4=weights_dir("int4"),
    output:
        directory(compressed_tensors_dir()),
    log:
        "results/logs/export_compressed_tensors/{model}.log",
    benchmark:
        "results/benchmarks/export_compressed_tensors/{model}.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        code=stage_code("export_compressed_tensors.py", "k2vec.model.int4_checkpoint", "k2vec.pipeline.stage"),
    script:
        "../scripts/export_compressed_tensors.py"
