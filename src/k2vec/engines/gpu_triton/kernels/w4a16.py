"""Dense W4A16 GEMM: y[M, N] = x[M, K] @ W^T, W INT4 with group scales, read as the bundle stores it or (MMA_ORDER)
from the load-time copy of its codes in the MMA's register order (int4_layout.mma_order_words). Accumulation is
float32.

One kernel (_w4a16_kernel), its tile path picked by the launch config (configs.py; docs/w4a16-kernels.md), or, where
the config names a CUDA tile and the call is bf16 x on group-32 codes, the CUDA kernel (w4a16_cuda.cu):
* PREFETCH (BLOCK_M 1): the one-row GEMV on CUDA cores, the next K tile prefetched (gemv.py).
* MMA_ORDER (BLOCK_M >= 16): tensor cores on the MMA-order words (mma.py).
* Otherwise (float32 x; the fused MoE's tensor-core tiles) the element planes, in this module: since a word's 8
  elements share one scale (dequant.py), the product splits into 8 planes, y = sum_e x[:, e::8] @ W_e^T; BLOCK_M 1
  multiplies and adds on CUDA cores with the scale applied to each word's (or group's) partial sum, BLOCK_M >= 16
  runs `tl.dot` per plane on the weight dequantised in registers (float32 dots with input_precision "ieee").
Split-K and PDL: sync.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.configs import (dense_configs, has_pdl, launch_keys, pick_config, split_k,
                                                    tile_config)
from k2vec.engines.gpu_triton.kernels.dequant import _bf16_planes, _code, _load_scales, _per_word
from k2vec.engines.gpu_triton.kernels.gemv import _gemv_tile, _split8
from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4
from k2vec.engines.gpu_triton.kernels.mma import _dot, _mma_order_tile
from k2vec.engines.gpu_triton.kernels.sync import (_grid_wait, _k_range, _split_arrive, _split_is_last,
                                                   _split_reduce_kernel, _split_sum, split_buffers)
from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaTile, fit_tile, runs_on, w4a16_cuda_launch

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _x_plane(x_rows, e: tl.constexpr, i, k_words, x_mask, X_PLANES: tl.constexpr):
    """Activations of element plane e at words i ([rows, words]); plane-major rows load contiguously."""
    if X_PLANES:
        return tl.load(x_rows[:, None] + e * k_words + i[None, :], mask=x_mask, other=0.0)
    else:
        return tl.load(x_rows[:, None] + 8 * i[None, :] + e, mask=x_mask, other=0.0)


@triton.jit
def _x_wide(x_rows, i, x_mask):
    """X_WIDE: x in its natural order, the 8 elements of each word i as one 16-byte load (bf16/fp16), split into
    the 8 element planes in registers ([rows, words] each). No plane-major copy of x."""
    v = tl.load(x_rows[:, None, None] + 8 * i[None, :, None] + tl.arange(0, 8)[None, None, :], mask=x_mask[:, :, None],
                other=0.0)
    return _split8(v)


@triton.jit
def _fdot(acc, words, e: tl.constexpr, s, x, IEEE: tl.constexpr):
    """acc += x's plane e dotted with plane e of `words` dequantised in float32 (times the per-word scales s), cast
    to x's dtype."""
    return _dot(acc, x, (_code(words, e) * s).to(x.dtype), IEEE)


