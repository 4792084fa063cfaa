"""A model entry with `checkpoint:` resolved from the user's checkpoint: its architecture, its quantization, the files
its slice reads (docs/checkpoint-import.md)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from k2vec.errors import ConfigError, K2VecError
from k2vec.model.architecture import ARCH_KEYS, tensor_shapes
from k2vec.model.checkpoint import INDEX_NAME, check_weight_map
from k2vec.model.int4 import BITS, GROUP_SIZES

ENTRY_KEYS = ("checkpoint", "layers", "experts", "num_experts_per_tok")
SCHEME = "checkpoint"  # the quantization section's scheme for an imported model
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Defaults of DeepseekV3Config for keys a checkpoint's config.json may leave out.
_CONFIG_DEFAULTS = {"n_shared_experts": 0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                    "q_lora_rank": None, "rope_scaling": None, "routed_scaling_factor": 1.0,
                    "norm_topk_prob": False}
# Integer settings of config.json that the slice divides by or counts with (n_group 0 once raised a bare
# ZeroDivisionError while the config was read); the rest are checked on the slice like a preset's.
_POSITIVE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                  "n_group", "topk_group")
_NON_NEGATIVE_KEYS = ("n_shared_experts", "first_k_dense_replace")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.*)$")


class CheckpointImportError(K2VecError):
    """A source checkpoint that cannot be imported as it is; the message names the file and tensor."""


def is_import(entry: Any) -> bool:
    return isinstance(entry, Mapping) and "checkpoint" in entry


# ------------------------------------------------------------------------------- config (parse time)


def _read_json(path: Path, key: str) -> dict:
    if not path.is_file():
        raise ConfigError(key, f"{path} does not exist; the checkpoint directory needs config.json and {INDEX_NAME}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{path} is not readable JSON: {err}") from None


def _source_arch(cfg: dict, cfg_path: Path, key: str) -> dict[str, Any]:
    """The ARCH_KEYS of a DeepseekV3/Kimi-K2 config.json (legacy `rope_scaling` or HF 5 `rope_parameters`)."""
    if "text_config" in cfg:
        raise ConfigError(key, f"{cfg_path} nests the text model in text_config (a multimodal checkpoint); "
                               f"only DeepseekV3/Kimi-K2 text checkpoints with top-level settings are supported")
    if cfg.get("model_type") not in MODEL_TYPES:
        raise ConfigError(key, f"{cfg_path}: model_type {cfg.get('model_type')!r}, expected one of {MODEL_TYPES}")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(key, f"{cfg_path}: moe_layer_freq {cfg['moe_layer_freq']} (only 1 is implemented)")
    cfg = dict(cfg)
    rp = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(rp, Mapping):
        cfg["rope_theta"] = rp.get("rope_theta")
        if rp.get("rope_type") == "yarn":
            cfg["rope_scaling"] = dict(rp)
    arch = {}
    for k in ARCH_KEYS:
        if k in cfg:
            arch[k] = cfg[k]
        elif k in _CONFIG_DEFAULTS:
            arch[k] = _CONFIG_DEFAULTS[k]
        else:
            raise ConfigError(key, f"{cfg_path} has no {k!r}")
    for k in _POSITIVE_KEYS + _NON_NEGATIVE_KEYS:
        v, least = arch[k], 1 if k in _POSITIVE_KEYS else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ConfigError(key, f"{cfg_path}: {k} {v!r} is not an integer >= {least}")
    E, G = arch["n_routed_experts"], arch["n_group"]
    if E % G:
        raise ConfigError(key, f"{cfg_path}: n_group {G} does not divide n_routed_experts {E}")
    if arch["topk_group"] > G:
        raise ConfigError(key, f"{cfg_path}: topk_group {arch['topk_group']} exceeds n_group {G}")
    rs = arch["rope_scaling"]
    if rs is not None and not isinstance(rs, Mapping):
        raise ConfigError(key, f"{cfg_path}: rope_scaling {rs!r} is not an object")
    if rs is not None:
        if (rs.get("type") or rs.get("rope_type")) != "yarn":
            raise ConfigError(key, f"{cfg_path}: rope_scaling {rs!r} is not YaRN (the only scaling implemented)")
        if rs.get("truncate", True) is not True:
            raise ConfigError(key, f"{cfg_path}: rope_scaling.truncate false (YaRN without the integer ramp bounds) "
                                   f"is not implemented")
        # written back by architecture.hf_config with rope_type and truncate, as for a synthetic model
        arch["rope_scaling"] = {"type": "yarn", **{k: rs[k] for k in _YARN_KEYS if k in rs and "type" not in k}}
    return arch


def _quant_group(cfg: dict, cfg_path: Path, key: str) -> dict[str, Any]:
    """The one weight config group of a compressed-tensors pack-quantized symmetric INT4 quantization_config."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "compressed-tensors":
        raise ConfigError(key, f"{cfg_path}: no compressed-tensors quantization_config; the import takes "
                               f"checkpoints whose experts are pack-quantized INT4")
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    formats = {g.get("format") or qc.get("format") for g in groups}
    if len(groups) != 1 or formats != {"pack-quantized"}:
        raise ConfigError(key, f"{cfg_path}: quantization_config needs exactly one weight group in format "
                               f"pack-quantized, found {len(groups)} in {sorted(map(str, formats))}")
    w = groups[0]["weights"]
    want = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group"}
    bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
    if bad or w.get("actorder") not in (None, False) or w.get("group_size") not in GROUP_SIZES:
        raise ConfigError(key, f"{cfg_path}: quantization_config weights {bad or w!r}: only symmetric INT4 "
                               f"groups of {GROUP_SIZES} without act-order are implemented")
    return {"targets": list(groups[0].get("targets") or []), "ignore": list(qc.get("ignore") or []),
            "group_size": int(w["group_size"])}


