"""Load-time placement of a bundle's `<name>.qw` / `<name>.sc` pair on the GPU.

No repacking: the kernels read the packed bytes exactly as `docs/int4-format.md` stores them
(uint8 [N, K/2], element 2j in the low nibble, 2j+1 in the high nibble, q + 8) and the scales
row-major [N, K/G]. bfloat16 scales (uint16 bits in the bundle) become a torch.bfloat16 tensor by a
free reinterpretation of the same bits; float32 scales stay float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PackedInt4:
    """One W4A16 weight W [n, k]: W[r, c] = (nibble(packed[r, c // 2]) - 8) * scales[r, c // group_size]."""
    packed: torch.Tensor   # uint8 [n, k // 2]
    scales: torch.Tensor   # float32 | bfloat16 [n, k // group_size]
    n: int
    k: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k]; exact (q * scale is one float32 product). For references and tests, not the hot path."""
        low = (self.packed & 0x0F).to(torch.int8) - 8
        high = (self.packed >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=-1).reshape(self.n, self.k).to(torch.float32)
        groups = codes.reshape(self.n, self.k // self.group_size, self.group_size)
        return (groups * self.scales.to(torch.float32)[:, :, None]).reshape(self.n, self.k)


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


def pack_for_gpu(qw, sc, group_size: int, scale_dtype: str, device, name: str = "weight") -> PackedInt4:
    """Place one bundle weight on `device`, verifying the shapes the kernels rely on."""
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
    return PackedInt4(packed.to(device).contiguous(), scales.to(device).contiguous(), n, k, group_size)