@triton.jit
def _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K, kt_lo, kt_hi,
               G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr, SCALE_GROUPS: tl.constexpr,
               PACKED: tl.constexpr, EVEN_K: tl.constexpr, X_WIDE: tl.constexpr, PREFETCH: tl.constexpr,
               CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr, MMA_ORDER: tl.constexpr, PEEL: tl.constexpr,
               PDL: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[rows, k] @ W[offs_n, k]^T over K tiles kt_lo..kt_hi-1 of one W4A16 weight: the
    one-row GEMV (PREFETCH, gemv._gemv_tile), the tensor cores on the MMA-order words (MMA_ORDER, mma._mma_order_tile),
    or the element planes here.

    The loops count K tiles (k0 = kt * BLOCK_K) so that the compiler sees word offsets divisible by the tile and
    vectorises the loads and pipelines them (an offset from a runtime start hid that). X_PLANES: x rows are stored
    plane-major (x[8i + e] at e * K/8 + i), so each plane's loads are contiguous and vectorise; otherwise they are
    stride-8 gathers. X_WIDE (instead of X_PLANES): x in natural order, each word's 8 elements one 16-byte load, split
    into the planes in registers (no plane-major copy of x before the launch). SCALE_GROUPS (one-row path): sum each
    group's words before scaling, loading [BLOCK_N, groups] scales instead of one per word. PACKED (tensor-core path,
    bf16 x and scales): dequantize with _bf16_planes. PDL: _grid_wait before the first read of x (the GEMV and, with
    PEEL, the MMA-order tiles load their first weight tile before it).

    w_ptr: the packed bytes read as int32 words (row stride stride_wn words); word i of a row holds
    elements 8i .. 8i+7, element 8i+e in bits 4e..4e+3, all in group (8i) // G. MMA_ORDER: w_ptr / s_ptr are the
    K-block-major copy (int4_layout.MmaOrder) and stride_wn / stride_sn the strides of its K blocks.
    """
    WORDS: tl.constexpr = BLOCK_K // 8
    WORDS_PER_GROUP: tl.constexpr = G // 8
    k_words = tl.multiple_of(K // 8, WORDS_PER_GROUP)     # K is a multiple of G: aligned plane starts
    offs_w = tl.arange(0, WORDS)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    if PREFETCH:    # rows past N read row 0 (never stored), so the one-row path's loads need no row mask
        n_rows = tl.where(n_mask, offs_n, 0).to(tl.int64)
    else:
        n_rows = offs_n.to(tl.int64)
    if MMA_ORDER:   # the K-block-major copy: a row's place in block 0; stride_wn / stride_sn step a block
        w_rows = w_ptr + n_rows * 16
        s_rows = s_ptr + n_rows * (128 // G)
    else:
        w_rows = w_ptr + n_rows * stride_wn
        s_rows = s_ptr + n_rows * stride_sn
    if not (PREFETCH or MMA_ORDER):
        _grid_wait(PDL)
    if MMA_ORDER:
        return _mma_order_tile(x_rows, row_mask, w_rows, s_rows, n_mask, K, kt_lo, kt_hi, stride_wn, stride_sn, G,
                               BLOCK_M, BLOCK_N, BF16_SCALES, IEEE, PACKED, EVEN_K, PEEL, PDL)
    elif PREFETCH:
        return _gemv_tile(x_rows, w_rows, s_rows, K, kt_lo, kt_hi, k_words, G, BLOCK_N, WORDS, BF16_SCALES, EVEN_K,
                          CODES_ASM, BIASED_CODES, PDL)
    elif BLOCK_M == 1:
        # one row: multiply-and-add on CUDA cores, partial sums reduced once at the end
        GROUPS: tl.constexpr = WORDS // WORDS_PER_GROUP
        if SCALE_GROUPS:
            acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for kt in range(kt_lo, kt_hi):
            i = kt * WORDS + offs_w
            i_mask = (i < k_words) | EVEN_K     # EVEN_K: no K tail, constant masks keep loads wide
            mask = n_mask[:, None] & i_mask[None, :]
            words = tl.load(w_rows[:, None] + i[None, :], mask=mask, other=0)
            x_mask = row_mask[:, None] & i_mask[None, :]
            if X_WIDE:
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_wide(x_rows, i, x_mask)
                part = _code(words, 0) * x0.to(tl.float32)
                part += _code(words, 1) * x1.to(tl.float32)
                part += _code(words, 2) * x2.to(tl.float32)
                part += _code(words, 3) * x3.to(tl.float32)
                part += _code(words, 4) * x4.to(tl.float32)
                part += _code(words, 5) * x5.to(tl.float32)
                part += _code(words, 6) * x6.to(tl.float32)
                part += _code(words, 7) * x7.to(tl.float32)
            else:
                part = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
                for e in tl.static_range(8):
                    part += _code(words, e) * _x_plane(x_rows, e, i, k_words, x_mask, X_PLANES).to(tl.float32)
            if SCALE_GROUPS:
                g = kt * GROUPS + tl.arange(0, GROUPS)
                s = _load_scales(s_rows[:, None] + g[None, :], n_mask[:, None] & ((g < K // G) | EVEN_K)[None, :],
                                 BF16_SCALES)
                acc += tl.sum(tl.reshape(part, [BLOCK_N, GROUPS, WORDS_PER_GROUP]), axis=2) * s
            else:
                acc += part * _load_scales(s_rows[:, None] + (i // WORDS_PER_GROUP)[None, :], mask, BF16_SCALES)
        return tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])
    else:
        # tensor cores: per element plane e, [BLOCK_M, WORDS] x [WORDS, BLOCK_N] (weight transposed by the
        # pointer arithmetic), the weight dequantized in registers just before the dot
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        TILE_GROUPS: tl.constexpr = WORDS // WORDS_PER_GROUP
        for kt in range(kt_lo, kt_hi):
            i = kt * WORDS + offs_w
            i_mask = (i < k_words) | EVEN_K     # EVEN_K: no K tail, constant masks keep loads wide
            mask = i_mask[:, None] & n_mask[None, :]
            # the tile's group scales, loaded contiguously per row and repeated to one per word in registers
            g = kt * TILE_GROUPS + tl.arange(0, TILE_GROUPS)
            g_mask = (g < K // G) | EVEN_K
            words = tl.load(w_rows[None, :] + i[:, None], mask=mask, other=0)
            x_mask = row_mask[:, None] & i_mask[None, :]
            if X_WIDE:
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_wide(x_rows, i, x_mask)
            else:
                x0 = _x_plane(x_rows, 0, i, k_words, x_mask, X_PLANES)
                x1 = _x_plane(x_rows, 1, i, k_words, x_mask, X_PLANES)
                x2 = _x_plane(x_rows, 2, i, k_words, x_mask, X_PLANES)
                x3 = _x_plane(x_rows, 3, i, k_words, x_mask, X_PLANES)
                x4 = _x_plane(x_rows, 4, i, k_words, x_mask, X_PLANES)
                x5 = _x_plane(x_rows, 5, i, k_words, x_mask, X_PLANES)
                x6 = _x_plane(x_rows, 6, i, k_words, x_mask, X_PLANES)
                x7 = _x_plane(x_rows, 7, i, k_words, x_mask, X_PLANES)
            if PACKED:
                s_bits = _per_word(tl.load(s_rows[None, :] + g[:, None], mask=g_mask[:, None] & n_mask[None, :],
                                           other=0), WORDS_PER_GROUP)
                w0, w1, w2, w3, w4, w5, w6, w7 = _bf16_planes(words, s_bits)
                acc = _dot(acc, x0, w0, IEEE)
                acc = _dot(acc, x1, w1, IEEE)
                acc = _dot(acc, x2, w2, IEEE)
                acc = _dot(acc, x3, w3, IEEE)
                acc = _dot(acc, x4, w4, IEEE)
                acc = _dot(acc, x5, w5, IEEE)
                acc = _dot(acc, x6, w6, IEEE)
                acc = _dot(acc, x7, w7, IEEE)
            else:
                s = _per_word(_load_scales(s_rows[None, :] + g[:, None], g_mask[:, None] & n_mask[None, :],
                                           BF16_SCALES), WORDS_PER_GROUP)
                acc = _fdot(acc, words, 0, s, x0, IEEE)
                acc = _fdot(acc, words, 1, s, x1, IEEE)
                acc = _fdot(acc, words, 2, s, x2, IEEE)
                acc = _fdot(acc, words, 3, s, x3, IEEE)
                acc = _fdot(acc, words, 4, s, x4, IEEE)
                acc = _fdot(acc, words, 5, s, x5, IEEE)
                acc = _fdot(acc, words, 6, s, x6, IEEE)
                acc = _fdot(acc, words, 7, s, x7, IEEE)
        return acc


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr,
                  SCALE_GROUPS: tl.constexpr, PACKED: tl.constexpr, EVEN_K: tl.constexpr, X_WIDE: tl.constexpr,
                  PREFETCH: tl.constexpr, CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr,
                  MMA_ORDER: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr, SPLIT_REDUCE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    kt_lo, kt_hi = _k_range(K, pid_k, SPLIT_K, BLOCK_K)
    acc = _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K,
                     kt_lo, kt_hi, G, BLOCK_M, BLOCK_N, BLOCK_K, BF16_SCALES, IEEE, X_PLANES, SCALE_GROUPS, PACKED,
                     EVEN_K, X_WIDE, PREFETCH, CODES_ASM, BIASED_CODES, MMA_ORDER, PEEL, PDL)
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    out_mask = row_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        _split_arrive(acc, ws_ptr, tile, pid_k, out_mask, SPLIT_K, 1, 0, BLOCK_M, BLOCK_N)
        if not SPLIT_REDUCE:    # (SPLIT_REDUCE: _split_reduce_kernel, launched next, sums them)
            if _split_is_last(cnt_ptr, tile, SPLIT_K):
                total = _split_sum(ws_ptr, tile, out_mask, SPLIT_K, 1, 0, BLOCK_M, BLOCK_N)
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.store(cnt_ptr + tile, 0)


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


def cuda_takes(x: torch.Tensor) -> bool:
    """Whether the CUDA kernel can read these activations: bf16, 16-byte aligned, on an sm_90 device, not in the
    interpreter."""
    return (x.dtype == torch.bfloat16 and x.is_cuda and not interpreting() and x.data_ptr() % 16 == 0
            and runs_on(x.device.index))


def cuda_tile(entry: dict, weight: PackedInt4, x: torch.Tensor) -> CudaTile | None:
    """The CUDA kernel's tile for a config entry's "CUDA" key, where the kernel can take this call: x it can read
    (cuda_takes), the weight's CUDA-order copy, a tile that fits the shape. None: the entry's Triton launch."""
    spec = entry.get("CUDA")
    if spec is None or weight.cuda is None or not cuda_takes(x):
        return None
    m = x.shape[0]
    tile = fit_tile(weight.n, weight.k, m) if spec == "fit" else spec
    return tile if tile is not None and tile.fits(weight.n, weight.k, m) else None


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
    entry = config or pick_config(dense_configs(weight.k, weight.n, x.dtype), m)
    tile = cuda_tile(entry, weight, x)
    if tile is not None:
        return w4a16_cuda_launch(x, weight.cuda, weight.n, weight.k, out, tile, pdl=entry.get("CUDA_PDL", True))
    cfg = tile_config(entry, weight.group_size, interpreting(), x.device)
    bf16_scales = weight.scales.dtype == torch.bfloat16
    if cfg["MMA_ORDER"]:
        if weight.mma is None:
            raise ValueError(f"w4a16_linear: config {cfg} reads the weight's MMA-order words, which this weight "
                             f"[{weight.n}, {weight.k}] was packed without (pack_for_gpu(..., mma_order=True))")
        words, scales = weight.mma.words, weight.mma.scales     # strides below: of a K block
    else:
        words, scales = weight.packed.view(torch.int32), weight.scales
    if bf16_scales:
        scales = scales.view(torch.int16)
    if cfg["X_PLANES"]:
        x = to_planes(x)
    n_tiles, m_tiles = triton.cdiv(weight.n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"])
    splits = split_k(cfg, weight.k, n_tiles * m_tiles)
    ws, counters = split_buffers(x.device, n_tiles * m_tiles, n_tiles * m_tiles * splits * cfg["BLOCK_M"] *
                                 cfg["BLOCK_N"] if splits > 1 else 1)
    _w4a16_kernel[(n_tiles, m_tiles, splits)](
        x, words, scales, out, ws, counters, m, weight.n, weight.k,
        x.stride(0), words.stride(0), scales.stride(0), out.stride(0), G=weight.group_size, SPLIT_K=splits,
        EVEN_K=weight.k % cfg["BLOCK_K"] == 0,
        BF16_SCALES=bf16_scales, IEEE=x.dtype == torch.float32, **launch_keys(cfg, x.dtype, bf16_scales))
    if splits > 1 and cfg["SPLIT_REDUCE"]:
        chunk = min(cfg["BLOCK_M"], 4)
        pdl = not interpreting() and x.is_cuda and has_pdl(x.device)
        _split_reduce_kernel[(n_tiles * m_tiles, triton.cdiv(min(m, cfg["BLOCK_M"]), chunk))](
            ws, out, m, weight.n, out.stride(0), n_tiles, SPLIT_K=splits, BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"], CHUNK_M=chunk, PDL=pdl, num_warps=2, launch_pdl=pdl)
    return out