def _int_list(value: Any, key: str, what: str) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ConfigError(key, f"must be a non-empty list of {what} indices (non-negative integers), got {value!r}")
    if value != sorted(set(value)):
        raise ConfigError(key, f"list each {what} once, in ascending order (the slice keeps the source "
                               f"order), got {value}")
    return value


def resolve_import(name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture of the slice an import entry names (HF key names), plus `source`: where it comes
    from (absolute directory, kept source layers and experts). Reads config.json and the index only."""
    key = f"models.{name}"
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key of a checkpoint import; known: {list(ENTRY_KEYS)}")
    if not isinstance(entry["checkpoint"], str) or not entry["checkpoint"]:
        raise ConfigError(f"{key}.checkpoint", f"must be a directory path, got {entry['checkpoint']!r}")
    directory = Path(os.path.abspath(entry["checkpoint"]))
    if not directory.is_dir():
        raise ConfigError(f"{key}.checkpoint", f"{directory} is not a directory")
    cfg_path = directory / "config.json"
    cfg = _read_json(cfg_path, f"{key}.checkpoint")
    src = _source_arch(cfg, cfg_path, f"{key}.checkpoint")
    group = _quant_group(cfg, cfg_path, f"{key}.checkpoint")
    if "layers" not in entry:
        raise ConfigError(f"{key}.layers", "name the source layers to keep, e.g. layers: [0, 3]")
    layers = _int_list(entry["layers"], f"{key}.layers", "layer")
    L = src["num_hidden_layers"]
    if layers[-1] >= L:
        raise ConfigError(f"{key}.layers", f"layer {layers[-1]} is out of range: {cfg_path} has num_hidden_layers "
                                           f"{L} (layers 0..{L - 1})")
    E, G = src["n_routed_experts"], src["n_group"]
    experts = _int_list(entry.get("experts", list(range(E))), f"{key}.experts", "expert")
    if experts[-1] >= E:
        raise ConfigError(f"{key}.experts", f"expert {experts[-1]} is out of range: {cfg_path} has "
                                            f"n_routed_experts {E} (experts 0..{E - 1})")
    # Expert groups: the source's groups that hold kept experts, each holding the same number (>= 2).
    per_group = E // G
    held = np.bincount(np.asarray(experts) // per_group, minlength=G)
    counts = sorted(set(held[held > 0].tolist()))
    if len(counts) != 1 or counts[0] < 2:
        raise ConfigError(f"{key}.experts", f"the source has {G} expert groups of {per_group} "
                                            f"(n_group {G}); keep the same number (at least 2) of experts in every "
                                            f"group you keep experts from, got {held.tolist()} per group")
    n_group = int((held > 0).sum())
    topk_group = min(src["topk_group"], n_group)
    top_k = entry.get("num_experts_per_tok", min(src["num_experts_per_tok"], topk_group * counts[0]))
    dense = sum(1 for i in layers if i < src["first_k_dense_replace"])
    if dense == len(layers):
        raise ConfigError(f"{key}.layers", f"layers {layers} are all dense (first_k_dense_replace "
                                           f"{src['first_k_dense_replace']} in {cfg_path}): keep at least one MoE "
                                           f"layer, whose INT4 experts the int4 precision is about")
    return {**src, "num_hidden_layers": len(layers), "first_k_dense_replace": dense,
            "n_routed_experts": len(experts), "n_group": n_group, "topk_group": topk_group,
            "num_experts_per_tok": top_k,
            "source": {"checkpoint": str(directory), "layers": list(layers), "experts": list(experts),
                       "n_routed_experts": E, "quantization": group}}


def source_name(model: Mapping[str, Any], name: str) -> str:
    """The source checkpoint's name of slice tensor `name` (layer and expert indices mapped back)."""
    m = _LAYER.match(name)
    if not m:
        return name
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.{model['source']['experts'][int(e.group(1))]}.{e.group(2)}"
    return f"model.layers.{model['source']['layers'][int(m.group(1))]}.{rest}"


def module_of(name: str) -> str | None:
    return name[: -len(".weight")] if name.endswith(".weight") else None


def weight_map_of(model: Mapping[str, Any]) -> tuple[Path, dict[str, str]]:
    directory = Path(model["source"]["checkpoint"])
    path = directory / INDEX_NAME
    if not path.is_file():
        raise CheckpointImportError(f"{path} does not exist: the checkpoint has no safetensors index")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointImportError(f"{path}: not a safetensors index with a weight_map ({err})") from None
    return path, check_weight_map(index, path, CheckpointImportError)


def resolve_import_quantization(model: Mapping[str, Any]) -> dict[str, Any]:
    """The quantization section of an imported model: the slice's weights the source stores packed."""
    _, weight_map = weight_map_of(model)
    tensors = {n: s for n, s in tensor_shapes(model).items()
               if module_of(n) and f"{module_of(source_name(model, n))}.weight_packed" in weight_map}
    if not tensors:
        raise ConfigError(f"models.{model['name']}.layers", f"the slice holds no pack-quantized weight of "
                                                            f"{model['source']['checkpoint']}")
    q = model["source"]["quantization"]
    return {"scheme": SCHEME, "targets": q["targets"], "ignore": q["ignore"], "bits": BITS, "symmetric": True,
            "group_size": q["group_size"], "tensors": tensors}


def source_files(model: Mapping[str, Any]) -> list[str]:
    """The source files the slice reads (config, index and the shards that exist), as the stage's inputs;
    a shard that is missing is left to the stage, whose error names it and a tensor it should hold."""
    directory = Path(model["source"]["checkpoint"])
    _, weight_map = weight_map_of(model)
    shards = set()
    for n in tensor_shapes(model):
        s = source_name(model, n)
        m = module_of(s)
        for candidate in (s, f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape"):
            if candidate in weight_map:
                shards.add(weight_map[candidate])
    files = [directory / "config.json", directory / INDEX_NAME] + [directory / f for f in sorted(shards)]
    return [str(f) for f in files if f.is_file()]
