"""Our INT4 codes, scales, bytes and export against compressed-tensors' own code (0.20.1)."""

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors.torch import load_file

from k2vec.model.checkpoint import Checkpoint
from k2vec.model.int4_checkpoint import load_dequantized
from k2vec.stages.export_compressed_tensors import export_compressed_tensors
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.model.int4 import dequantize, pack, pack_int32, quantize, round_to_bf16
from support.ct_checkpoint import module_tree
from test_quant import make_fp32_checkpoint, make_spec, worked_example


def ct_args(group_size, scale_dtype):
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size,
                            scale_dtype=torch.bfloat16 if scale_dtype == "bfloat16" else None)


def awkward_weight(seed=0):
    """Random rows with varied magnitudes plus the edge cases: zero group, huge value, exact ends, ties."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((24, 256)) * rng.uniform(1e-4, 50, (24, 1))).astype(np.float32)
    w[0, :128] = 0
    w[1, 5] = 1e30
    w[2, :2] = [7.5, -7.5]
    w[3, :2] = [8.0, -8.0]
    w[4:6, :64] = worked_example()
    w[6, :32] = np.arange(-16, 16) / np.float32(2)  # absmax 8, halves
    w[7, :2] = [1.0, np.float32(6.5) * np.float32(0.1337890625)]  # bf16-vs-float32 division witness
    w[8, :4] = np.float32(2.0**-149) * np.array([1, -2, 3, -4], np.float32)  # subnormal scales
    w[9, :128:32] = np.float32(7.5) * np.array([1 + 2**-8, -1 - 3 * 2**-8, 1 + 2**-7, 3], np.float32)  # bf16 ties
    return w


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_ct_packer_gives_our_bytes(group_size):
    rng = np.random.default_rng(group_size)
    codes = rng.integers(-8, 8, (16, 4 * group_size)).astype(np.int8)
    codes[0, :16] = np.arange(-8, 8)
    words = pack_to_int32(torch.from_numpy(codes), 4)
    assert words.dtype == torch.int32 and tuple(words.shape) == (16, codes.shape[1] // 8)
    assert words.numpy().astype("<i4").tobytes() == pack(codes).tobytes()
    assert np.array_equal(words.numpy(), pack_int32(codes))
    back = unpack_from_int32(torch.from_numpy(pack_int32(codes)), 4, torch.Size(codes.shape))
    assert np.array_equal(back.numpy(), codes)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_ct_quantize_gives_our_codes_and_scales(group_size, scale_dtype):
    w = awkward_weight(group_size)
    args = ct_args(group_size, scale_dtype)
    x = torch.from_numpy(w)
    # compressed-tensors' own grouping + calculate_qparams (the dynamic path reshapes into groups itself)
    scale, zp = compute_dynamic_scales_and_zp(x, args, module=None)
    q = ct_quantize(x, scale, zp, args, dtype=torch.int8)
    codes, scales = quantize(w, group_size, scale_dtype)
    assert scale.dtype == torch.float32 and not zp.any()
    assert np.array_equal(scale.numpy(), scales)
    assert np.array_equal(q.numpy(), codes)
    # and its compressor turns the weight into our packed words
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = PackedQuantizationCompressor.compress({"weight": x, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    assert set(out) == {"weight_packed", "weight_scale", "weight_shape"}
    assert out["weight_packed"].numpy().astype("<i4").tobytes() == pack(codes).tobytes()
    assert out["weight_shape"].tolist() == list(w.shape)


def test_ct_sees_minus_absmax_as_minus_7_when_the_scale_rounds_up():
    w = np.zeros((1, 32), np.float32)
    w[0, :2] = [-8.0, 8.0]
    args = ct_args(32, "float32")
    scale, zp = compute_dynamic_scales_and_zp(torch.from_numpy(w), args, module=None)
    q = ct_quantize(torch.from_numpy(w), scale, zp, args, dtype=torch.int8)
    assert q[0, :2].tolist() == [-7, 7] == quantize(w)[0][0, :2].tolist()


@pytest.mark.parametrize("scheme,group_size,scale_dtype", [
    ("default", 32, "float32"), ("k2-checkpoint", 32, "bfloat16"), ("default", 128, "bfloat16"),
    ("default", 64, "float32")])
def test_ct_decompresses_our_export(tmp_path, scheme, group_size, scale_dtype):
    fp32 = make_fp32_checkpoint(tmp_path / "fp32")
    spec = make_spec(fp32, scheme, group_size, scale_dtype)
    quantize_checkpoint(fp32, tmp_path / "int4", spec)
    config = export_compressed_tensors(fp32, tmp_path / "int4", tmp_path / "ct")
    src = Checkpoint(fp32)
    exported = Checkpoint(tmp_path / "ct")

    # compressed-tensors parses our quantization_config and, over modules named like the checkpoint,
    # selects exactly the modules we quantized
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    model = module_tree({n: tuple(src[n].shape) for n in src})
    apply_quantization_config(model, qconfig, show_progress=False)
    selected = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "quantization_scheme", None)}
    assert selected == set(spec["tensors"])

    # its loading path: compress (creates the packed parameters), load our tensors, decompress
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    # the shards are read by the safetensors library itself (its header and offset checks included)
    state = {}
    for shard in sorted(set(exported.weight_map.values())):
        state.update(load_file(str(tmp_path / "ct" / shard)))
    assert set(state) == set(exported.weight_map)
    scale_dtype_torch = torch.bfloat16 if scale_dtype == "bfloat16" else torch.float32
    assert all(state[n].dtype == scale_dtype_torch for n in state if n.endswith(".weight_scale"))
    assert all(state[n].dtype == torch.int32 for n in state if n.endswith(".weight_packed"))
    model.load_state_dict(state, strict=True, assign=True)
    compressor.decompress_model(model)

    modules = dict(model.named_modules())
    for name in spec["tensors"]:
        ours = load_dequantized(tmp_path / "int4", name)
        theirs = modules[name[: -len(".weight")]].weight.detach()
        if scale_dtype == "float32":
            assert theirs.dtype == torch.float32
            assert np.array_equal(theirs.numpy().view(np.uint32), ours.view(np.uint32))
        else:
            # compressed-tensors multiplies in the scale dtype: bf16(code * scale); ours is that product
            # exact in float32, so one bf16 rounding of ours must equal theirs bit for bit ...
            assert theirs.dtype == torch.bfloat16
            assert np.array_equal(theirs.view(torch.int16).numpy().view(np.uint16),
                                  (round_to_bf16(ours).view(np.uint32) >> 16).astype(np.uint16))
            # ... and its dequantize with the scale widened to float32 gives ours exactly
            prefix = name[: -len(".weight")]
            codes = unpack_from_int32(state[prefix + ".weight_packed"], 4,
                                      torch.Size(state[prefix + ".weight_shape"].tolist()))
            args = qconfig.config_groups["group_0"].weights
            wide = ct_dequantize(codes, state[prefix + ".weight_scale"].float(), args=args)
            assert np.array_equal(wide.numpy().view(np.uint32), ours.view(np.uint32))
        codes, scales = quantize(np.array(src[name]), group_size, scale_dtype)
        assert np.array_equal(ours, dequantize(codes, scales, group_size))
    for name in src:
        if name not in spec["tensors"]:
            assert np.array_equal(model.get_parameter(name).detach().numpy(), src[name])
