"""Dense W4A16 GEMM: y[M, N] = x[M, K] @ W^T, W INT4 with group scales, read as the bundle stores it or (MMA_ORDER)
from the load-time copy of its codes in the MMA's register order (int4_layout.mma_order_words).

The kernel reads a row's packed bytes as little-endian int32 words: word i holds elements 8i .. 8i+7
(element 8i+e in bits 4e..4e+3, `docs/int4-format.md`), all in one group since G is a multiple of 8. So
instead of interleaving nibbles in registers it splits the product into 8 element planes:
y = sum_e x[:, e::8] @ W_e^T, with the word's one scale shared by all 8. Accumulation is float32.

Two tile paths, picked by BLOCK_M:
* BLOCK_M == 1: one row per program, multiply-and-add on CUDA cores; the scale is applied to each
  word's 8-element partial sum (no tensor-core padding of M to 16).
* BLOCK_M >= 16: `tl.dot` on a [BLOCK_M, BLOCK_K/8] x [BLOCK_K/8, BLOCK_N] tile per element plane (rows past
  M are masked, so M = 1 runs here too). The weight is dequantized in registers: for bfloat16 activations
  with bfloat16 scales (PACKED) by a few PTX instructions per word that make two bfloat16 values at once;
  otherwise in float32, cast to the activation dtype (float32 dots run with input_precision "ieee").

Split-K (SPLIT_K > 1): a third grid axis splits K so that small-M grids fill the machine. Each program
writes its float32 partial tile to a workspace and bumps an integer counter of its output tile; the
program that arrives last sums the SPLIT_K partials in split order (the same order whichever program is
last: deterministic), writes the output and zeroes the counter for the next launch (CUDA-graph safe).
The counters are shared by every launch on the device, so split-K launches must not run concurrently.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.configs import dense_configs, launch_keys, pick_config, split_k, tile_config
from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_scales(ptrs, mask, BF16_SCALES: tl.constexpr):
    """Scales at `ptrs` as float32 (0 where masked; mask None: a plain load); bf16 scales arrive as int16 bits."""
    if mask is None:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=mask, other=0)
    if BF16_SCALES:
        # bf16 widens exactly: float32 bits = bf16 bits << 16
        bits = raw.to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return raw


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


# Two elements per instruction: lop3 puts nibbles e and e+4 (bits 4e and 16+4e) under the bf16x2 magic
# 0x4300 (128.0, ulp 1), giving 128+u in each half; u - 8 = (128+u) * 1 - 136 exactly; times the group scale
# (+ -0.0) rounds the exact product q*s once, as float32 q*s cast to bfloat16 does. $8 = word, $9 = bf16 scale.
_BF16_PLANES_ASM = tl.constexpr("""
{
.reg .b32 w, t, s2, one, bias, nz;
mov.b32 s2, {$9, $9};
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
mov.b32 nz, 0x80008000;
mov.b32 w, $8;
lop3.b32 t, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, bias;
fma.rn.bf16x2 t, t, s2, nz;
mov.b32 {$0, $4}, t;
shr.u32 w, w, 4;
lop3.b32 t, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, bias;
fma.rn.bf16x2 t, t, s2, nz;
mov.b32 {$1, $5}, t;
shr.u32 w, w, 4;
lop3.b32 t, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, bias;
fma.rn.bf16x2 t, t, s2, nz;
mov.b32 {$2, $6}, t;
shr.u32 w, w, 4;
lop3.b32 t, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, bias;
fma.rn.bf16x2 t, t, s2, nz;
mov.b32 {$3, $7}, t;
}
""")


@triton.jit
def _bf16_planes(words, s_bits):
    """The 8 planes q_e * s of int32 words as bfloat16 (s_bits: each word's bf16 scale as int16 bits)."""
    return tl.inline_asm_elementwise(_BF16_PLANES_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s_bits],
                                     dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                                            tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=1)


