"""A DeepseekV3/Kimi-K2-shaped checkpoint written by compressed-tensors' own compressor (for import tests).

The synthetic model's weights (k2vec.stages.weights, rounded to bfloat16 as a released checkpoint stores them)
are loaded into a module tree named like the checkpoint, compressed-tensors' quantization config is
applied (Kimi K2 Thinking's ignore list: routed experts only), each quantized module gets its
compressed-tensors min-max scale (`compute_dynamic_scales_and_zp`), and `ModelCompressor.compress_model`
packs it. The state dict is saved shard by shard (a decoder layer per shard, HF names, an index without
hashes) and `ModelCompressor.update_config` writes the quantization_config into config.json.
"""

import json
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors.torch import save_file

from k2vec.model.architecture import hf_config, tensor_shapes
from k2vec.model.checkpoint import INDEX_NAME
from k2vec.model.schemes import SCHEMES, is_linear
from k2vec.config.presets import PRESETS
from k2vec.model.checkpoint import shard_groups
from k2vec.stages.weights import make_tensor


def arch(preset="tiny", **overrides) -> dict:
    return {"name": "source", "preset": preset, **PRESETS[preset], **overrides}


def quantization_config(group_size=32) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                "dynamic": False, "observer": "minmax"}}},
            "ignore": list(SCHEMES["k2-checkpoint"]["ignore"])}


def module_tree(shapes: dict, device: str = "cpu") -> torch.nn.Module:
    """nn.Linear (no bias) for every Linear module's weight, plain frozen parameters for everything else
    (router, norms, biases): the module tree compressed-tensors quantizes and compresses."""
    root = torch.nn.Module()

    def module_at(path):
        mod = root
        for part in path.split(".") if path else []:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        return mod

    for name, shape in shapes.items():
        parent, _, leaf = name.rpartition(".")
        if leaf == "weight" and is_linear(parent):
            grand, _, last = parent.rpartition(".")
            module_at(grand).add_module(last, torch.nn.Linear(shape[1], shape[0], bias=False, device=device))
        else:
            module_at(parent).register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, device=device),
                                                                          requires_grad=False))
    return root


def write_ct_checkpoint(path: Path, model: dict, group_size=32) -> Path:
    """The compressed-tensors checkpoint of synthetic `model` (a resolved spec dict), in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(model)
    groups = shard_groups(model)
    (path / "config.json").write_text(json.dumps({**hf_config(model), "model_type": "kimi_k2",
                                                  "torch_dtype": "bfloat16"}, indent=2))
    qconfig = QuantizationConfig.model_validate(quantization_config(group_size))
    compressor = None
    weight_map = {}
    for i, names in enumerate(groups):
        # one shard's modules at a time: the tree holds only what is being compressed
        tree = module_tree({n: shapes[n] for n in names}, device="meta")
        for n in names:
            value = torch.from_numpy(make_tensor(model, n, shapes[n]))
            if not n.endswith("e_score_correction_bias"):
                value = value.to(torch.bfloat16)  # the router bias stays float32, as in Kimi K2
            mod_name, _, leaf = n.rpartition(".")
            mod = tree.get_submodule(mod_name)
            setattr(mod, leaf, torch.nn.Parameter(value, requires_grad=False))
        qconfig.quantization_status = QuantizationStatus.INITIALIZED
        apply_quantization_config(tree, qconfig, show_progress=False)
        for _, mod in tree.named_modules():
            scheme = getattr(mod, "quantization_scheme", None)
            if scheme is not None:
                scale, zp = compute_dynamic_scales_and_zp(mod.weight, scheme.weights, module=mod)
                mod.weight_scale.data = scale
                mod.weight_zero_point.data = zp
        compressor = ModelCompressor(quantization_config=qconfig)
        compressor.compress_model(tree)
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {k: v.contiguous() for k, v in tree.state_dict().items()}
        save_file(state, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in state})
        del tree, state
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                              indent=2))
    compressor.update_config(str(path))
    return path
