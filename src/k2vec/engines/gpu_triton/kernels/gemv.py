"""The one-row GEMV path (`PREFETCH`, BLOCK_M 1; the bf16/fp16 default at M <= 2 dense and for both MoE launches up
to M = 16): multiply-and-add on CUDA cores, x in its natural order, the next K tile's words, x and scales loaded
before this tile's arithmetic (docs/w4a16-kernels.md, "GEMV path")."""

from __future__ import annotations

import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.dequant import _biased8, _codes8, _load_scales
from k2vec.engines.gpu_triton.kernels.sync import _grid_wait


@triton.jit
def _split8(v):
    """v [A, B, 8] -> its 8 slices v[:, :, e] ([A, B] each), by three register-only splits of the last axis."""
    a: tl.constexpr = v.shape[0]
    b: tl.constexpr = v.shape[1]
    even, odd = tl.split(tl.reshape(v, [a, b, 4, 2]))        # e = 2j, 2j + 1
    s0, s2 = tl.split(tl.reshape(even, [a, b, 2, 2]))         # e = 4c, 4c + 2
    s1, s3 = tl.split(tl.reshape(odd, [a, b, 2, 2]))          # e = 4c + 1, 4c + 3
    x0, x4 = tl.split(s0)
    x2, x6 = tl.split(s2)
    x1, x5 = tl.split(s1)
    x3, x7 = tl.split(s3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _split4(v):
    """v [A, B, 4] -> its 4 slices v[:, :, j] ([A, B] each), by register-only splits of the last axis."""
    a: tl.constexpr = v.shape[0]
    b: tl.constexpr = v.shape[1]
    even, odd = tl.split(tl.reshape(v, [a, b, 2, 2]))        # j = 2p, 2p + 1
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _row_tile(kt, kt_hi, WORDS: tl.constexpr, GROUPS: tl.constexpr):
    """Word and group indices of K tile kt of the one-row path, kt clamped to the split's last tile: the prefetch
    after it (or the first tile of an empty split) reads that tile again (from L2) instead of needing a mask."""
    kt = tl.minimum(kt, kt_hi - 1)
    return kt * WORDS + tl.arange(0, WORDS), kt * GROUPS + tl.arange(0, GROUPS)


@triton.jit
def _k_load(ptrs, k_mask, EVEN_K: tl.constexpr):
    """A plain load where K has no tail (EVEN_K: no predicates, no zeroed registers), else 0 past K."""
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_mask, other=0)


