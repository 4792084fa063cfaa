"""INT4 W4A16 weight quantization: symmetric, one scale per group of `group_size` inputs (vectorised numpy).

The rule is compressed-tensors' (0.20.1: `calculate_qparams`, `forward._quantize`, pack-quantized), so
its own code reproduces our codes, scales and bytes exactly (tests/test_compressed_tensors.py):

  absmax = max |w| over a (row, group of `group_size` consecutive columns)  (min<=0<=max clamp: same value)
  scale  = float32(absmax / 7.5)                7.5 = (qmax - qmin) / 2 for the range [-8, 7]
  scale  = bf16_round(scale)                    only for scale_dtype "bfloat16", BEFORE the division
  scale  = eps if scale == 0                    eps of the scale dtype: 2**-23 (float32), 2**-7 (bfloat16)
  q      = round_half_even(clip(w / scale, -8, 7))   division in float32

+absmax maps to ~7.5 and always ends at 7 (clip). -absmax maps to -7.5 -> -8 (half to even) when the
float32 scale is exact or rounded down, but to -7.4999995 -> -7 when float32(absmax / 7.5) rounded up
(absmax 8, say); compressed-tensors does the same, so -8 occurs in some groups only.
Packing ("int4-offset8-lownibble-first"): u = q + 8 in 0..15; byte j of a row holds element 2j in its low
nibble and 2j+1 in its high nibble. Those bytes are the little-endian bytes of compressed-tensors' int32
`weight_packed` words (element 0 in the lowest nibble of word 0). See docs/int4-format.md.
"""

from __future__ import annotations

import numpy as np

from k2vec.errors import K2VecError

BITS = 4
QMIN, QMAX = -8, 7
GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = ("float32", "bfloat16")
SCALE_DIVISOR = np.float32((QMAX - QMIN) / 2)  # 7.5
# compressed-tensors replaces a zero scale by torch.finfo(scale_dtype).eps, after the bf16 rounding.
ZERO_SCALE = {"float32": np.float32(2.0**-23), "bfloat16": np.float32(2.0**-7)}
PACKING = "int4-offset8-lownibble-first"
# |code| <= 8, so code * scale stays finite for every scale up to this bound.
MAX_SCALE = np.float32(np.finfo(np.float32).max / 8)
# Rows per block are chosen so that a block holds about this many elements. The workspaces (a few
# buffers of this size, allocated once per call) stay in cache, and the ~25 numpy calls a block costs
# are amortised; 2**16 is 20% slower, 2**20 40% slower (bench/quantize.py, 2-core EPYC).
BLOCK_ELEMENTS = 1 << 18


class QuantError(K2VecError):
    """Invalid input to quantization, packing or an int4 checkpoint; the message says what to change."""


