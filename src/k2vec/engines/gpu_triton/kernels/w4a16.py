"""Dense W4A16 GEMM: y[M, N] = x[M, K] @ W^T, W INT4 with group scales, read as the bundle stores it.

The kernel reads a row's packed bytes as little-endian int32 words: word i holds elements 8i .. 8i+7
(element 8i+e in bits 4e..4e+3, `docs/int4-format.md`), all in one group since G is a multiple of 8. So
instead of interleaving nibbles in registers it splits the product into 8 element planes:
y = sum_e x[:, e::8] @ W_e^T, with the word's one scale shared by all 8. Dequantization happens in
registers, in float32, right before the product; accumulation is float32.

Two tile paths, picked by BLOCK_M:
* BLOCK_M == 1 (decode): one row per program, multiply-and-add on CUDA cores; the scale is applied to
  each word's 8-element partial sum (no tensor-core padding of M to 16).
* BLOCK_M >= 16: `tl.dot` on a [BLOCK_M, BLOCK_K/8] x [BLOCK_K/8, BLOCK_N] tile per element plane, the
  dequantized weight cast to the activation dtype (float32 dots run with input_precision "ieee").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_scales(ptrs, mask, BF16_SCALES: tl.constexpr):
    """Scales at `ptrs` as float32 (0 where masked); bf16 scales arrive as int16 bits."""
    if BF16_SCALES:
        # bf16 widens exactly: float32 bits = bf16 bits << 16
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _code(words, e: tl.constexpr):
    """Code q of element e (0..7) of each little-endian int32 word as an exact float32.

    Magic-number conversion: OR-ing the nibble u into the mantissa of 2^23 gives the float 2^23 + u, and
    subtracting 2^23 + 8 leaves u - 8 = q exactly; two integer ops and one add instead of an int-to-float
    conversion, which runs at a quarter of the FMA rate and bounded the first version of this kernel.
    """
    if e == 0:
        u = words & 0xF
    else:
        u = (words >> (4 * e)) & 0xF
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K,
               G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr, SCALE_GROUPS: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[rows, :K] @ W[offs_n, :K]^T for one W4A16 weight.

    X_PLANES: x rows are stored plane-major (x[8i + e] at e * K/8 + i), so each plane's loads are
    contiguous and vectorise; otherwise they are stride-8 gathers. SCALE_GROUPS (one-row path): sum
    each group's words before scaling, loading [BLOCK_N, groups] scales instead of one per word.

    w_ptr: the packed bytes read as int32 words (row stride stride_wn words); word i of a row holds
    elements 8i .. 8i+7, element 8i+e in bits 4e..4e+3, all in group (8i) // G.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    WORDS_PER_GROUP: tl.constexpr = G // 8
    k_words = K // 8
    offs_w = tl.arange(0, WORDS)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
    if BLOCK_M == 1:
        # one row: multiply-and-add on CUDA cores, partial sums reduced once at the end
        GROUPS: tl.constexpr = WORDS // WORDS_PER_GROUP
        if SCALE_GROUPS:
            acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            i = k0 // 8 + offs_w
            i_mask = i < k_words
            mask = n_mask[:, None] & i_mask[None, :]
            words = tl.load(w_rows[:, None] + i[None, :], mask=mask, other=0)
            x_mask = row_mask[:, None] & i_mask[None, :]
            part = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
            for e in tl.static_range(8):
                if X_PLANES:
                    x_e = tl.load(x_rows[:, None] + e * k_words + i[None, :], mask=x_mask, other=0.0)
                else:
                    x_e = tl.load(x_rows[:, None] + 8 * i[None, :] + e, mask=x_mask, other=0.0)
                part += _code(words, e) * x_e.to(tl.float32)
            if SCALE_GROUPS:
                g = k0 // G + tl.arange(0, GROUPS)
                s = _load_scales(s_rows[:, None] + g[None, :], n_mask[:, None] & (g < K // G)[None, :], BF16_SCALES)
                acc += tl.sum(tl.reshape(part, [BLOCK_N, GROUPS, WORDS_PER_GROUP]), axis=2) * s
            else:
                acc += part * _load_scales(s_rows[:, None] + (i // WORDS_PER_GROUP)[None, :], mask, BF16_SCALES)
        return tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])
    else:
        # tensor cores: per element plane e, [BLOCK_M, WORDS] x [WORDS, BLOCK_N] (weight transposed by the
        # pointer arithmetic), dequantized in float32 and cast to the activation dtype just before the dot
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            i = k0 // 8 + offs_w
            i_mask = i < k_words
            mask = i_mask[:, None] & n_mask[None, :]
            words = tl.load(w_rows[None, :] + i[:, None], mask=mask, other=0)
            s = _load_scales(s_rows[None, :] + (i // WORDS_PER_GROUP)[:, None], mask, BF16_SCALES)
            x_mask = row_mask[:, None] & i_mask[None, :]
            for e in tl.static_range(8):
                if X_PLANES:
                    x_e = tl.load(x_rows[:, None] + e * k_words + i[None, :], mask=x_mask, other=0.0)
                else:
                    x_e = tl.load(x_rows[:, None] + 8 * i[None, :] + e, mask=x_mask, other=0.0)
                w_e = (_code(words, e) * s).to(x_e.dtype)
                if IEEE:
                    acc = tl.dot(x_e, w_e, acc, input_precision="ieee")
                else:
                    acc = tl.dot(x_e, w_e, acc)
        return acc


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr, SCALE_GROUPS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K,
                     G, BLOCK_M, BLOCK_N, BLOCK_K, BF16_SCALES, IEEE, X_PLANES, SCALE_GROUPS)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


# Tile configs per M bucket (upper bound of M -> launch config); the last bucket covers any larger M. Chosen by
# `bench/w4a16.py --sweep` on an H200 (bench/RESULTS.md, 2026-11-30): the one-row path up to M=4 (tensor-core tiles
# of 16 rows waste 12+ rows there), tensor cores above; plane-major x everywhere.
DENSE_CONFIGS: list[tuple[int, dict]] = [
    (1, dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=1024, X_PLANES=True, SCALE_GROUPS=True, num_warps=8, num_stages=3)),
    (4, dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, X_PLANES=True, SCALE_GROUPS=True, num_warps=4, num_stages=3)),
    (32, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)),
    (1 << 62, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)),
]


def pick_config(configs: list[tuple[int, dict]], m: int) -> dict:
    return next(cfg for bound, cfg in configs if m <= bound)


def tile_config(config: dict, group_size: int, interpret: bool) -> dict:
    """A launch config valid for `group_size`: BLOCK_K a multiple of G; tensor-core BLOCK_M at least 16."""
    cfg = {"X_PLANES": False, "SCALE_GROUPS": False, **config}
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group_size)
    if cfg["BLOCK_M"] > 1:    # tl.dot needs 16 rows and a K of 16 words (128 elements)
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], 16)
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 128)
    if interpret:    # the interpreter ignores warps and stages
        cfg.pop("num_warps", None), cfg.pop("num_stages", None)
    return cfg


def to_planes(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> plane-major rows: element 8i + e of a row at e * K/8 + i (one small copy of the activations)."""
    m, k = x.shape
    return x.view(m, k // 8, 8).transpose(1, 2).reshape(m, k)


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
    words = weight.packed.view(torch.int32)
    if cfg["X_PLANES"]:
        x = to_planes(x)
    grid = (triton.cdiv(weight.n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _w4a16_kernel[grid](x, words, scales, out, m, weight.n, weight.k,
                        x.stride(0), words.stride(0), scales.stride(0), out.stride(0),
                        G=weight.group_size, BF16_SCALES=bf16_scales, IEEE=x.dtype == torch.float32, **cfg)
    return out
