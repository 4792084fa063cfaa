"""INT4 codes to numbers, in registers: the conversions every W4A16 path shares (docs/w4a16-kernels.md, "How they
compute"). A packed weight is read as little-endian int32 words: word i holds elements 8i .. 8i+7, element 8i+e in bits
4e..4e+3 (`docs/int4-format.md`), all in one scale group since G is a multiple of 8, so a word's 8 codes share one
scale. Codes are made without an int-to-float conversion: by the magic-number add (_code), by PTX that makes two
bfloat16 weights per instruction for the tensor cores (_bf16_planes), or by `prmt` into float32 for the one-row GEMV
(_f32_codes, and the biased codes 1 + u/128 of _biased8)."""

from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _per_word(s, WORDS_PER_GROUP: tl.constexpr):
    """Group scales [groups, n] repeated to one per word: [groups * WORDS_PER_GROUP, n]."""
    return tl.reshape(tl.broadcast_to(s[:, None, :], [s.shape[0], WORDS_PER_GROUP, s.shape[1]]),
                      [s.shape[0] * WORDS_PER_GROUP, s.shape[1]])


@triton.jit
def _scaled_planes(words, s, like):
    """The 8 planes q_e * s of int32 words dequantised in float32 and cast to like's dtype (float32/float16 x,
    float32 scales, the interpreter; PACKED makes them with _bf16_planes)."""
    return ((_code(words, 0) * s).to(like.dtype), (_code(words, 1) * s).to(like.dtype),
            (_code(words, 2) * s).to(like.dtype), (_code(words, 3) * s).to(like.dtype),
            (_code(words, 4) * s).to(like.dtype), (_code(words, 5) * s).to(like.dtype),
            (_code(words, 6) * s).to(like.dtype), (_code(words, 7) * s).to(like.dtype))


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


@triton.jit
def _codes8(words, CODES_ASM: tl.constexpr):
    """The 8 codes of int32 words as float32: by prmt (CODES_ASM) or shift, mask and magic number (_code)."""
    if CODES_ASM:
        return _f32_codes(words)
    else:
        return (_code(words, 0), _code(words, 1), _code(words, 2), _code(words, 3), _code(words, 4),
                _code(words, 5), _code(words, 6), _code(words, 7))


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