# ------------------------------------------------------------------------------------------- bf16


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, like torch's `.to(torch.bfloat16)`."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    # adding 0x7FFF plus the lowest kept bit, then truncating, rounds half to even; the carry
    # into the exponent is correct rounding (up to inf above the bf16 max).
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a (quiet) NaN instead of letting the rounding carry turn it into inf/0
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return r


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise QuantError(f"bfloat16 bits must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    return from_bf16_bits(bf16_bits(x))


# ------------------------------------------------------------------------------------- validation


def _check_group_size(group_size: object) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size not in GROUP_SIZES:
        raise QuantError(f"group_size must be one of {GROUP_SIZES} (compressed-tensors/Marlin INT4 groups), "
                         f"got {group_size!r}")
    return int(group_size)


def _check_scale_dtype(scale_dtype: object) -> str:
    if scale_dtype not in SCALE_DTYPES:
        raise QuantError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    return str(scale_dtype)


def _check_matrix(a: object, what: str, dtype: type) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise QuantError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise QuantError(f"{what} must have dtype {np.dtype(dtype)} (native byte order), got {a.dtype}; "
                         f"convert it explicitly, e.g. .astype(np.{np.dtype(dtype).name})")
    if a.ndim != 2:
        raise QuantError(f"{what} must be 2-D [N, K] (out_features, in_features), got shape {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise QuantError(f"{what} is empty (shape {a.shape}); nothing to quantize")
    return a


def _check_weight(w: object, group_size: int) -> np.ndarray:
    w = _check_matrix(w, "weight", np.float32)
    if w.shape[1] % group_size:
        raise QuantError(f"weight shape {w.shape}: K={w.shape[1]} is not divisible by group_size {group_size}; "
                         f"choose a group size dividing K")
    return w


# --------------------------------------------------------------------------------- quantize (core)


def _round_bf16_inplace(x: np.ndarray) -> None:
    """Round finite non-negative float32 values to bfloat16 in place (RNE), without temporaries' overhead."""
    u = x.view(np.uint32)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    u += lsb
    u += np.uint32(0x7FFF)
    u &= np.uint32(0xFFFF0000)


def _run(w: np.ndarray, group_size: int, scale_dtype: str,
         codes_out: np.ndarray | None, packed_out: np.ndarray | None) -> np.ndarray:
    """Quantize `w` block by block into `codes_out` [N, K] int8 and/or `packed_out` [N, K/2] uint8; return scales."""
    n_rows, k = w.shape
    groups = k // group_size
    rows = max(1, BLOCK_ELEMENTS // k)
    cap = min(rows, n_rows) * k
    pad = group_size
    # Workspaces, reused by every block (zeroed so the shifted reads past a block's end see defined
    # values; those reads only feed window positions that are not group starts). |w| is kept as int32
    # bits: for non-negative floats the integer order is the float order, and an integer max is a
    # plain SIMD max (a float max adds NaN handling); NaN/inf have the largest bits (>= 0x7F800000).
    a = np.zeros(cap + pad, np.int32)
    b = np.zeros(cap + pad, np.int32)
    qa = np.zeros(cap // 4 + pad, np.int32)
    qb = np.zeros(cap // 4 + pad, np.int32)
    am = np.empty(cap // group_size, np.int32)
    c = np.empty(cap, np.int8)  # codes of a block when the caller wants only packed bytes
    lanes = np.empty(cap // 8, "<u8")  # packing workspaces (little-endian: read back as "<u2" pairs)
    lanes2 = np.empty(cap // 8, "<u8")
    scales = np.empty((n_rows, groups), np.float32)
    zero = ZERO_SCALE[scale_dtype]
    gq = group_size // 4
    quarter_shifts = tuple(1 << i for i in range(1, group_size.bit_length() - 3))  # 2, 4, ..., g/8

    def views(size: int) -> tuple:
        # Slicing costs about as much as a small ufunc call, and a block makes ~20 calls: build the
        # views once per block size (all blocks but the last share one).
        q = size // 4
        steps = []
        src, dst = qa, qb
        for s in quarter_shifts:
            steps.append((src[:q], src[s:q + s], dst[:q]))
            src, dst = dst, src
        return (a[:size], a[1:size + 1], b[:size], b[2:size + 2], a[0:size:4], a[4:size + 4:4], qa[:q], steps,
                src[:q:gq], am[:size // group_size],
                a[:size].view(np.float32), c[:size], lanes[:size // 8], lanes2[:size // 8])

    cache: dict[int, tuple] = {}
    for r0 in range(0, n_rows, rows):
        r1 = min(n_rows, r0 + rows)
        size = (r1 - r0) * k
        if size not in cache:
            cache[size] = views(size)
        (a0, a1, b0, b2, a_4, a4_4, q0, steps, q_starts, amv, y, cb, t, t2) = cache[size]
        x = np.ascontiguousarray(w[r0:r1]).reshape(size)

        # absmax per group by sliding-window maxima: after the steps below, position i holds the max of
        # |w[i : i + window]|, so each group start holds its group's absmax. Every step is one pass of
        # plain numpy (SIMD, no per-group call); a reduction over a 32-long axis costs one call per
        # group and is 3x slower. Windows 2 and 4 run at full length, then one strided step keeps every
        # 4th position (window 8) and the doublings up to group_size run on a quarter of the data.
        np.bitwise_and(x.view(np.int32), np.int32(0x7FFFFFFF), out=a0)
        np.maximum(a0, a1, out=b0)
        np.maximum(b0, b2, out=a0)
        np.maximum(a_4, a4_4, out=q0)
        for lo, hi, out in steps:
            np.maximum(lo, hi, out=out)
        np.copyto(amv, q_starts)
        if amv.max() >= 0x7F800000:
            i = int(np.argmax(amv >= 0x7F800000))
            r, gi = r0 + i // groups, i % groups
            raise QuantError(f"weight[{r}, {gi * group_size}:{(gi + 1) * group_size}] contains NaN or inf; "
                             f"only finite weights can be quantized")

        sc = scales[r0:r1].reshape(-1)
        np.divide(amv.view(np.float32), SCALE_DIVISOR, out=sc)
        if scale_dtype == "bfloat16":
            _round_bf16_inplace(sc)
        sc[sc == 0] = zero
        if sc.max() > MAX_SCALE:
            raise QuantError(f"weight rows {r0}..{r1 - 1} hold |w| up to {float(amv.view(np.float32).max()):.6g}: "
                             f"code*scale would overflow float32 (max |w| is {float(MAX_SCALE * SCALE_DIVISOR):.6g})")

        # q = rint(clip(w / scale)), w / scale written over `a` (free now: fewer cache lines in use).
        # The per-element scale comes from np.repeat: dividing by a broadcast [n, groups, 1] scale costs
        # one call per group (2x slower). Clipping to integer bounds commutes with rounding, so the int8
        # codes are clipped instead of the floats (4x less data); the cast cannot wrap because
        # |w / scale| <= ~11.25 for every finite input (a subnormal scale is still >= ~2/3 of
        # absmax/7.5; a scale that rounds to 0 becomes eps).
        np.divide(x, np.repeat(sc, group_size), out=y)
        np.rint(y, out=y)
        if codes_out is not None:
            cb = codes_out[r0:r1].reshape(size)
        np.copyto(cb, y, casting="unsafe")
        np.clip(cb, QMIN, QMAX, out=cb)
        if packed_out is not None:
            _pack_flat(cb, packed_out[r0:r1].reshape(size // 2), t, t2)
    return scales


def quantize(w: np.ndarray, group_size: int = 32, scale_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float32 [N, K] weight: (codes int8 [N, K] in [-8, 7], scales float32 [N, K/group_size]).

    With scale_dtype "bfloat16" the scales hold bf16-representable values (as float32)."""
    group_size = _check_group_size(group_size)
    scale_dtype = _check_scale_dtype(scale_dtype)
    w = _check_weight(w, group_size)
    codes = np.empty(w.shape, np.int8)
    scales = _run(w, group_size, scale_dtype, codes, None)
    return codes, scales


def quantize_packed(w: np.ndarray, group_size: int = 32,
                    scale_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """`pack(quantize(w)[0]), quantize(w)[1]` in one blocked pass (no [N, K] int8 intermediate)."""
    group_size = _check_group_size(group_size)
    scale_dtype = _check_scale_dtype(scale_dtype)
    w = _check_weight(w, group_size)
    packed = np.empty((w.shape[0], w.shape[1] // 2), np.uint8)
    scales = _run(w, group_size, scale_dtype, None, packed)
    return packed, scales


# --------------------------------------------------------------------------------------- packing


def _pack_flat(codes: np.ndarray, out: np.ndarray, t: np.ndarray | None = None,
               t2: np.ndarray | None = None) -> None:
    """Pack a flat int8 code array (even length, values in [-8, 7]) into `out` (uint8, half the length).

    `t`, `t2`: optional "<u8" workspaces of codes.size // 8 elements (for a length divisible by 8)."""
    # View 8 (or 2) codes as one little-endian integer: code 2j is byte 2j. Keep each byte's low
    # nibble, flip its top bit (q ^ 8 == q + 8 for a 4-bit two's-complement q), then OR each odd
    # byte's nibble, shifted down 4, into the even byte below it. The even bytes are the packed bytes.
    if codes.size % 8 == 0:
        v = codes.view("<u8")
        mask, flip, four = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0808080808080808), np.uint64(4)
    else:
        v = codes.view("<u2")
        mask, flip, four = np.uint16(0x0F0F), np.uint16(0x0808), np.uint16(4)
    if t is None or t.dtype != v.dtype:
        t, t2 = np.empty(v.size, v.dtype), np.empty(v.size, v.dtype)
    np.bitwise_and(v, mask, out=t)
    np.bitwise_xor(t, flip, out=t)
    np.right_shift(t, four, out=t2)
    np.bitwise_or(t, t2, out=t)
    np.copyto(out, t.view("<u2"), casting="unsafe")  # keep the low (even) byte of every pair


def pack(codes: np.ndarray) -> np.ndarray:
    """int8 codes [N, K] in [-8, 7] -> uint8 [N, K/2]: u = q + 8, element 2j low nibble, 2j+1 high nibble."""
    codes = _check_matrix(codes, "codes", np.int8)
    if codes.shape[1] % 2:
        raise QuantError(f"codes shape {codes.shape}: K must be even to pack two 4-bit codes per byte")
    lo, hi = int(codes.min()), int(codes.max())
    if lo < QMIN or hi > QMAX:
        bad = np.argwhere((codes < QMIN) | (codes > QMAX))[0]
        raise QuantError(f"codes out of the int4 range [{QMIN}, {QMAX}]: codes[{bad[0]}, {bad[1]}] = "
                         f"{int(codes[bad[0], bad[1]])}")
    codes = np.ascontiguousarray(codes)
    out = np.empty((codes.shape[0], codes.shape[1] // 2), np.uint8)
    _pack_flat(codes.reshape(-1), out.reshape(-1))
    return out


def unpack(packed: np.ndarray, k: int | None = None) -> np.ndarray:
    """uint8 [N, K/2] -> int8 codes [N, K] in [-8, 7] (inverse of `pack`); `k`, if given, is checked."""
    packed = _check_matrix(packed, "packed", np.uint8)
    if k is not None and k != 2 * packed.shape[1]:
        raise QuantError(f"packed shape {packed.shape} holds K={2 * packed.shape[1]} codes per row, expected K={k}")
    t = np.ascontiguousarray(packed).astype("<u2")
    # byte b = lo | hi << 4  ->  16-bit lane lo | hi << 8, i.e. bytes (lo, hi) = (u[2j], u[2j+1]).
    t |= t << np.uint16(4)
    t &= np.uint16(0x0F0F)
    codes = t.view(np.int8).reshape(packed.shape[0], 2 * packed.shape[1])
    codes -= np.int8(8)
    return codes


def pack_int32(codes: np.ndarray) -> np.ndarray:
    """int32 [N, K/8]: compressed-tensors' `weight_packed` words, i.e. `pack(codes)` read as little-endian int32."""
    if isinstance(codes, np.ndarray) and codes.ndim == 2 and codes.shape[1] % 8:
        raise QuantError(f"codes shape {codes.shape}: K must be a multiple of 8 to fill int32 words")
    return pack(codes).view("<i4").astype(np.int32, copy=False)


def dequantize(codes: np.ndarray, scales: np.ndarray, group_size: int = 32) -> np.ndarray:
    """float32 [N, K] = code * scale of its group, one float32 multiply per element.

    With bf16 scales the product is exact: a code has at most 3 significant bits (|q| <= 8), a bf16
    scale 8, and float32 holds 24, so any kernel that widens code and scale to fp32 gets these bits.
    With float32 scales it is the one correctly rounded IEEE product (up to 27 bits rounded to 24),
    identical to compressed-tensors' `x_q.to(float32) * scale`."""
    group_size = _check_group_size(group_size)
    codes = _check_matrix(codes, "codes", np.int8)
    scales = _check_matrix(scales, "scales", np.float32)
    n, k = codes.shape
    if k % group_size or scales.shape != (n, k // group_size):
        raise QuantError(f"scales shape {scales.shape} does not match codes {codes.shape} with group_size "
                         f"{group_size}: expected ({n}, {k // group_size if k % group_size == 0 else 'K/g'})")
    out = codes.astype(np.float32).reshape(n, k // group_size, group_size)
    out *= scales[:, :, None]
    return out.reshape(n, k)
