"""INT4 quantization core (k2vec.model.int4) and the quantize stage (k2vec.model.int4_checkpoint)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from k2vec.model.checkpoint import Checkpoint, write_shards
from k2vec.model.int4_checkpoint import load_dequantized, open_int4
from k2vec.stages.export_compressed_tensors import export_compressed_tensors
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.model.int4 import (QuantError, bf16_bits, dequantize, from_bf16_bits, pack, pack_int32, quantize,
                         quantize_packed, round_to_bf16, unpack)
from k2vec.model.schemes import SCHEMES, is_quantized

EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7}


def reference(w, g, scale_dtype):
    """The rule written out plainly (per group, no blocking, no bit tricks)."""
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    scales = (np.maximum(-groups.min(axis=2), groups.max(axis=2)).clip(min=0) / np.float32(7.5)).astype(np.float32)
    if scale_dtype == "bfloat16":
        scales = round_to_bf16(scales)
    scales[scales == 0] = EPS[scale_dtype]
    codes = np.rint(np.clip(groups / scales[:, :, None], -8, 7)).astype(np.int8).reshape(n, k)
    return codes, scales


def worked_example():
    """docs/int4-format.md: row 0 = (k - 32) / 4; row 1 = 0 for k < 32, (k - 62) / 4 for k >= 32."""
    k = np.arange(64, dtype=np.float32)
    w = np.zeros((2, 64), np.float32)
    w[0] = (k - 32) / 4
    w[1, 32:] = (k[32:] - 62) / 4
    return w


WORKED_QW_HEX = ("11112122323343444455556666777788889899a9aababbcbccdcddedeefeffff"
                 "8888888888888888888888888888888810112222323344445455666676778888")


# ------------------------------------------------------------------------------------ packing


def test_pack_every_code_pair():
    lo, hi = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), indexing="ij")  # every (even, odd) pair
    codes = np.stack([lo.ravel(), hi.ravel()], axis=1).reshape(8, 64).astype(np.int8)
    packed = pack(codes)
    assert packed.shape == (8, 32) and packed.dtype == np.uint8
    expected = ((codes[:, 0::2].astype(np.int32) + 8) | ((codes[:, 1::2].astype(np.int32) + 8) << 4))
    assert np.array_equal(packed, expected.astype(np.uint8))
    assert sorted(packed.ravel().tolist()) == list(range(256))  # a bijection on bytes
    assert np.array_equal(unpack(packed), codes)
    assert np.array_equal(unpack(packed, 64), codes)
    # int32 words: element j of the word at bits 4j..4j+3
    words = pack_int32(codes)
    assert words.shape == (8, 8) and words.dtype == np.int32
    u = (codes.astype(np.int64) + 8).reshape(8, 8, 8)
    expect_words = (u << (4 * np.arange(8))).sum(axis=2)
    assert np.array_equal(words.view(np.uint32).astype(np.int64), expect_words)


def test_pack_round_trip_random_and_odd_sizes():
    rng = np.random.default_rng(3)
    for shape in [(1, 2), (3, 6), (5, 34), (7, 4096)]:  # sizes not multiple of 8 take the 16-bit path
        codes = rng.integers(-8, 8, shape).astype(np.int8)
        packed = pack(codes)
        assert np.array_equal(unpack(packed), codes)
        assert np.array_equal(packed & 0xF, codes[:, 0::2] + 8)
        assert np.array_equal(packed >> 4, codes[:, 1::2] + 8)


def test_pack_accepts_non_contiguous_codes():
    codes = np.random.default_rng(4).integers(-8, 8, (4, 128)).astype(np.int8)
    assert np.array_equal(pack(codes[:, :64]), pack(np.ascontiguousarray(codes[:, :64])))


def test_worked_example_bytes():
    w = worked_example()
    codes, scales = quantize(w, 32, "float32")
    assert scales.view(np.uint32).tolist() == [[0x3F888889, 0x3F844444], [0x34000000, 0x3F800000]]
    assert pack(codes).tobytes().hex() == WORKED_QW_HEX
    packed, scales2 = quantize_packed(w, 32, "float32")
    assert packed.tobytes().hex() == WORKED_QW_HEX and np.array_equal(scales2, scales)
    assert pack_int32(codes)[0, :2].tolist() == [0x22211111, 0x44433332]
    # bf16 scales round up here (1.0703125, 1.03125) and leave these codes unchanged
    codes_bf, scales_bf = quantize(w, 32, "bfloat16")
    assert scales_bf.tolist() == [[1.0703125, 1.03125], [0.0078125, 1.0]]
    assert pack(codes_bf).tobytes().hex() == WORKED_QW_HEX


# ----------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_quantize_matches_plain_rule_and_error_bound(g, scale_dtype):
    rng = np.random.default_rng(g)
    w = (rng.standard_normal((37, 1024)) * rng.uniform(1e-3, 30, (37, 1))).astype(np.float32)
    codes, scales = quantize(w, g, scale_dtype)
    ref_codes, ref_scales = reference(w, g, scale_dtype)
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (37, 1024 // g)
    assert np.array_equal(scales, ref_scales) and np.array_equal(codes, ref_codes)
    assert codes.min() == -8 and codes.max() == 7
    if scale_dtype == "bfloat16":
        assert np.array_equal(round_to_bf16(scales), scales)
    deq = dequantize(codes, scales, g)
    s = np.repeat(scales, g, axis=1).astype(np.float64)
    err = np.abs(w.astype(np.float64) - deq)
    absmax = np.repeat(np.abs(w).reshape(37, -1, g).max(axis=2), g, axis=1).astype(np.float64)
    # half a step, except that the top is clipped to 7: there the error grows by the scale's rounding
    clip_excess = np.maximum(0, absmax - 7.5 * s)
    assert np.all(err <= 0.5 * s * (1 + 2**-20) + clip_excess)
    inner = np.abs(w) < 7 * s
    assert np.all(err[inner] <= 0.5 * s[inner] * (1 + 2**-20))
    packed, scales2 = quantize_packed(w, g, scale_dtype)
    assert np.array_equal(packed, pack(codes)) and np.array_equal(scales2, scales)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_each_group_gets_its_own_scale(g):
    n, k = 3, 4 * g
    w = np.full((n, k), 0.01, np.float32)
    rng = np.random.default_rng(0)
    for r in range(n):
        for j in range(k // g):
            w[r, j * g + rng.integers(g)] = (-1) ** j * (1 + j + 10 * r)  # absmax 1 + j + 10 r, at a random column
    codes, scales = quantize(w, g)
    expected = (np.arange(k // g)[None, :] + 1 + 10 * np.arange(n)[:, None]).astype(np.float32) / np.float32(7.5)
    assert np.array_equal(scales, expected)


def test_absmax_ends_of_the_range():
    # scale exactly absmax/7.5 (absmax 7.5 -> 1, 15 -> 2): +absmax -> 7.5 -> clipped to 7; -absmax -> -7.5 -> -8
    w = np.zeros((2, 64), np.float32)
    w[0, 3], w[0, 5] = 7.5, -7.5
    w[1, 40] = -15.0
    w[1, 41] = 15.0
    codes, scales = quantize(w, 32)
    assert scales.tolist() == [[1.0, EPS["float32"]], [EPS["float32"], 2.0]]
    assert (codes[0, 3], codes[0, 5], codes[1, 40], codes[1, 41]) == (7, -8, -8, 7)
    # when float32(absmax / 7.5) rounds UP, -absmax / scale lands just above -7.5 and gives -7
    # (absmax 8: scale 1.0666667 > 8/7.5, -8/scale = -7.4999995): -8 appears only in some groups
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = -8.0, 8.0
    codes, scales = quantize(w, 32)
    assert scales[0, 0] > np.float64(8) / 7.5
    assert (codes[0, 0], codes[0, 1]) == (-7, 7)


def test_zero_group_and_huge_value_group():
    for scale_dtype in ("float32", "bfloat16"):
        w = np.zeros((2, 64), np.float32)
        w[1, :32] = np.linspace(-1, 1, 32, dtype=np.float32)
        w[1, 7] = 1e30  # one huge value: the others flush to 0
        codes, scales = quantize(w, 32, scale_dtype)
        # all-zero group: scale = eps of the scale dtype (compressed-tensors), codes 0, dequantized 0
        assert scales[0, 0] == scales[0, 1] == scales[1, 1] == np.float32(EPS[scale_dtype])
        assert not codes[0].any() and not codes[1, 32:].any()
        big = np.float32(1e30) / np.float32(7.5)
        assert scales[1, 0] == (round_to_bf16(big) if scale_dtype == "bfloat16" else big)
        assert codes[1, 7] == 7 and np.count_nonzero(codes[1, :32]) == 1
        deq = dequantize(codes, scales, 32)
        assert np.all(np.isfinite(deq)) and not deq[0].any()
        assert deq[1, 7] == np.float32(7) * scales[1, 0]


def test_tiny_subnormal_weights_stay_in_range():
    tiny = np.float32(2.0**-149)
    w = np.zeros((2, 32), np.float32)
    w[0, :4] = [tiny, -2 * tiny, 3 * tiny, -4 * tiny]  # absmax/7.5 is subnormal: scale rounds to 2**-149
    w[1, :2] = [tiny, -tiny]                            # absmax/7.5 rounds to 0 -> eps
    for scale_dtype in ("float32", "bfloat16"):
        codes, scales = quantize(w, 32, scale_dtype)
        ref_codes, ref_scales = reference(w, 32, scale_dtype)
        assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)
        assert codes.min() >= -8 and codes.max() <= 7
    codes, scales = quantize(w, 32, "float32")
    assert scales[0, 0] == tiny and codes[0, :4].tolist() == [1, -2, 3, -4]
    assert scales[1, 0] == np.float32(EPS["float32"]) and not codes[1].any()


def test_bf16_scale_is_rounded_before_the_division():
    s32 = np.float32(1) / np.float32(7.5)        # 0.13333334 (0x3E088889)
    s16 = round_to_bf16(np.array([s32]))[0]      # 0.13378906 (0x3E09): rounds up
    assert s16 == np.float32(0.1337890625)
    x = np.float32(6.5) * s16                   # exactly 6.5 bf16 steps; 6.522 float32 steps
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 1.0, x
    codes, scales = quantize(w, 32, "bfloat16")
    assert scales[0, 0] == s16
    assert codes[0, 1] == 6                      # rint(6.5) = 6 (half to even), dividing by the bf16 scale
    assert np.rint(x / s32) == 7                 # dividing by the float32 scale would give 7
    codes32, _ = quantize(w, 32, "float32")
    assert codes32[0, 1] == 7


def test_bf16_scale_ties_round_to_even():
    # absmax / 7.5 = 1 + 2**-8 and 1 + 3 * 2**-8 exactly: halfway between two bf16 values
    w = np.zeros((1, 64), np.float32)
    w[0, 0] = np.float32(7.5) * np.float32(1 + 2**-8)
    w[0, 32] = -np.float32(7.5) * np.float32(1 + 3 * 2**-8)
    _, scales32 = quantize(w, 32, "float32")
    assert scales32.tolist() == [[1 + 2**-8, 1 + 3 * 2**-8]]
    _, scales = quantize(w, 32, "bfloat16")
    assert scales.tolist() == [[1.0, 1 + 4 * 2**-8]]


def test_bf16_bits_round_half_to_even():
    vals = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -1.5, 0.0, -0.0, np.inf],
                    np.float32)
    bits = bf16_bits(vals)
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBFC0, 0x0000, 0x8000, 0x7F80]
    assert from_bf16_bits(bits).tolist() == [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -1.5, 0.0, -0.0, np.inf]
    assert np.isnan(from_bf16_bits(bf16_bits(np.array([np.nan], np.float32))))[0]


def test_dequantize_is_code_times_scale():
    codes = np.arange(-8, 8, dtype=np.int8).repeat(2).reshape(1, 32)
    scales = np.array([[0.1]], np.float32)
    assert np.array_equal(dequantize(codes, scales, 32), codes.astype(np.float32) * np.float32(0.1))


def test_bad_inputs_name_the_problem():
    w = np.zeros((4, 64), np.float32)
    cases = [
        (lambda: quantize(w.astype(np.float64)), "float32"),
        (lambda: quantize(w.astype(">f4")), "float32"),
        (lambda: quantize(w[0]), "2-D"),
        (lambda: quantize(np.zeros((4, 0), np.float32)), "empty"),
        (lambda: quantize(np.zeros((4, 48), np.float32)), "not divisible by group_size 32"),
        (lambda: quantize(w, group_size=64 + 1), "group_size must be one of"),
        (lambda: quantize(w, group_size=16), "group_size must be one of"),
        (lambda: quantize(w, group_size=True), "group_size must be one of"),
        (lambda: quantize(w, scale_dtype="float16"), "scale_dtype must be one of"),
        (lambda: quantize(w.tolist()), "numpy array"),
        (lambda: pack(np.zeros((2, 3), np.int8)), "even"),
        (lambda: pack(np.full((2, 4), 8, np.int8)), "codes[0, 0] = 8"),
        (lambda: pack(np.zeros((2, 4), np.int16)), "int8"),
        (lambda: pack_int32(np.zeros((2, 4), np.int8)), "multiple of 8"),
        (lambda: unpack(np.zeros((2, 4), np.int8)), "uint8"),
        (lambda: unpack(np.zeros((2, 4), np.uint8), k=10), "expected K=10"),
        (lambda: dequantize(np.zeros((2, 64), np.int8), np.zeros((2, 3), np.float32), 32), "does not match"),
        (lambda: from_bf16_bits(np.zeros(2, np.int32)), "uint16"),
    ]
    for fn, words in cases:
        with pytest.raises(QuantError, match=None) as exc:
            fn()
        assert words in str(exc.value), (words, str(exc.value))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_located(bad):
    w = np.zeros((3, 64), np.float32)
    w[2, 40] = bad
    with pytest.raises(QuantError, match=r"weight\[2, 32:64\] contains NaN or inf"):
        quantize(w)


def test_overflowing_magnitude_is_rejected():
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = np.finfo(np.float32).max
    with pytest.raises(QuantError, match="overflow"):
        quantize(w)


def test_blocks_cover_many_rows_and_long_rows(monkeypatch):
    import k2vec.model.int4 as q
    rng = np.random.default_rng(9)
    w = rng.standard_normal((70, 512)).astype(np.float32)
    monkeypatch.setattr(q, "BLOCK_ELEMENTS", 3 * 512)  # 3 rows per block, a short last block
    codes, scales = quantize(w, 32)
    ref_codes, ref_scales = reference(w, 32, "float32")
    assert np.array_equal(codes, ref_codes) and np.array_equal(scales, ref_scales)
    monkeypatch.setattr(q, "BLOCK_ELEMENTS", 100)     # fewer than one row: one row per block
    packed, scales = quantize_packed(w, 128, "bfloat16")
    ref_codes, ref_scales = reference(w, 128, "bfloat16")
    assert np.array_equal(packed, pack(ref_codes)) and np.array_equal(scales, ref_scales)


# ------------------------------------------------------------------------------ quantize stage

H, I, DENSE, E, V = 256, 128, 128, 4, 32


def fp32_tensors(seed=0):
    """A small DeepSeek-V3-like fp32 checkpoint: layer 0 dense, layer 1 MoE (2 experts kept), top level."""
    rng = np.random.default_rng(seed)

    def t(*shape, std=0.05):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    layer0 = {
        "model.layers.0.input_layernorm.weight": np.ones(H, np.float32),
        "model.layers.0.self_attn.q_a_proj.weight": t(64, H),
        "model.layers.0.mlp.gate_proj.weight": t(DENSE, H),
        "model.layers.0.mlp.up_proj.weight": t(DENSE, H),
        "model.layers.0.mlp.down_proj.weight": t(H, DENSE),
    }
    layer1 = {
        "model.layers.1.mlp.gate.weight": t(E, H),
        "model.layers.1.mlp.gate.e_score_correction_bias": t(E),
        "model.layers.1.mlp.shared_experts.down_proj.weight": t(H, I),
    }
    for e in range(2):
        layer1[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = t(I, H)
        layer1[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = t(I, H)
        layer1[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = t(H, I)
    down = layer1["model.layers.1.mlp.experts.1.down_proj.weight"]
    down[3, :128] = 0           # all-zero groups (eps scales) for every group size
    down[5, 7] = 40.0           # one huge value
    down[6, 0], down[6, 1] = 7.5, -7.5   # exact ends of the range
    top = {"model.embed_tokens.weight": t(V, H), "model.norm.weight": np.ones(H, np.float32),
           "lm_head.weight": t(V, H)}
    return [layer0, layer1, top]


def make_fp32_checkpoint(path: Path, seed=0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shards = fp32_tensors(seed)
    write_shards(path, [list(s.items()) for s in shards], len(shards))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
              "moe_intermediate_size": I, "intermediate_size": DENSE, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text('{"do_sample": false}\n')
    return path


def make_spec(ckpt_dir: Path, scheme="default", group_size=32, scale_dtype="float32") -> dict:
    targets, ignore = SCHEMES[scheme]["targets"], SCHEMES[scheme]["ignore"]
    ckpt = Checkpoint(ckpt_dir)
    tensors = {n: list(ckpt[n].shape) for n in ckpt if is_quantized(n, targets, ignore)}
    return {"scheme": scheme, "targets": list(targets), "ignore": list(ignore), "bits": 4, "symmetric": True,
            "group_size": group_size, "scale_dtype": scale_dtype, "tensors": tensors}


def read_dir(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory) -> Path:
    return make_fp32_checkpoint(tmp_path_factory.mktemp("ckpt") / "fp32")


@pytest.mark.parametrize("scheme,g,scale_dtype", [("default", 32, "float32"), ("k2-checkpoint", 128, "bfloat16"),
                                                  ("default", 64, "bfloat16")])
def test_quantize_checkpoint_files_and_index(fp32_dir, tmp_path, scheme, g, scale_dtype):
    spec = make_spec(fp32_dir, scheme, g, scale_dtype)
    out = tmp_path / "int4"
    index = quantize_checkpoint(fp32_dir, out, spec)
    ckpt = Checkpoint(fp32_dir)
    assert json.loads((out / "index.json").read_text()) == index
    assert set(index["tensors"]) == set(spec["tensors"])
    assert set(index["unquantized"]["tensors"]) == set(ckpt) - set(spec["tensors"])
    assert index["unquantized"]["location"] == "fp32 checkpoint"
    expected_files = {"index.json"} | {f"{n}{ext}" for n in spec["tensors"] for ext in (".qw", ".sc")}
    assert {p.name for p in out.iterdir()} == expected_files
    for name, entry in index["tensors"].items():
        w = np.array(ckpt[name])
        codes, scales = reference(w, g, scale_dtype)
        qw = (out / f"{name}.qw").read_bytes()
        sc = (out / f"{name}.sc").read_bytes()
        assert qw == pack(codes).tobytes()
        if scale_dtype == "bfloat16":
            assert sc == bf16_bits(scales).astype("<u2").tobytes()
        else:
            assert sc == scales.astype("<f4").tobytes()
        n, k = w.shape
        assert entry["shape"] == [n, k] and entry["group_size"] == g and entry["scale_dtype"] == scale_dtype
        assert entry["packing"] == "int4-offset8-lownibble-first"
        assert entry["qweight"] == {"file": f"{name}.qw", "dtype": "uint8", "shape": [n, k // 2], "nbytes": len(qw),
                                    "sha256": hashlib.sha256(qw).hexdigest()}
        assert entry["scales"]["shape"] == [n, k // g] and entry["scales"]["nbytes"] == len(sc)
        assert entry["scales"]["sha256"] == hashlib.sha256(sc).hexdigest()
        assert np.array_equal(load_dequantized(out, name), dequantize(codes, scales, g))
        t = open_int4(out)[name]
        assert np.array_equal(t.codes(), codes) and np.array_equal(t.scales, scales)
    open_int4(out).verify()


def test_quantize_checkpoint_is_deterministic(fp32_dir, tmp_path):
    spec = make_spec(fp32_dir, "default", 32, "bfloat16")
    quantize_checkpoint(fp32_dir, tmp_path / "a", spec)
    # same inputs, tensor order of the spec shuffled: identical bytes
    spec2 = dict(spec, tensors=dict(reversed(list(spec["tensors"].items()))))
    quantize_checkpoint(fp32_dir, tmp_path / "b", spec2)
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b")


def test_quantize_checkpoint_rejects_bad_specs(fp32_dir, tmp_path):
    good = make_spec(fp32_dir)
    expert = "model.layers.1.mlp.experts.0.down_proj.weight"
    cases = [
        (dict(good, group_size=48), "group_size"),
        (dict(good, scale_dtype="float16"), "scale_dtype"),
        (dict(good, bits=8), "only 4-bit"),
        (dict(good, symmetric=False), "only symmetric"),
        ({k: v for k, v in good.items() if k != "ignore"}, "missing keys ['ignore']"),
        (dict(good, extra=1), "unknown keys ['extra']"),
        (dict(good, tensors={**good["tensors"], "model.layers.9.mlp.up_proj.weight": [4, 64]}), "missing from"),
        (dict(good, tensors={k: v for k, v in good["tensors"].items() if k != expert}), "selected but not listed"),
        (dict(good, tensors={**good["tensors"], expert: [256, 256]}), "the spec expects float32 [256, 256]"),
        (dict(good, tensors={**good["tensors"], expert: [256, 80]}), "not divisible by group_size"),
        (dict(good, tensors={}), "non-empty"),
    ]
    for spec, words in cases:
        with pytest.raises(QuantError) as exc:
            quantize_checkpoint(fp32_dir, tmp_path / "out", spec)
        assert words in str(exc.value), (words, str(exc.value))
        assert not (tmp_path / "out").exists()


def test_open_int4_detects_damage(fp32_dir, tmp_path):
    out = tmp_path / "int4"
    quantize_checkpoint(fp32_dir, out, make_spec(fp32_dir))
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    qw = out / f"{name}.qw"
    data = bytearray(qw.read_bytes())
    data[0] ^= 0xFF
    qw.write_bytes(bytes(data))
    with pytest.raises(QuantError, match="sha256"):
        open_int4(out).verify()
    qw.write_bytes(bytes(data[:-1]))
    with pytest.raises(QuantError, match="truncated"):
        open_int4(out)[name]
    with pytest.raises(QuantError, match="unquantized"):
        load_dequantized(out, "model.norm.weight")
    with pytest.raises(QuantError, match="not an int4 directory"):
        open_int4(tmp_path)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_export_layout(fp32_dir, tmp_path, scale_dtype):
    spec = make_spec(fp32_dir, "k2-checkpoint", 32, scale_dtype)
    quantize_checkpoint(fp32_dir, tmp_path / "int4", spec)
    config = export_compressed_tensors(fp32_dir, tmp_path / "int4", tmp_path / "ct")
    ckpt, out = Checkpoint(fp32_dir), Checkpoint(tmp_path / "ct")
    assert out.config == config and json.loads((tmp_path / "ct" / "config.json").read_text()) == config
    assert (tmp_path / "ct" / "generation_config.json").read_text() == '{"do_sample": false}\n'
    assert sorted(set(out.weight_map.values())) == sorted(set(ckpt.weight_map.values()))
    qc = config["quantization_config"]
    assert {k: config[k] for k in ckpt.config} == ckpt.config
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", "compressed")
    assert qc["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False,
        "observer": "minmax", "observer_kwargs": {}, "actorder": None, "block_structure": None}
    # every Linear that is not quantized, by exact module name; the router (mlp.gate) is not a Linear
    assert qc["ignore"] == sorted([
        "lm_head", "model.layers.0.self_attn.q_a_proj", "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.shared_experts.down_proj"])
    for name in ckpt:
        prefix = name[: -len(".weight")]
        if name in spec["tensors"]:
            codes, scales = reference(np.array(ckpt[name]), 32, scale_dtype)
            assert out[prefix + ".weight_packed"].dtype == np.int32
            assert np.array_equal(out[prefix + ".weight_packed"], pack_int32(codes))
            got = out[prefix + ".weight_scale"]
            if scale_dtype == "bfloat16":
                assert got.dtype == np.uint16 and np.array_equal(from_bf16_bits(got), scales)  # stored as BF16
            else:
                assert got.dtype == np.float32 and np.array_equal(got, scales)
            assert out[prefix + ".weight_shape"].tolist() == list(ckpt[name].shape)
            assert name not in out
        else:
            assert out[name].dtype == np.float32 and np.array_equal(out[name], ckpt[name])
    if scale_dtype == "float32":  # numpy has no bfloat16; the torch reader is used in test_compressed_tensors
        from safetensors.numpy import load_file
        for shard in set(out.weight_map.values()):
            for name, arr in load_file(str(tmp_path / "ct" / shard)).items():
                assert out.weight_map[name] == shard and np.array_equal(arr, out[name])
    # a second export is byte-identical
    export_compressed_tensors(fp32_dir, tmp_path / "int4", tmp_path / "ct2")
    assert read_dir(tmp_path / "ct") == read_dir(tmp_path / "ct2")


def test_export_refuses_a_foreign_int4_dir(fp32_dir, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    write_shards(small, [[("model.layers.0.mlp.up_proj.weight", np.zeros((4, 64), np.float32))]], 1)
    (small / "config.json").write_text("{}")
    quantize_checkpoint(small, tmp_path / "int4", {
        "scheme": "default", "targets": ["Linear"], "ignore": [], "bits": 4, "symmetric": True, "group_size": 32,
        "scale_dtype": "float32", "tensors": {"model.layers.0.mlp.up_proj.weight": [4, 64]}})
    with pytest.raises(QuantError, match="was not made from"):
        export_compressed_tensors(fp32_dir, tmp_path / "int4", tmp_path / "ct")
    assert not (tmp_path / "ct").exists()