# The 8 codes of a word as exact float32, in 2.4 instructions each (CODES_ASM): the nibbles of even and odd elements
# masked into bytes (lo: elements 0, 2, 4, 6; hi: 1, 3, 5, 7, shifted down by 4), each byte permuted (prmt) into the
# low byte of the float 2^23 (0x4B000000), giving 2^23 + u exactly, minus 2^23 + 8: q = u - 8, the same float32 value
# as _code computes with a shift, a mask and an or per element.
_F32_CODES_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, t;
and.b32 lo, $8, 0x0F0F0F0F;
shr.u32 hi, $8, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 t, lo, 0x4B000000, 0x7540;
sub.f32 $0, t, 0f4B000008;
prmt.b32 t, hi, 0x4B000000, 0x7540;
sub.f32 $1, t, 0f4B000008;
prmt.b32 t, lo, 0x4B000000, 0x7541;
sub.f32 $2, t, 0f4B000008;
prmt.b32 t, hi, 0x4B000000, 0x7541;
sub.f32 $3, t, 0f4B000008;
prmt.b32 t, lo, 0x4B000000, 0x7542;
sub.f32 $4, t, 0f4B000008;
prmt.b32 t, hi, 0x4B000000, 0x7542;
sub.f32 $5, t, 0f4B000008;
prmt.b32 t, lo, 0x4B000000, 0x7543;
sub.f32 $6, t, 0f4B000008;
prmt.b32 t, hi, 0x4B000000, 0x7543;
sub.f32 $7, t, 0f4B000008;
}
""")


@triton.jit
def _f32_codes(words):
    """The 8 codes q_e of int32 words as float32 (CODES_ASM; the same values as _code(words, e))."""
    return tl.inline_asm_elementwise(_F32_CODES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32,
                                            tl.float32, tl.float32, tl.float32, tl.float32),
                                     is_pure=True, pack=1)


# BIASED_CODES: the codes as v = 1 + u/128, float32 bits 0x3F800000 | u << 16, so u - 8 = 128 v - 136 and a group's
# sum of q·x is 128 (sum v·x - 1.0625 sum x): no subtraction per element. Each v·x is exact (8 by 8 significant
# bits); sum x is taken once per word and shared by the rows a thread holds. In PTX two lop3 put each nibble under
# 0x80 in its byte ((w & 0x0F0F0F0F) | 0x80808080, the odd elements shifted down by 4 first) and one prmt per element
# moves that byte to bits 16..23 under the exponent byte 0x3F: 2.4 instructions per element, none a float add.
_F32_BIASED_ASM = tl.constexpr("""
{
.reg .b32 lo, hi;
lop3.b32 lo, $8, 0x0F0F0F0F, 0x80808080, 0xEA;
shr.u32 hi, $8, 4;
lop3.b32 hi, hi, 0x0F0F0F0F, 0x80808080, 0xEA;
prmt.b32 $0, lo, 0x3F000000, 0x7054;
prmt.b32 $1, hi, 0x3F000000, 0x7054;
prmt.b32 $2, lo, 0x3F000000, 0x7154;
prmt.b32 $3, hi, 0x3F000000, 0x7154;
prmt.b32 $4, lo, 0x3F000000, 0x7254;
prmt.b32 $5, hi, 0x3F000000, 0x7254;
prmt.b32 $6, lo, 0x3F000000, 0x7354;
prmt.b32 $7, hi, 0x3F000000, 0x7354;
}
""")


@triton.jit
def _biased(words, e: tl.constexpr):
    """v = 1 + u/128 of element e (0..7) of each word: the nibble moved to bits 16..19 under 1.0f's bits."""
    if 4 * e <= 16:
        u16 = (words << (16 - 4 * e)) & 0xF0000
    else:
        u16 = (words >> (4 * e - 16)) & 0xF0000
    return (u16 | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _biased8(words, CODES_ASM: tl.constexpr):
    """The 8 biased codes v_e = 1 + u_e/128 of int32 words as float32: by prmt (CODES_ASM) or shift and mask."""
    if CODES_ASM:
        return tl.inline_asm_elementwise(_F32_BIASED_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32,
                                                tl.float32, tl.float32, tl.float32, tl.float32),
                                         is_pure=True, pack=1)
    else:
        return (_biased(words, 0), _biased(words, 1), _biased(words, 2), _biased(words, 3), _biased(words, 4),
                _biased(words, 5), _biased(words, 6), _biased(words, 7))


