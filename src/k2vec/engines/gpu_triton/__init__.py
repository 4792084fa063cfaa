"""GPU engine: PyTorch with Triton W4A16 kernels (dense and fused MoE)."""
