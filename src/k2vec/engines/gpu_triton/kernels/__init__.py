"""Triton W4A16 kernels: dense GEMM and fused MoE over the bundle's packed INT4 layout."""
from k2vec.engines.gpu_triton.kernels.fused_moe import PackedExperts, fused_moe, pack_experts
from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4, pack_for_gpu
from k2vec.engines.gpu_triton.kernels.w4a16 import w4a16_linear

__all__ = ["PackedExperts", "PackedInt4", "fused_moe", "pack_experts", "pack_for_gpu", "w4a16_linear"]