@triton.jit
def _x_plane(x_rows, e: tl.constexpr, i, k_words, x_mask, X_PLANES: tl.constexpr):
    """Activations of element plane e at words i ([rows, words]); plane-major rows load contiguously."""
    if X_PLANES:
        return tl.load(x_rows[:, None] + e * k_words + i[None, :], mask=x_mask, other=0.0)
    else:
        return tl.load(x_rows[:, None] + 8 * i[None, :] + e, mask=x_mask, other=0.0)


@triton.jit
def _per_word(s, WORDS_PER_GROUP: tl.constexpr):
    """Group scales [groups, n] repeated to one per word: [groups * WORDS_PER_GROUP, n]."""
    return tl.reshape(tl.broadcast_to(s[:, None, :], [s.shape[0], WORDS_PER_GROUP, s.shape[1]]),
                      [s.shape[0] * WORDS_PER_GROUP, s.shape[1]])


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
def _dot(acc, a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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
def _grid_wait(PDL: tl.constexpr):
    """PDL (programmatic dependent launch, GPU only): wait until the kernel launched before this one has finished
    and its writes are visible, then let the next kernel start launching. Every read of data another kernel
    writes, and every write, comes after this; only the constant weights and scales may be read before it. The
    next kernel is let go only after the wait, so when it starts, everything before this kernel has finished."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _codes8(words, CODES_ASM: tl.constexpr):
    """The 8 codes of int32 words as float32: by prmt (CODES_ASM) or shift, mask and magic number (_code)."""
    if CODES_ASM:
        return _f32_codes(words)
    else:
        return (_code(words, 0), _code(words, 1), _code(words, 2), _code(words, 3), _code(words, 4),
                _code(words, 5), _code(words, 6), _code(words, 7))


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
def _scaled_planes(words, s, like):
    """The 8 planes q_e * s of int32 words dequantised in float32 and cast to like's dtype (float32/float16 x,
    float32 scales, the interpreter; PACKED makes them with _bf16_planes)."""
    return ((_code(words, 0) * s).to(like.dtype), (_code(words, 1) * s).to(like.dtype),
            (_code(words, 2) * s).to(like.dtype), (_code(words, 3) * s).to(like.dtype),
            (_code(words, 4) * s).to(like.dtype), (_code(words, 5) * s).to(like.dtype),
            (_code(words, 6) * s).to(like.dtype), (_code(words, 7) * s).to(like.dtype))


@triton.jit
def _mma_weights(w_rows, s_rows, n_mask, kt, K, G: tl.constexpr, BF16_SCALES: tl.constexpr, PACKED: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """MMA-order words [BLOCK_N, 16] of 128-element K block kt and their scales, one per word: bf16 bits (PACKED) or
    float32. Word 4c + j covers elements 32j .. 32j + 31 of the block; the index is written so that the compiler
    sees 4 / 2 / 1 consecutive groups per thread (G = 32 / 64 / 128) and vectorises the scale loads. A padded
    block's words scale to 0."""
    offs_w = tl.arange(0, 16)
    words = tl.load(w_rows[:, None] + (kt * 16 + offs_w)[None, :], mask=n_mask[:, None], other=0)
    g = kt * (128 // G) + (offs_w % 4) // (G // 32)
    s_mask = n_mask[:, None] & ((g < K // G) | EVEN_K)[None, :]
    if PACKED:
        s = tl.load(s_rows[:, None] + g[None, :], mask=s_mask, other=0)
    else:
        s = _load_scales(s_rows[:, None] + g[None, :], s_mask, BF16_SCALES)
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
def _mma_order_tile(x_rows, row_mask, w_rows, s_rows, n_mask, K, kt_lo, kt_hi, G: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, PACKED: tl.constexpr,
                    EVEN_K: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr):
    """MMA_ORDER: float32 acc^T [BLOCK_N, BLOCK_M] over 128-element K blocks kt_lo..kt_hi-1, the weight's words in the
    MMA order of int4_layout.mma_order_words (word 4c + j of a block holds the elements its MMA thread needs), one
    block per step (_mma_step). PEEL (set with PDL by tile_config, and kept in the interpreter, which drops PDL): the
    first block's words and scales (constant data) load before the PDL wait, so that their DRAM latency overlaps the
    end of the kernel before; x and everything after come after the wait."""
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if not PEEL:
        _grid_wait(PDL)
    else:
        # an explicit SPLIT_K may leave the last splits empty: their peeled step reads the last block and is dropped
        kt0 = tl.minimum(kt_lo, kt_hi - 1)
        words, s = _mma_weights(w_rows, s_rows, n_mask, kt0, K, G, BF16_SCALES, PACKED, EVEN_K)
        _grid_wait(PDL)
        step = _mma_step(acc_t, words, s, _mma_x(x_rows, row_mask, kt0, K, EVEN_K), BLOCK_N, IEEE, PACKED)
        acc_t = tl.where(kt_lo < kt_hi, step, acc_t)
        kt_lo += 1
    for kt in range(kt_lo, kt_hi):
        words, s = _mma_weights(w_rows, s_rows, n_mask, kt, K, G, BF16_SCALES, PACKED, EVEN_K)
        acc_t = _mma_step(acc_t, words, s, _mma_x(x_rows, row_mask, kt, K, EVEN_K), BLOCK_N, IEEE, PACKED)
    return tl.trans(acc_t)


@triton.jit
def _int4_tile(x_ptr, rows, row_mask, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, offs_n, n_mask, K, kt_lo, kt_hi,
               G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr, SCALE_GROUPS: tl.constexpr,
               PACKED: tl.constexpr, EVEN_K: tl.constexpr, X_WIDE: tl.constexpr, PREFETCH: tl.constexpr,
               CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr, MMA_ORDER: tl.constexpr, PEEL: tl.constexpr,
               PDL: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N] = x[rows, k] @ W[offs_n, k]^T over K tiles kt_lo..kt_hi-1 of one W4A16 weight.

    The loops count K tiles (k0 = kt * BLOCK_K) so that the compiler sees word offsets divisible by the tile
    and vectorises the loads and pipelines them (an offset from a runtime start hid that). X_PLANES: x rows are stored plane-major (x[8i + e] at
    e * K/8 + i), so each plane's loads are contiguous and vectorise; otherwise they are stride-8 gathers.
    X_WIDE (instead of X_PLANES): x in natural order, each word's 8 elements one 16-byte load, split into the
    planes in registers (no plane-major copy of x before the launch).
    PREFETCH (the one-row path, with X_WIDE and SCALE_GROUPS): the next K tile's weight words, x and scales are
    loaded before this tile's arithmetic (registers double-buffered by hand), so a program's DRAM reads overlap
    its dequantisation instead of alternating with it. CODES_ASM (PREFETCH, GPU only): codes by _f32_codes.
    BIASED_CODES (PREFETCH): codes as 1 + u/128 and one correction per group (_F32_BIASED_ASM's comment).
    PDL: _grid_wait before the first read of x (the one-row PREFETCH path loads its first weight tile before it).
    SCALE_GROUPS (one-row path): sum each group's words before scaling, loading [BLOCK_N, groups] scales
    instead of one per word. PACKED (tensor-core path, bf16 x and scales): dequantize with _bf16_planes.
    MMA_ORDER (tensor cores, BLOCK_K 128): the weight's words in the MMA order (_mma_order_tile), x as it is.

    w_ptr: the packed bytes read as int32 words (row stride stride_wn words); word i of a row holds
    elements 8i .. 8i+7, element 8i+e in bits 4e..4e+3, all in group (8i) // G.
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
    w_rows = w_ptr + n_rows * stride_wn
    s_rows = s_ptr + n_rows * stride_sn
    if not (PREFETCH or MMA_ORDER):
        _grid_wait(PDL)
    if MMA_ORDER:
        return _mma_order_tile(x_rows, row_mask, w_rows, s_rows, n_mask, K, kt_lo, kt_hi, G, BLOCK_M, BLOCK_N,
                               BF16_SCALES, IEEE, PACKED, EVEN_K, PEEL, PDL)
    elif BLOCK_M == 1:
        # one row: multiply-and-add on CUDA cores, partial sums reduced once at the end
        GROUPS: tl.constexpr = WORDS // WORDS_PER_GROUP
        if SCALE_GROUPS:
            acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        if PREFETCH:    # the first tile's weights before the wait: with PDL they load while the last kernel ends
            words_n, s_n = _row_weight_loads(w_rows, s_rows, kt_lo, kt_hi, K, k_words, G, WORDS, BF16_SCALES, EVEN_K)
            _grid_wait(PDL)
            xv_n = _row_x_loads(x_rows, kt_lo, kt_hi, k_words, WORDS, EVEN_K)
        else:
            _grid_wait(PDL)
        for kt in range(kt_lo, kt_hi):
            if PREFETCH:
                words, xv, s = words_n, xv_n, s_n
                words_n, xv_n, s_n = _row_loads(w_rows, s_rows, x_rows, kt + 1, kt_hi, K, k_words, G, WORDS,
                                                BF16_SCALES, EVEN_K)
                acc += _row_part(words, xv, s, BLOCK_N, GROUPS, WORDS_PER_GROUP, CODES_ASM, BIASED_CODES)
            else:
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
        if BIASED_CODES:
            acc *= 128.0     # exact: a power of two
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
def _k_range(K, pid_k, SPLIT_K, BLOCK_K: tl.constexpr):
    """K tiles [kt_lo, kt_hi) of split pid_k: the tiles dealt out in contiguous runs (the last runs may be empty)."""
    tiles = tl.cdiv(K, BLOCK_K)
    run = tl.cdiv(tiles, SPLIT_K)
    kt_lo = pid_k * run
    return kt_lo, tl.minimum(kt_lo + run, tiles)


@triton.jit
def _split_arrive(acc, ws_ptr, tile, pid_k, mask, SPLIT_K, PARTS: tl.constexpr,
                  part, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write this split's float32 partial `part` (of PARTS per split) of output tile `tile` to the workspace."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = ws_ptr + (tile.to(tl.int64) * SPLIT_K * PARTS + pid_k * PARTS + part) * (BLOCK_M * BLOCK_N)
    tl.store(base + offs, acc, mask=mask)


@triton.jit
def _split_is_last(cnt_ptr, tile, ARRIVALS):
    """Count this program's arrival at `tile`; true for the last of ARRIVALS, which then resets the counter."""
    tl.debug_barrier()      # every thread's partial is stored before the release below
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return done == ARRIVALS - 1


@triton.jit
def _split_sum(ws_ptr, tile, mask, SPLIT_K: tl.constexpr, PARTS: tl.constexpr, part: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of the SPLIT_K partials `part` of `tile`, in split order (L2 reads: other SMs wrote them). SPLIT_K is
    a compile-time constant so the loop unrolls and the SPLIT_K loads are in flight together (a runtime loop
    waited on each in turn)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(SPLIT_K):
        base = ws_ptr + (tile.to(tl.int64) * SPLIT_K * PARTS + k * PARTS + part) * (BLOCK_M * BLOCK_N)
        total += tl.load(base + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, BF16_SCALES: tl.constexpr, IEEE: tl.constexpr, X_PLANES: tl.constexpr,
                  SCALE_GROUPS: tl.constexpr, PACKED: tl.constexpr, EVEN_K: tl.constexpr, X_WIDE: tl.constexpr,
                  PREFETCH: tl.constexpr, CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr,
                  MMA_ORDER: tl.constexpr, PEEL: tl.constexpr, PDL: tl.constexpr):
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
        if _split_is_last(cnt_ptr, tile, SPLIT_K):
            total = _split_sum(ws_ptr, tile, out_mask, SPLIT_K, 1, 0, BLOCK_M, BLOCK_N)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + tile, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_buffers(device, tiles: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 workspace of `floats`, int32 arrival counters for `tiles` tiles, all zero between launches).
    The counters are allocated once per device (keep the first call outside CUDA-graph capture)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return torch.empty(floats, dtype=torch.float32, device=device), counters


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
    cfg = tile_config(config or pick_config(dense_configs(weight.k, weight.n, x.dtype), m), weight.group_size,
                      interpreting(), x.device)
    bf16_scales = weight.scales.dtype == torch.bfloat16
    scales = weight.scales.view(torch.int16) if bf16_scales else weight.scales
    if cfg["MMA_ORDER"]:
        if weight.mma is None:
            raise ValueError(f"w4a16_linear: config {cfg} reads the weight's MMA-order words, which this weight "
                             f"[{weight.n}, {weight.k}] was packed without (pack_for_gpu(..., mma_order=True))")
        words = weight.mma
    else:
        words = weight.packed.view(torch.int32)
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
    return out
