"""The quantized model as a compressed-tensors pack-quantized HF checkpoint."""
from k2vec.stages.export_compressed_tensors import export_compressed_tensors
from k2vec.pipeline.stage import stage_logging

with stage_logging(snakemake.log[0], "export_compressed_tensors") as log:
    config = export_compressed_tensors(snakemake.input.fp32, snakemake.input.int4, snakemake.output[0])
    log.info("wrote %s (quantization_config: %s)", snakemake.output[0], config["quantization_config"]["format"])
