"""Dense W4A16 GEMM: y[M, N] = x[M, K] @ W^T, W INT4 with group scales, read as the bundle stores it.

The packed byte j of a row holds elements 2j (low nibble) and 2j+1 (high nibble); both lie in group
(2j) // G because G is even. So instead of interleaving nibbles in registers the kernel splits the
product: y = x[:, 0::2] @ W_low^T + x[:, 1::2] @ W_high^T, with the scale of byte j shared by both.
Dequantization happens in registers, in float32, right before the product; accumulation is float32.

Two tile paths, picked by BLOCK_M:
* BLOCK_M == 1 (decode, M small): one row per program, multiply-and-reduce on CUDA cores; the group
  scale is applied to each group's partial sum (fewer multiplies, no tensor-core padding of M to 16).
* BLOCK_M >= 16: `tl.dot` on a [BLOCK_M, BLOCK_K/2] x [BLOCK_K/2, BLOCK_N] tile per nibble plane, the
  dequantized weight cast to the activation dtype (float32 dots run with input_precision "ieee").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .int4_layout import PackedInt4

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_scales(s_ptr, offs_n, n_mask, stride_sn, g0, n_groups,
                 GROUPS: tl.constexpr, BF16_SCALES: tl.constexpr):
    """Scales [BLOCK_N, GROUPS] of groups g0 .. g0 + GROUPS - 1 as float32 (0 where masked)."""
    offs_g = g0 + tl.arange(0, GROUPS)
    ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :]
    mask = n_mask[:, None] & (offs_g[None, :] < n_groups)
    if BF16_SCALES:
        # bf16 bits (stored as int16) widen exactly: float32 bits = bf16 bits << 16
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K,
               G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BF16_SCALES: tl.constexpr, IEEE: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[rows, :K] @ W[offs_n, :K]^T for one W4A16 weight (w_ptr/s_ptr at row 0)."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // G
    HALF_G: tl.constexpr = G // 2
    n_groups = K // G
    half_k = K // 2
    offs_j = tl.arange(0, HALF_K)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + offs_j
            j_mask = j < half_k
            x_even = tl.load(x_rows[:, None] + 2 * j[None, :], mask=row_mask[:, None] & j_mask[None, :], other=0.0)
            x_odd = tl.load(x_rows[:, None] + 2 * j[None, :] + 1, mask=row_mask[:, None] & j_mask[None, :], other=0.0)
            b = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + j[None, :],
                        mask=n_mask[:, None] & j_mask[None, :], other=0x88)
            q_low = ((b & 0xF).to(tl.int32) - 8).to(tl.float32)
            q_high = ((b >> 4).to(tl.int32) - 8).to(tl.float32)
            part = q_low * x_even.to(tl.float32) + q_high * x_odd.to(tl.float32)    # [BLOCK_N, HALF_K]
            part = tl.sum(tl.reshape(part, [BLOCK_N, GROUPS, HALF_G]), axis=2)       # per-group partial sums
            s = _load_scales(s_ptr, offs_n, n_mask, stride_sn, k0 // G, n_groups, GROUPS, BF16_SCALES)
            acc += tl.sum(part * s, axis=1)
        return tl.reshape(acc, [1, BLOCK_N])
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + offs_j
            j_mask = j < half_k
            x_mask = row_mask[:, None] & j_mask[None, :]
            x_even = tl.load(x_rows[:, None] + 2 * j[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows[:, None] + 2 * j[None, :] + 1, mask=x_mask, other=0.0)
            # weight tile transposed in the pointer arithmetic: [HALF_K, BLOCK_N]
            b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + j[:, None],
                        mask=n_mask[None, :] & j_mask[:, None], other=0x88)
            s = tl.trans(_load_scales(s_ptr, offs_n, n_mask, stride_sn, k0 // G, n_groups, GROUPS, BF16_SCALES))
            s = tl.reshape(s, [GROUPS, 1, BLOCK_N])
            w_low = tl.reshape(tl.reshape(((b & 0xF).to(tl.int32) - 8).to(tl.float32), [GROUPS, HALF_G, BLOCK_N]) * s,
                               [HALF_K, BLOCK_N]).to(x_even.dtype)
            w_high = tl.reshape(tl.reshape(((b >> 4).to(tl.int32) - 8).to(tl.float32), [GROUPS, HALF_G, BLOCK_N]) * s,
                                [HALF_K, BLOCK_N]).to(x_even.dtype)
            if IEEE:
                acc = tl.dot(x_even, w_low, acc, input_precision="ieee")
                acc = tl.dot(x_odd, w_high, acc, input_precision="ieee")
            else:
                acc = tl.dot(x_even, w_low, acc)
                acc = tl.dot(x_odd, w_high, acc)
        return acc


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BF16_SCALES: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K,
                     G, BLOCK_M, BLOCK_N, BLOCK_K, BF16_SCALES, IEEE)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# Tile sizes per M bucket (upper bound of M -> BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); the last
# bucket covers any larger M. Tuned on the H200 by bench/w4a16.py (bench/RESULTS.md).
DENSE_CONFIGS: list[tuple[int, dict]] = [
    (1, dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4)),
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (32, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (1 << 62, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
]


def pick_config(configs: list[tuple[int, dict]], m: int) -> dict:
    return next(cfg for bound, cfg in configs if m <= bound)


def tile_config(config: dict, group_size: int, interpret: bool) -> dict:
    """A launch config valid for `group_size`: BLOCK_K a multiple of G; tensor-core BLOCK_M at least 16."""
    cfg = dict(config)
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group_size)
    if cfg["BLOCK_M"] > 1:
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], 16)
    if interpret:    # the interpreter ignores warps and stages
        cfg.pop("num_warps", None), cfg.pop("num_stages", None)
    return cfg


def check_activation(x: torch.Tensor, k: int, what: str) -> None:
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{what}: activations must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: expected x of shape [M, {k}], got {tuple(x.shape)}")


def interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def w4a16_linear(x: torch.Tensor, weight: PackedInt4, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T in x.dtype, float32 accumulation. `out` (optional) is written in place."""
    check_activation(x, weight.k, "w4a16_linear")
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, weight.n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, weight.n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"w4a16_linear: out must be contiguous {x.dtype} [{m}, {weight.n}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if m == 0:
        return out
    cfg = tile_config(config or pick_config(DENSE_CONFIGS, m), weight.group_size, interpreting())
    bf16_scales = weight.scales.dtype == torch.bfloat16
    scales = weight.scales.view(torch.int16) if bf16_scales else weight.scales
    grid = (triton.cdiv(weight.n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _w4a16_kernel[grid](x, weight.packed, scales, out, m, weight.n, weight.k,
                        x.stride(0), weight.packed.stride(0), scales.stride(0), out.stride(0),
                        G=weight.group_size, BF16_SCALES=bf16_scales, IEEE=x.dtype == torch.float32, **cfg)
    return out
