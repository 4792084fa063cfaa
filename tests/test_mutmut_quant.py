"""INT4 quantization and packing: behaviour that mutmut (tools/mutmut.sh quant) found unchecked."""

import numpy as np
import pytest

from k2vec.model.int4 import (MAX_SCALE, SCALE_DIVISOR, QuantError, bf16_bits, dequantize, pack, quantize,
                         quantize_packed, unpack)


def test_bf16_bits_of_float64_input_rounds_the_float32_value():
    # a Python list (float64) is converted first: one uint16 per element, not one per 4 bytes
    assert bf16_bits([1.0, -2.5, 3.0e38]).tolist() == [0x3F80, 0xC020, 0x7F62]


def test_bf16_bits_keeps_nan_quiet_without_adding_payload():
    nans = np.array([0x7FC00000, 0xFF800001, 0x7F800001], np.uint32).view(np.float32)
    # the top 16 bits of each NaN with the quiet bit set: never inf (0x7F80), never a new payload bit
    assert bf16_bits(nans).tolist() == [0x7FC0, 0xFFC0, 0x7FC0]


def test_group_size_must_be_an_integer():
    w = np.zeros((2, 64), np.float32)
    for bad in (32.0, np.float32(64), "32"):
        with pytest.raises(QuantError, match=r"group_size must be one of \(32, 64, 128\).*got "):
            quantize(w, group_size=bad)


def test_defaults_are_group_32_float32_scales():
    w = np.random.default_rng(5).standard_normal((3, 128)).astype(np.float32)
    codes, scales = quantize(w, 32, "float32")
    packed, packed_scales = quantize_packed(w)
    assert np.array_equal(packed, pack(codes)) and np.array_equal(packed_scales, scales)
    assert scales.shape == (3, 4)
    assert np.array_equal(dequantize(codes, scales), dequantize(codes, scales, 32))


def test_errors_name_the_tensor_and_its_problem():
    cases = [
        (lambda: quantize([[0.0] * 32]), "weight must be a numpy array, got list"),
        (lambda: quantize(np.zeros((2, 32), np.float64)),
         "weight must have dtype float32 (native byte order), got float64; convert it explicitly, "
         "e.g. .astype(np.float32)"),
        (lambda: quantize(np.zeros((0, 32), np.float32)), "weight is empty (shape (0, 32)); nothing to quantize"),
        (lambda: pack(np.zeros((2, 4), np.int16)), "codes must have dtype int8"),
        (lambda: pack(np.zeros(4, np.int8)), "codes must be 2-D"),
        (lambda: unpack(np.zeros((2, 4), np.int8)), "packed must have dtype uint8"),
        (lambda: unpack(np.zeros((2, 4), np.uint8), k=10),
         "packed shape (2, 4) holds K=8 codes per row, expected K=10"),
        (lambda: dequantize(np.zeros((2, 64), np.int16), np.zeros((2, 2), np.float32)), "codes must have dtype int8"),
        (lambda: dequantize(np.zeros((2, 64), np.int8), np.zeros((2, 2), np.float64)),
         "scales must have dtype float32"),
        (lambda: dequantize(np.zeros((2, 64), np.int8), np.zeros((2, 3), np.float32), 32),
         "scales shape (2, 3) does not match codes (2, 64) with group_size 32: expected (2, 2)"),
        (lambda: dequantize(np.zeros((2, 48), np.int8), np.zeros((2, 1), np.float32), 32),
         "with group_size 32: expected (2, K/g)"),
    ]
    for fn, message in cases:
        with pytest.raises(QuantError) as exc:
            fn()
        assert message in str(exc.value)


@pytest.mark.parametrize("fill", [-8, 7])
def test_out_of_range_code_is_located_past_in_range_extremes(fill):
    # -8 and 7 are valid codes: the first invalid one is reported, not the first extreme one
    codes = np.full((3, 8), fill, np.int8)
    codes[2, 5] = -9 if fill == 7 else 8
    with pytest.raises(QuantError, match=r"codes\[2, 5\] = " + str(codes[2, 5])):
        pack(codes)
    codes[2, 5] = fill
    codes[1, 6] = 9
    with pytest.raises(QuantError, match=r"codes\[1, 6\] = 9"):
        pack(codes)


def test_largest_finite_scale_is_accepted_and_one_ulp_more_is_not():
    top = np.float32(MAX_SCALE * SCALE_DIVISOR)  # |w| whose scale is exactly MAX_SCALE
    w = np.zeros((3, 32), np.float32)
    w[2, 0] = -top
    codes, scales = quantize(w)
    assert scales[2, 0] == MAX_SCALE and codes[2, 0] == -8
    assert np.isfinite(dequantize(codes, scales)).all()
    w[2, 0] = -np.nextafter(top, np.float32(np.inf))
    with pytest.raises(QuantError, match=r"weight rows 0\.\.2 hold \|w\| up to 3\.19015e\+38: code\*scale "
                                         r"would overflow float32 \(max \|w\| is 3\.19015e\+38\)"):
        quantize(w)


def test_subnormal_group_clips_codes_below_minus_8():
    # absmax = 11 subnormal ulps: absmax / 7.5 rounds to a scale of 1 ulp, so w / scale = -11, clipped to -8
    ulp = np.array([1], np.uint32).view(np.float32)[0]  # the smallest subnormal
    w = np.zeros((1, 32), np.float32)
    w[0, :2] = np.float32(-11) * ulp, np.float32(5) * ulp
    codes, scales = quantize(w)
    assert scales[0, 0] == ulp
    assert codes[0, :3].tolist() == [-8, 5, 0]
    packed, _ = quantize_packed(w)
    assert np.array_equal(packed, pack(codes))
