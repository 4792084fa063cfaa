"""Load-time placement of a bundle's `<name>.qw` / `<name>.sc` pair on the GPU.

The kernels read the packed bytes exactly as `docs/int4-format.md` stores them (uint8 [N, K/2], element 2j
in the low nibble, 2j+1 in the high nibble, q + 8) and the scales row-major [N, K/G]. bfloat16 scales
(uint16 bits in the bundle) become a torch.bfloat16 tensor by a free reinterpretation of the same bits;
float32 scales stay float32. Load-time copies besides: the codes and scales of dense weights in the MMA order,
K-block-major (mma_order_copy), which the tensor-core tiles of several rows read, and, for bf16 activations, in the
CUDA kernel's operand order (w4a16_cuda.cuda_order_copy).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaOrder, cuda_order_copy, supported

SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class MmaOrder:
    """A dense weight's load-time copy for the MMA_ORDER tiles, K-block-major: block kb of every row together, so
    that a tile's K step reads one contiguous stretch (64 rows x 64 bytes of codes: 4 KB) rather than 64 bytes
    from each of 64 rows a row's length apart (bench/RESULTS.md, issue 27, session 21: 5-20% faster at M = 2-64)."""
    words: torch.Tensor    # int32 [ceil(k / 128), n, 16]: mma_order_words
    scales: torch.Tensor   # the scale dtype, [ceil(k / 128), n, 128 // group_size]: mma_order_scales


@dataclass(frozen=True)
class PackedInt4:
    """One W4A16 weight W [n, k]: W[r, c] = (nibble(packed[r, c // 2]) - 8) * scales[r, c // group_size]."""
    packed: torch.Tensor   # uint8 [n, k // 2]
    scales: torch.Tensor   # float32 | bfloat16 [n, k // group_size]
    n: int
    k: int
    group_size: int
    mma: MmaOrder | None = None         # the same codes and scales in the MMA order, K-block-major
    cuda: CudaOrder | None = None       # and in the CUDA kernel's operand order (w4a16_cuda.cuda_order_copy)

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k]; exact (q * scale is one float32 product). For references and tests, not the hot path."""
        low = (self.packed & 0x0F).to(torch.int8) - 8
        high = (self.packed >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=-1).reshape(self.n, self.k).to(torch.float32)
        groups = codes.reshape(self.n, self.k // self.group_size, self.group_size)
        return (groups * self.scales.to(torch.float32)[:, :, None]).reshape(self.n, self.k)

    def recopied(self) -> PackedInt4:
        """The same weight with its load-time copies made again from `packed` and `scales` (after a test changed
        those bytes in place, as a corrupt bundle would reach the loader); only the copies it already had."""
        mma = mma_order_copy(self.packed, self.scales, self.k, self.group_size) if self.mma else None
        return replace(self, mma=mma, cuda=cuda_order_copy(self.packed, self.scales, self.k) if self.cuda else None)


MMA_BLOCK = 128     # K elements per block of the MMA order


def mma_order_words(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The codes of uint8 [n, k/2] in the MMA order: int32 words [kb, n, 16], kb = ceil(k / 128) blocks of 128
    elements, block-major (word w of block b of row r at [b, r, w]; a partial last block padded with code 8, q = 0,
    whose scales mma_order_scales makes 0).

    Word 4c + j of a block holds, in its bits 4e .. 4e + 3 (e = e0 + 2 e1 + 4 e2), the code of block element
    32j + 16 e1 + 8 e0 + 2c + e2: the elements that thread c of a tensor-core MMA quad holds for two 16-wide K steps
    of one row, each word within one group of 32, nibbles e and e + 4 K-adjacent (mma._mma_order_tile).
    """
    n = packed.shape[0]
    blocks = -(-k // MMA_BLOCK)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)
    if blocks * MMA_BLOCK != k:
        codes = torch.nn.functional.pad(codes, (0, blocks * MMA_BLOCK - k), value=8)
    # [n, block, j, e1, e0, c, e2] in K's order -> [n, block, c, j, e2, e1, e0]: word 4c + j, nibble e
    codes = codes.reshape(n, blocks, 4, 2, 2, 4, 2).permute(0, 1, 5, 2, 6, 3, 4).reshape(n, blocks * 16, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    words = (codes.to(torch.int64) << shifts).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.view(n, blocks, 16).transpose(0, 1).contiguous()


def mma_order_scales(scales: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """Scales [n, k / G] block-major as mma_order_words: [kb, n, 128 / G], a partial last block's missing groups 0."""
    n, per_block = scales.shape[0], MMA_BLOCK // group_size
    blocks = -(-k // MMA_BLOCK)
    padded = torch.nn.functional.pad(scales, (0, blocks * per_block - scales.shape[1]))
    return padded.view(n, blocks, per_block).transpose(0, 1).contiguous()


def mma_order_copy(packed: torch.Tensor, scales: torch.Tensor, k: int, group_size: int) -> MmaOrder:
    return MmaOrder(mma_order_words(packed, k), mma_order_scales(scales, k, group_size))


def _as_tensor(array) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    array = np.ascontiguousarray(array)
    if array.dtype == np.uint16:    # bf16 bits: torch has few uint16 ops, int16 holds the same bits
        array = array.view(np.int16)
    return torch.from_numpy(array)


def scales_tensor(sc, scale_dtype: str, name: str = "scales") -> torch.Tensor:
    """Bundle scales (float32, or bf16 as uint16/int16 bits or torch.bfloat16) -> float32 | bfloat16 tensor."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"{name}: scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
    sc = _as_tensor(sc)
    if scale_dtype == "float32":
        if sc.dtype != torch.float32:
            raise ValueError(f"{name}: float32 scales expected, got {sc.dtype}")
        return sc
    if sc.dtype in (torch.int16, torch.uint16):
        return sc.view(torch.int16).view(torch.bfloat16)
    if sc.dtype != torch.bfloat16:
        raise ValueError(f"{name}: bfloat16 scales must be uint16 bits or torch.bfloat16, got {sc.dtype}")
    return sc


def pack_for_gpu(qw, sc, group_size: int, scale_dtype: str, device, name: str = "weight",
                 mma_order: bool = True, cuda_order: bool = False) -> PackedInt4:
    """Place one bundle weight on `device`, verifying the shapes the kernels rely on; mma_order: with the MMA-order
    copy of codes and scales (as many bytes again) for the dense tensor-core tiles; cuda_order: with the CUDA
    kernel's copy (as many bytes again) where its format allows (w4a16_cuda.supported), for bf16 activations."""
    if group_size not in (32, 64, 128):
        raise ValueError(f"{name}: group_size must be 32, 64 or 128, got {group_size}")
    packed = _as_tensor(qw)
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"{name}.qw: expected uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % group_size:
        raise ValueError(f"{name}.qw: K={k} is not a multiple of group_size {group_size}")
    scales = scales_tensor(sc, scale_dtype, f"{name}.sc")
    if tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"{name}.sc: expected shape {(n, k // group_size)} for .qw {tuple(packed.shape)} "
                         f"and group_size {group_size}, got {tuple(scales.shape)}")
    packed = packed.to(device).contiguous()
    scales = scales.to(device).contiguous()
    return PackedInt4(packed, scales, n, k, group_size,
                      mma_order_copy(packed, scales, k, group_size) if mma_order else None,
                      cuda_order_copy(packed, scales, k) if cuda_order and supported(n, k, group_size, scales.dtype)
                      else None)
