"""Model presets and config expansion: from the validated `config.yaml` to one resolved spec per model.

The JSON schema (`workflow/schemas/config.schema.yaml`) checks types, ranges and unknown keys; this
module checks what a schema cannot: combinations of values (group size against every quantized input
dimension, top-k against experts, expert groups, layer counts, rope dims) and fills in every derived
dimension. Every problem raises `ConfigError` naming the dotted config key at fault.

A resolved case has one section per pipeline stage, so that each stage depends only on what it reads:
`model` (architecture, seed and derived dims; the weights stage), `quantization` (scheme and the
resolved list of quantized tensors; the quantize stage), `prompts` and `decoding`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from k2vec.config.imports import is_import, resolve_import, resolve_import_quantization
from k2vec.config.presets import PRESETS
from k2vec.errors import ConfigError
from k2vec.model.architecture import tensor_shapes
from k2vec.model.schemes import SCHEMES, check_patterns, is_quantized

_POSITIVE_INT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
)


def require(cond: bool, key: str, reason: str) -> None:
    if not cond:
        raise ConfigError(key, reason)


# ---------------------------------------------------------------------------------------------- model


def resolve_model(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Preset + overrides -> architecture dict (HF DeepseekV3 key names), checked for consistency."""
    key = f"models.{name}"
    require(isinstance(entry, dict), key, "must be a mapping with a 'preset' or a 'checkpoint' key")
    if is_import(entry):
        require("preset" not in entry, f"{key}.preset",
                 "a model is either a preset or a checkpoint import, not both")
        arch = resolve_import(name, entry)
        check_model(arch, key)
        return {"name": name, "preset": None, **arch}
    preset = entry.get("preset")
    require(preset in PRESETS, f"{key}.preset",
             f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    arch = copy.deepcopy(PRESETS[preset])
    for k, v in entry.items():
        if k == "preset":
            continue
        require(k in arch, f"{key}.{k}", f"unknown model setting; known: {sorted(arch)}")
        arch[k] = copy.deepcopy(v)
    check_model(arch, key)
    return {"name": name, "preset": preset, **arch}


def check_model(m: dict[str, Any], key: str) -> None:
    for k in _POSITIVE_INT_KEYS:
        v = m[k]
        require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{key}.{k}",
                 f"must be a positive integer, got {v!r}")
    q = m["q_lora_rank"]
    require(q is None or (isinstance(q, int) and not isinstance(q, bool) and q > 0),
             f"{key}.q_lora_rank", f"must be null (no query compression) or a positive integer, got {q!r}")
    E, k, G = m["n_routed_experts"], m["num_experts_per_tok"], m["n_group"]
    require(k <= E, f"{key}.num_experts_per_tok",
             f"top-k {k} exceeds n_routed_experts {E}")
    require(E % G == 0, f"{key}.n_group", f"n_group {G} must divide n_routed_experts {E}")
    require(E // G >= 2, f"{key}.n_group",
             f"each expert group needs at least 2 experts (group score = sum of its top 2), "
             f"but {E} experts / {G} groups = {E // G}")
    require(m["topk_group"] <= G, f"{key}.topk_group",
             f"topk_group {m['topk_group']} exceeds n_group {G}")
    require(k <= m["topk_group"] * (E // G), f"{key}.num_experts_per_tok",
             f"top-k {k} exceeds the {m['topk_group'] * (E // G)} experts in the {m['topk_group']} kept groups")
    require(0 <= m["first_k_dense_replace"] <= m["num_hidden_layers"], f"{key}.first_k_dense_replace",
             f"must be between 0 and num_hidden_layers ({m['num_hidden_layers']}), "
             f"got {m['first_k_dense_replace']}")
    require(m["qk_rope_head_dim"] % 2 == 0, f"{key}.qk_rope_head_dim",
             f"rotary dims come in pairs; {m['qk_rope_head_dim']} is odd")
    require(m["n_shared_experts"] >= 0, f"{key}.n_shared_experts", "must be >= 0")
    require(m["rms_norm_eps"] > 0, f"{key}.rms_norm_eps", "must be > 0")
    require(m["rope_theta"] > 1, f"{key}.rope_theta", "must be > 1")
    require(m["routed_scaling_factor"] > 0, f"{key}.routed_scaling_factor", "must be > 0")
    rs = m["rope_scaling"]
    if rs is not None:
        for field in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            require(field in rs, f"{key}.rope_scaling.{field}", "required for YaRN")
        require(rs["factor"] >= 1, f"{key}.rope_scaling.factor", "must be >= 1")
        require(rs["beta_fast"] >= rs["beta_slow"], f"{key}.rope_scaling.beta_fast",
                 "must be >= beta_slow (the YaRN correction range would be reversed)")
        # transformers derives DeepSeek's YaRN factor as max_position_embeddings / original (and ignores
        # `factor`): the two must agree, or a transformers engine rotates by other frequencies
        implied = m["max_position_embeddings"] / rs["original_max_position_embeddings"]
        require(math.isclose(implied, rs["factor"], rel_tol=1e-12), f"{key}.max_position_embeddings",
                 f"must equal rope_scaling.factor x rope_scaling.original_max_position_embeddings = "
                 f"{rs['factor'] * rs['original_max_position_embeddings']:g} (transformers reads the factor "
                 f"as their ratio), got {m['max_position_embeddings']}")


def derived_dims(m: dict[str, Any]) -> dict[str, Any]:
    L, k = m["num_hidden_layers"], m["first_k_dense_replace"]
    qk_head_dim = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    rs = m["rope_scaling"]
    mscale = 1.0
    if rs is not None and rs["factor"] > 1:
        mscale = 0.1 * rs.get("mscale_all_dim", 0.0) * math.log(rs["factor"]) + 1.0
    return {
        "qk_head_dim": qk_head_dim,
        "num_key_value_heads": m["num_attention_heads"],
        "dense_layers": list(range(min(k, L))),
        "moe_layers": list(range(k, L)),
        "experts_per_group": m["n_routed_experts"] // m["n_group"],
        "softmax_scale": qk_head_dim ** -0.5 * mscale * mscale,
        "n_parameters": sum(math.prod(s) for s in tensor_shapes(m).values()),
    }


# --------------------------------------------------------------------------------------- quantization


def resolve_quantization(q: dict[str, Any], model: dict[str, Any], key: str = "quantization") -> dict[str, Any]:
    scheme = q["scheme"]
    require(scheme in SCHEMES, f"{key}.scheme", f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    targets = list(q.get("targets", SCHEMES[scheme]["targets"]))
    ignore = list(q.get("ignore", SCHEMES[scheme]["ignore"]))
    for field, patterns in (("targets", targets), ("ignore", ignore)):
        bad = check_patterns(patterns)
        require(bad is None, f"{key}.{field}", f"pattern {bad!r} is not a valid regular expression")
    g = q["group_size"]
    shapes = tensor_shapes(model)
    tensors = {n: s for n, s in shapes.items() if is_quantized(n, targets, ignore)}
    require(bool(tensors), f"{key}.targets", "selects no tensor of model "
             f"'{model['name']}'; the int4 precision would equal fp32")
    for n, (rows, cols) in tensors.items():
        require(cols % g == 0, f"{key}.group_size",
                 f"group size {g} does not divide the input dimension K={cols} of {n} "
                 f"(model '{model['name']}'); choose a group size dividing {cols} or change the model")
        # two 4-bit values per byte: K must be even, which any group size >= 2 already ensures
    return {
        "scheme": scheme,
        "targets": targets,
        "ignore": ignore,
        "bits": 4,
        "symmetric": True,
        "group_size": g,
        "scale_dtype": q["scale_dtype"],
        "tensors": tensors,
    }


# -------------------------------------------------------------------------------------------- prompts


PROMPT_NEAR_TIE = 1.0e-3  # default margin under which a prompt position counts as near-tied (report's default too)


def resolve_prompts(p: dict[str, Any], model: dict[str, Any], decoding: dict[str, Any], report: dict[str, Any],
                    key: str = "prompts") -> dict[str, Any]:
    """The prompt settings of a model. The tokens are drawn by the prompts stage (k2vec.stages.prompts), which
    needs the weights: candidates derive from (seed, model, index, attempt), and a candidate near-tied
    at a prompt position (prompts.near_tie / prompts.router_near_tie, by default report's thresholds'
    default 1e-3) is rejected and re-drawn. They are the prompts' own settings, not report's: changing
    how the report judges must not redraw prompts and rerun every golden."""
    lo, hi = p["min_length"], p["max_length"]
    require(lo <= hi, f"{key}.min_length", f"min_length {lo} exceeds max_length {hi}")
    total = hi + decoding["max_new_tokens"]
    require(total <= model["max_position_embeddings"], f"{key}.max_length",
             f"max_length + decoding.max_new_tokens = {total} exceeds the model's "
             f"max_position_embeddings {model['max_position_embeddings']}")
    return {"seed": p["seed"], "count": p["count"], "min_length": lo, "max_length": hi,
            "redraw_attempts": p["redraw_attempts"], "near_tie": p.get("near_tie", PROMPT_NEAR_TIE),
            "router_near_tie": p.get("router_near_tie", PROMPT_NEAR_TIE)}


# ------------------------------------------------------------------------------------------ decoding


def resolve_decoding(d: dict[str, Any], model: dict[str, Any], key: str = "decoding") -> dict[str, Any]:
    require(d["top_k"] <= model["vocab_size"], f"{key}.top_k",
             f"top_k {d['top_k']} exceeds vocab_size {model['vocab_size']} of model '{model['name']}'")
    dd = d["ddtree"]
    require(dd["block_size"] >= 2, f"{key}.ddtree.block_size", "must be at least 2 (root + one draft)")
    require(len(set(dd["budgets"])) == len(dd["budgets"]), f"{key}.ddtree.budgets", "has duplicates")
    require(len(set(dd["accuracies"])) == len(dd["accuracies"]), f"{key}.ddtree.accuracies", "has duplicates")
    return copy.deepcopy(d)


# ---------------------------------------------------------------------------------------------- cases


def check_finite(value: Any, key: str = "") -> None:
    """ConfigError naming the first NaN or infinite number in `value` (a loaded config). YAML's `.nan`
    and `.inf` pass every schema bound (a NaN compares false with all), and then a threshold compared
    with NaN never fires, and a time limit or size in int() or time arithmetic crashes the runner."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key or "(top level)", f"{value} is not a finite number; leave the key out or write null "
                                                f"where the schema allows it")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite(v, f"{key}[{i}]")


def expand_config(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """All resolved cases, keyed by model name. Raises ConfigError on the first problem."""
    check_finite(config)
    models = config.get("models")
    require(isinstance(models, dict) and models, "models", "must name at least one model")
    cases = {}
    for name, entry in models.items():
        require(isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum(),
                 f"models.{name}", "model names may use letters, digits, '-' and '_' only "
                 "(they become file names and wildcards)")
        arch = resolve_model(name, entry)
        model = {**arch, **derived_dims(arch)}
        decoding = resolve_decoding(config["decoding"], model)
        cases[name] = {
            "model": model,
            # an imported model's quantization is the checkpoint's (config's section: synthetic models)
            "quantization": (resolve_import_quantization(arch) if "source" in arch
                             else resolve_quantization(config["quantization"], arch)),
            "prompts": resolve_prompts(config["prompts"], arch, decoding, config["report"]),
            "decoding": decoding,
        }
    return cases


def schema_error(config: dict[str, Any], schema_path: str) -> ConfigError | None:
    """The most specific JSON-schema violation of `config`, as a ConfigError naming its dotted key."""
    import jsonschema
    import yaml

    with open(schema_path) as fh:
        schema = yaml.safe_load(fh)
    validator = jsonschema.Draft202012Validator(schema)
    best = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if best is None:
        return None
    key = ".".join(str(p) for p in best.absolute_path) or "(top level)"
    return ConfigError(key, best.message)
