"""GPU engine: PyTorch with Triton W4A16 kernels (docs/gpu-engine.md).
Run it as `python -m k2vec.engines.gpu_triton`."""
