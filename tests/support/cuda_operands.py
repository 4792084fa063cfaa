"""The CUDA W4A16 kernel's operands as its lanes read them (a model written from the kernel's own rules, not from
cuda_order_copy: see tests/test_kernels_w4a16_cuda.py's docstring), a float64 reference, NVRTC for sm_90, and a
stand-in for an activation tensor on a CUDA device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaTile, MoeLaunch


def bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def emulate(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 y [M, N] as the kernel computes it from its operand copy (codes int32 [T, KB, 32, 4], scales int32
    [T, KB, 8, 2] of bf16 pairs or float32 [T, KB, 8, 4])."""
    t_tiles, kb_steps = codes.shape[:2]
    nib = (codes.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF    # [T, KB, 32, 4, 8]
    j, r, c = np.meshgrid(np.arange(4), np.arange(16), np.arange(16), indexing="ij")
    lane = 4 * (r % 8) + (c % 8) // 2
    word = 2 * (j // 2) + r // 8
    nibble = 2 * (j % 2) + c // 8 + 4 * (c % 2)
    a = nib[:, :, lane, word, nibble].astype(np.float64) - 8                                # [T, KB, 4, 16, 16]
    jc, cc = np.arange(4)[:, None], np.arange(16)
    k_of = 32 * (jc // 2) + 8 * ((cc % 8) // 2) + 4 * (jc % 2) + 2 * (cc // 8) + cc % 2
    b = x.reshape(x.shape[0], kb_steps, 64)[:, :, k_of]                                    # [M, KB, 4, 16]
    d = np.einsum("tkjrc,mkjc->tkjrm", a, b)
    if scales.dtype == np.float32:          # [T, KB, g, (h, r)]
        per_g = scales.astype(np.float64).reshape(t_tiles, kb_steps, 8, 2, 2)
    else:                                   # bf16 pairs in int32 words
        per_g = bf16_bits_to_f64(scales.view(np.uint16).reshape(t_tiles, kb_steps, 8, 2, 2))
    s = per_g.transpose(0, 1, 3, 4, 2).reshape(t_tiles, kb_steps, 2, 16)                    # [T, KB, h, row]
    y = np.einsum("tkjrm,tkjr->mtr", d, s[:, :, np.arange(4) // 2, :])
    return y.reshape(x.shape[0], t_tiles * 16)


def reference(x: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """scales: bf16 bits (uint16) or float32."""
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float64) - 8
    s = np.repeat(scales.astype(np.float64) if scales.dtype == np.float32 else bf16_bits_to_f64(scales), 32, axis=1)
    return x @ (q * s).T


def nvrtc_available() -> bool:
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaKernelError, _nvrtc
    try:
        _nvrtc()
        return True
    except CudaKernelError:
        return False


needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="no NVRTC: the [test] extra installs "
                                                               "nvidia-cuda-nvrtc-cu12")


def compile_for_sm90(tile: CudaTile, k: int, m: int, float32_scales: bool, moe: MoeLaunch | None = None):
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import kernel_source, nvrtc_compile, target
    defines = tuple(tile.defines(k, m, float32_scales, moe).items())
    return nvrtc_compile(kernel_source(defines), target(defines, 9, 0), ("--ptxas-options=-v",))


@dataclass
class FakeX:
    """What the CUDA kernels' dispatch (w4a16.cuda_tile, fused_moe.moe_cuda_tiles) reads of an activation tensor,
    on a pretended CUDA device."""
    rows: int
    dtype: torch.dtype = torch.bfloat16
    ptr: int = 1 << 20
    is_cuda: bool = True

    @property
    def shape(self):
        return (self.rows, 7168)

    @property
    def device(self):
        return torch.device("cuda", 0)

    def data_ptr(self):
        return self.ptr
