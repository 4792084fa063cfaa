"""The `MMA_ORDER` tensor-core tiles (the dense bf16/fp16 default at M = 2-64): the weight's codes from the
load-time copy in the MMA's register order, K-block-major (int4_layout.MmaOrder), dequantised straight into the
wgmma's A operand, x as it is (docs/w4a16-kernels.md, "MMA_ORDER")."""

from __future__ import annotations

import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.dequant import _bf16_planes, _load_scales, _scaled_planes
from k2vec.engines.gpu_triton.kernels.sync import _grid_wait


@triton.jit
def _dot(acc, a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mma_weights(w_rows, s_rows, n_mask, kt, kb_words, kb_scales, G: tl.constexpr, BF16_SCALES: tl.constexpr,
                 PACKED: tl.constexpr):
    """MMA-order words [BLOCK_N, 16] of 128-element K block kt and their scales, one per word: bf16 bits (PACKED) or
    float32. The copy is K-block-major (int4_layout.MmaOrder): block kt starts kb_words words (kb_scales scales)
    after block kt - 1, and w_rows / s_rows point at each row's place in block 0. Word 4c + j covers elements
    32j .. 32j + 31 of the block; the index is written so that the compiler sees 4 / 2 / 1 consecutive groups per
    thread (G = 32 / 64 / 128) and vectorises the scale loads. A padded block's scales are 0 in the copy."""
    offs_w = tl.arange(0, 16)
    words = tl.load(w_rows[:, None] + (kt * kb_words + offs_w)[None, :], mask=n_mask[:, None], other=0)
    g = kt * kb_scales + (offs_w % 4) // (G // 32)
    if PACKED:
        s = tl.load(s_rows[:, None] + g[None, :], mask=n_mask[:, None], other=0)
    else:
        s = _load_scales(s_rows[:, None] + g[None, :], n_mask[:, None], BF16_SCALES)
    return words, s


@triton.jit
def _mma_x(x_rows, row_mask, kt, K, EVEN_K: tl.constexpr):
    """x^T [128, BLOCK_M] of K block kt, as it is (K's tail and the rows where row_mask is false masked)."""
    k = kt * 128 + tl.arange(0, 128)
    return tl.load(x_rows[None, :] + k[:, None], mask=((k < K) | EVEN_K)[:, None] & row_mask[None, :], other=0.0)


@triton.jit
def _mma_step(acc_t, words, s, x_t, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PACKED: tl.constexpr):
    """acc^T += one block's dequantised weight [BLOCK_N, 128] @ x^T [128, BLOCK_M].

    The 8 planes of the [BLOCK_N, 16] word tile, joined and put in K's order by a reshape and a permute, land in the
    register layout of the MMA's A operand as they are: no trip through shared memory between the dequantisation
    and the MMA, and each register holds two K-adjacent weights as _bf16_planes makes them (nibbles p and p + 4)."""
    if PACKED:
        w0, w1, w2, w3, w4, w5, w6, w7 = _bf16_planes(words, s)
    else:
        w0, w1, w2, w3, w4, w5, w6, w7 = _scaled_planes(words, s, x_t)
    v = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
    # v[n, 4c + j, e0, e1, e2] = plane e0 + 2 e1 + 4 e2, at K = 32j + 16 e1 + 8 e0 + 2c + e2 of the block
    v = tl.reshape(tl.permute(tl.reshape(v, [BLOCK_N, 4, 4, 2, 2, 2]), (0, 2, 4, 3, 1, 5)), [BLOCK_N, 128])
    return _dot(acc_t, v, x_t, IEEE)


@triton.jit
def _mma_order_tile(x_rows, row_mask, w_rows, s_rows, n_mask, K, kt_lo, kt_hi, kb_words, kb_scales, G: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_SCALES: tl.constexpr, IEEE: tl.constexpr,
                    PACKED: tl.constexpr, EVEN_K: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr):
    """MMA_ORDER: float32 acc^T [BLOCK_N, BLOCK_M] over 128-element K blocks kt_lo..kt_hi-1, the weight's words in the
    MMA order of int4_layout.mma_order_words (word 4c + j of a block holds the elements its MMA thread needs), one
    block per step (_mma_step). PEEL (set with PDL by tile_config, and kept in the interpreter, which drops PDL): the
    first block's words and scales (constant data) load before the PDL wait, so that their DRAM latency overlaps the
    end of the kernel before; x and everything after come after the wait. Without PEEL, ptxas runs the wgmmas one at
    a time (its advisory C7515: the zero accumulator of the loop's zero-trip path); peeling every tile's first block
    lifts that and measured no faster (bench/RESULTS.md, session 19)."""
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if not PEEL:
        _grid_wait(PDL)
    else:
        # an explicit SPLIT_K may leave the last splits empty: their peeled step reads the last block and is dropped
        kt0 = tl.minimum(kt_lo, kt_hi - 1)
        words, s = _mma_weights(w_rows, s_rows, n_mask, kt0, kb_words, kb_scales, G, BF16_SCALES, PACKED)
        _grid_wait(PDL)
        step = _mma_step(acc_t, words, s, _mma_x(x_rows, row_mask, kt0, K, EVEN_K), BLOCK_N, IEEE, PACKED)
        acc_t = tl.where(kt_lo < kt_hi, step, acc_t)
        kt_lo += 1
    for kt in range(kt_lo, kt_hi):
        words, s = _mma_weights(w_rows, s_rows, n_mask, kt, kb_words, kb_scales, G, BF16_SCALES, PACKED)
        acc_t = _mma_step(acc_t, words, s, _mma_x(x_rows, row_mask, kt, K, EVEN_K), BLOCK_N, IEEE, PACKED)
    return tl.trans(acc_t)