@triton.jit
def _row_loads(w_rows, s_rows, x_rows, kt, kt_hi, K, k_words, G: tl.constexpr, WORDS: tl.constexpr,
               BF16_SCALES: tl.constexpr, EVEN_K: tl.constexpr):
    """One-row PREFETCH path: K tile kt's weight words [BLOCK_N, WORDS], natural-order x [1, WORDS, 8] and group
    scales [BLOCK_N, groups] (_row_tile's clamped tile; w_rows/s_rows of rows past N point at row 0, see
    _int4_tile, and the one row of x always exists), masked only at a K tail: 16-byte loads without predicates or
    zeroed registers, 4% fewer instructions per trip than masked (bench/sass.py). Written out, not as
    _row_weight_loads + _row_x_loads: composed from them, the loop compiles to 238 registers instead of 127 and 579
    instructions per trip instead of 490 (bench/sass.py, Triton 3.7.1, before the chained sums; the MoE gate/up tile
    then spills)."""
    GROUPS: tl.constexpr = WORDS // (G // 8)
    i, g = _row_tile(kt, kt_hi, WORDS, GROUPS)
    words = _k_load(w_rows[:, None] + i[None, :], (i < k_words)[None, :], EVEN_K)
    xv = _k_load(x_rows[:, None, None] + 8 * i[None, :, None] + tl.arange(0, 8)[None, None, :],
                 (i < k_words)[None, :, None], EVEN_K)
    s = _load_scales(s_rows[:, None] + g[None, :], None if EVEN_K else (g < K // G)[None, :], BF16_SCALES)
    return words, xv, s


@triton.jit
def _row_weight_loads(w_rows, s_rows, kt, kt_hi, K, k_words, G: tl.constexpr, WORDS: tl.constexpr,
                      BF16_SCALES: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight words and group scales of _row_loads (the first tile's, loaded before the PDL wait)."""
    GROUPS: tl.constexpr = WORDS // (G // 8)
    i, g = _row_tile(kt, kt_hi, WORDS, GROUPS)
    words = _k_load(w_rows[:, None] + i[None, :], (i < k_words)[None, :], EVEN_K)
    s = _load_scales(s_rows[:, None] + g[None, :], None if EVEN_K else (g < K // G)[None, :], BF16_SCALES)
    return words, s


@triton.jit
def _row_x_loads(x_rows, kt, kt_hi, k_words, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """The natural-order x [rows, WORDS, 8] of _row_loads (the first tile's, loaded after the PDL wait)."""
    i, _ = _row_tile(kt, kt_hi, WORDS, 1)
    return _k_load(x_rows[:, None, None] + 8 * i[None, :, None] + tl.arange(0, 8)[None, None, :],
                   (i < k_words)[None, :, None], EVEN_K)


@triton.jit
def _word_fma(acc, word, xw, CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr):
    """acc [BLOCK_N, QUADS] plus the 8 codes of one word of each quad times their float32 activations xw [QUADS, 8]:
    a fused multiply-add per element, chained on acc."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(tl.reshape(xw, [1, xw.shape[0], 8]))
    if BIASED_CODES:
        c0, c1, c2, c3, c4, c5, c6, c7 = _biased8(word, CODES_ASM)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = _codes8(word, CODES_ASM)
    acc += c0 * x0
    acc += c1 * x1
    acc += c2 * x2
    acc += c3 * x3
    acc += c4 * x4
    acc += c5 * x5
    acc += c6 * x6
    acc += c7 * x7
    return acc


@triton.jit
def _row_part(words, xv, s, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, WORDS_PER_GROUP: tl.constexpr,
              CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr):
    """Scaled group sums [BLOCK_N, GROUPS] of one K tile of the one-row path (x as [1, WORDS, 8]); BIASED_CODES: the
    sums over 128 (the caller multiplies by 128 once at the end). The 32 products of each run of 4 words (a group
    of 32, or a part of a larger group) are one chain of fused multiply-adds, with no per-word partial sums to add,
    and x is made float32 once per element, before it is spread over the rows: 10-14% fewer instructions per K tile
    than one chain per word and x widened per row (bench/sass.py, Triton 3.7.1)."""
    QUADS: tl.constexpr = GROUPS * WORDS_PER_GROUP // 4
    xf = xv.to(tl.float32)
    w0, w1, w2, w3 = _split4(tl.reshape(words, [BLOCK_N, QUADS, 4]))
    # x's words j = 2p + q of each quad, as w's: [QUADS, 8] each
    even, odd = tl.split(tl.permute(tl.reshape(xf, [QUADS, 2, 2, 8]), [0, 3, 1, 2]))
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    sums = tl.zeros([BLOCK_N, QUADS], dtype=tl.float32)
    sums = _word_fma(sums, w0, x0, CODES_ASM, BIASED_CODES)
    sums = _word_fma(sums, w1, x1, CODES_ASM, BIASED_CODES)
    sums = _word_fma(sums, w2, x2, CODES_ASM, BIASED_CODES)
    sums = _word_fma(sums, w3, x3, CODES_ASM, BIASED_CODES)
    sums = tl.sum(tl.reshape(sums, [BLOCK_N, GROUPS, WORDS_PER_GROUP // 4]), axis=2)
    if BIASED_CODES:
        xs = tl.sum(xf, axis=2)      # [1, WORDS]: sum of each word's 8 activations
        sums -= 1.0625 * tl.sum(tl.reshape(xs, [1, GROUPS, WORDS_PER_GROUP]), axis=2)
    return sums * s


@triton.jit
def _gemv_tile(x_rows, w_rows, s_rows, K, kt_lo, kt_hi, k_words, G: tl.constexpr, BLOCK_N: tl.constexpr,
               WORDS: tl.constexpr, BF16_SCALES: tl.constexpr, EVEN_K: tl.constexpr, CODES_ASM: tl.constexpr,
               BIASED_CODES: tl.constexpr, PDL: tl.constexpr):
    """float32 [1, BLOCK_N] = x's one row @ W[rows, k]^T over K tiles kt_lo..kt_hi-1: each tile's scaled group sums
    (_row_part) added up, reduced once at the end. The first tile's weights and scales load before the PDL wait (with
    PDL they load while the kernel before ends), x after it; each trip loads the next tile before this one's arithmetic
    (registers double-buffered by hand). w_rows/s_rows of rows past N point at row 0 (never stored), so no row mask."""
    GROUPS: tl.constexpr = WORDS // (G // 8)
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    words_n, s_n = _row_weight_loads(w_rows, s_rows, kt_lo, kt_hi, K, k_words, G, WORDS, BF16_SCALES, EVEN_K)
    _grid_wait(PDL)
    xv_n = _row_x_loads(x_rows, kt_lo, kt_hi, k_words, WORDS, EVEN_K)
    for kt in range(kt_lo, kt_hi):
        words, xv, s = words_n, xv_n, s_n
        words_n, xv_n, s_n = _row_loads(w_rows, s_rows, x_rows, kt + 1, kt_hi, K, k_words, G, WORDS, BF16_SCALES,
                                        EVEN_K)
        acc += _row_part(words, xv, s, BLOCK_N, GROUPS, G // 8, CODES_ASM, BIASED_CODES)
    if BIASED_CODES:
        acc *= 128.0     # exact: a power of two
    return tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])
