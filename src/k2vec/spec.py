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
import re
from typing import Any

from .errors import ConfigError
from .schemes import SCHEMES, check_patterns, is_quantized
from .architecture import tensor_shapes
from .checkpoint_import import is_import, resolve_import, resolve_import_quantization

K2_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi-K2 architecture at test-friendly widths. hidden_size and moe_intermediate_size are multiples
# of 128 and 64, so the same weights also satisfy vLLM's Marlin MoE shape rules. Values not listed in
# a preset are the K2-Thinking ones (see _K2_COMMON).
_K2_COMMON: dict[str, Any] = {
    "n_shared_experts": 1,
    "rope_theta": 50000.0,
    "rope_scaling": K2_YARN,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "seed": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_K2_COMMON,
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    "small": {
        **_K2_COMMON,
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    # The real K2 widths (docs: README "Scale"). K2 routes with n_group 1 / topk_group 1, i.e. no group
    # restriction: kept as is with fewer experts, so top-8 of 16 is chosen exactly as K2 chooses top-8
    # of 384. Vocabulary reduced from 163840 to 16384 so that the embedding (16384 x 7168, 470 MB in
    # fp32) stays below the dense MLP's 18432 x 7168 (528 MB), the largest tensor the stages hold.
    "k2slice": {
        **_K2_COMMON,
        "vocab_size": 16384,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 3,
        "num_attention_heads": 64,
        "n_routed_experts": 16,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    # One full K2 MoE layer (all 384 experts, top-8, groups 1/1 as K2) for the quantization path's scale
    # test; intermediate_size is K2's but unused (no dense layer). Same reduced vocabulary as k2slice.
    "k2layer": {
        **_K2_COMMON,
        "vocab_size": 16384,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
}

_POSITIVE_INT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
)


def _require(cond: bool, key: str, reason: str) -> None:
    if not cond:
        raise ConfigError(key, reason)


# ---------------------------------------------------------------------------------------------- model


def resolve_model(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Preset + overrides -> architecture dict (HF DeepseekV3 key names), checked for consistency."""
    key = f"models.{name}"
    _require(isinstance(entry, dict), key, "must be a mapping with a 'preset' or a 'checkpoint' key")
    if is_import(entry):
        _require("preset" not in entry, f"{key}.preset",
                 "a model is either a preset or a checkpoint import, not both")
        arch = resolve_import(name, entry)
        check_model(arch, key)
        return {"name": name, "preset": None, **arch}
    preset = entry.get("preset")
    _require(preset in PRESETS, f"{key}.preset",
             f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    arch = copy.deepcopy(PRESETS[preset])
    for k, v in entry.items():
        if k == "preset":
            continue
        _require(k in arch, f"{key}.{k}", f"unknown model setting; known: {sorted(arch)}")
        arch[k] = copy.deepcopy(v)
    check_model(arch, key)
    return {"name": name, "preset": preset, **arch}


def check_model(m: dict[str, Any], key: str) -> None:
    for k in _POSITIVE_INT_KEYS:
        v = m[k]
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{key}.{k}",
                 f"must be a positive integer, got {v!r}")
    q = m["q_lora_rank"]
    _require(q is None or (isinstance(q, int) and not isinstance(q, bool) and q > 0),
             f"{key}.q_lora_rank", f"must be null (no query compression) or a positive integer, got {q!r}")
    E, k, G = m["n_routed_experts"], m["num_experts_per_tok"], m["n_group"]
    _require(k <= E, f"{key}.num_experts_per_tok",
             f"top-k {k} exceeds n_routed_experts {E}")
    _require(E % G == 0, f"{key}.n_group", f"n_group {G} must divide n_routed_experts {E}")
    _require(E // G >= 2, f"{key}.n_group",
             f"each expert group needs at least 2 experts (group score = sum of its top 2), "
             f"but {E} experts / {G} groups = {E // G}")
    _require(m["topk_group"] <= G, f"{key}.topk_group",
             f"topk_group {m['topk_group']} exceeds n_group {G}")
    _require(k <= m["topk_group"] * (E // G), f"{key}.num_experts_per_tok",
             f"top-k {k} exceeds the {m['topk_group'] * (E // G)} experts in the {m['topk_group']} kept groups")
    _require(0 <= m["first_k_dense_replace"] <= m["num_hidden_layers"], f"{key}.first_k_dense_replace",
             f"must be between 0 and num_hidden_layers ({m['num_hidden_layers']}), "
             f"got {m['first_k_dense_replace']}")
    _require(m["qk_rope_head_dim"] % 2 == 0, f"{key}.qk_rope_head_dim",
             f"rotary dims come in pairs; {m['qk_rope_head_dim']} is odd")
    _require(m["n_shared_experts"] >= 0, f"{key}.n_shared_experts", "must be >= 0")
    _require(m["rms_norm_eps"] > 0, f"{key}.rms_norm_eps", "must be > 0")
    _require(m["rope_theta"] > 1, f"{key}.rope_theta", "must be > 1")
    _require(m["routed_scaling_factor"] > 0, f"{key}.routed_scaling_factor", "must be > 0")
    rs = m["rope_scaling"]
    if rs is not None:
        for field in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            _require(field in rs, f"{key}.rope_scaling.{field}", "required for YaRN")
        _require(rs["factor"] >= 1, f"{key}.rope_scaling.factor", "must be >= 1")
        _require(rs["beta_fast"] >= rs["beta_slow"], f"{key}.rope_scaling.beta_fast",
                 "must be >= beta_slow (the YaRN correction range would be reversed)")
        # transformers derives DeepSeek's YaRN factor as max_position_embeddings / original (and ignores
        # `factor`): the two must agree, or a transformers engine rotates by other frequencies
        implied = m["max_position_embeddings"] / rs["original_max_position_embeddings"]
        _require(math.isclose(implied, rs["factor"], rel_tol=1e-12), f"{key}.max_position_embeddings",
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
    _require(scheme in SCHEMES, f"{key}.scheme", f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES)}")
    targets = list(q.get("targets", SCHEMES[scheme]["targets"]))
    ignore = list(q.get("ignore", SCHEMES[scheme]["ignore"]))
    for field, patterns in (("targets", targets), ("ignore", ignore)):
        bad = check_patterns(patterns)
        _require(bad is None, f"{key}.{field}", f"pattern {bad!r} is not a valid regular expression")
    g = q["group_size"]
    shapes = tensor_shapes(model)
    tensors = {n: s for n, s in shapes.items() if is_quantized(n, targets, ignore)}
    _require(bool(tensors), f"{key}.targets", "selects no tensor of model "
             f"'{model['name']}'; the int4 precision would equal fp32")
    for n, (rows, cols) in tensors.items():
        _require(cols % g == 0, f"{key}.group_size",
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
    """The prompt settings of a model. The tokens are drawn by the prompts stage (k2vec.prompts), which
    needs the weights: candidates derive from (seed, model, index, attempt), and a candidate near-tied
    at a prompt position (prompts.near_tie / prompts.router_near_tie, by default report's thresholds'
    default 1e-3) is rejected and re-drawn. They are the prompts' own settings, not report's: changing
    how the report judges must not redraw prompts and rerun every golden."""
    lo, hi = p["min_length"], p["max_length"]
    _require(lo <= hi, f"{key}.min_length", f"min_length {lo} exceeds max_length {hi}")
    total = hi + decoding["max_new_tokens"]
    _require(total <= model["max_position_embeddings"], f"{key}.max_length",
             f"max_length + decoding.max_new_tokens = {total} exceeds the model's "
             f"max_position_embeddings {model['max_position_embeddings']}")
    return {"seed": p["seed"], "count": p["count"], "min_length": lo, "max_length": hi,
            "redraw_attempts": p["redraw_attempts"], "near_tie": p.get("near_tie", PROMPT_NEAR_TIE),
            "router_near_tie": p.get("router_near_tie", PROMPT_NEAR_TIE)}


# ------------------------------------------------------------------------------------------ decoding


def resolve_decoding(d: dict[str, Any], model: dict[str, Any], key: str = "decoding") -> dict[str, Any]:
    _require(d["top_k"] <= model["vocab_size"], f"{key}.top_k",
             f"top_k {d['top_k']} exceeds vocab_size {model['vocab_size']} of model '{model['name']}'")
    dd = d["ddtree"]
    _require(dd["block_size"] >= 2, f"{key}.ddtree.block_size", "must be at least 2 (root + one draft)")
    _require(len(set(dd["budgets"])) == len(dd["budgets"]), f"{key}.ddtree.budgets", "has duplicates")
    _require(len(set(dd["accuracies"])) == len(dd["accuracies"]), f"{key}.ddtree.accuracies", "has duplicates")
    return copy.deepcopy(d)


# ---------------------------------------------------------------------------------------------- cases


def expand_config(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """All resolved cases, keyed by model name. Raises ConfigError on the first problem."""
    models = config.get("models")
    _require(isinstance(models, dict) and models, "models", "must name at least one model")
    cases = {}
    for name, entry in models.items():
        _require(isinstance(name, str) and name.replace("_", "").replace("-", "").isalnum(),
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


# -------------------------------------------------------------------------------------------- engines

# max_result_mb: the largest legitimate result of the default config is about 2 MB (small model,
# greedy: 4 prompts x 24 steps of full fingerprints), so a 100-prompt config writes about 51 MB
# compact or 71 MB indented; anything larger is refused before it is read (docs/engine-contract.md
# section 5). Configs with wider models or longer decodes raise it per engine.
ENGINE_DEFAULTS: dict[str, Any] = {"build": None, "sources": [], "gpus": 0, "timeout_s": 600.0,
                                   "build_timeout_s": 1800.0, "precisions": ["fp32", "int4"],
                                   "modes": ["greedy", "ddtree", "score"], "max_result_mb": 96.0,
                                   "sandbox": False, "precision": "float32", "requires": [],
                                   "ddtree_budgets": None}
_PLACEHOLDERS = ("bundle", "mode", "budget", "output", "gpus", "python")


# A command template's tokens, as str.format reads them: escaped braces, a {placeholder}, a lone brace.
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_BRACE_HELP = "for a brace the shell should see, write it twice ({{ or }})"


def check_command_template(template: str, key: str) -> set[str]:
    """The placeholder names of an engine command template; ConfigError naming `key`, the character
    position and the text around it for a stray brace or an unknown placeholder."""
    known = ", ".join("{" + p + "}" for p in _PLACEHOLDERS)

    def where(i: int) -> str:
        return f"at character {i + 1} (near {template[max(0, i - 25): i + 25]!r})"

    fields = set()
    for m in _TEMPLATE_TOKEN.finditer(template):
        token = m.group(0)
        if token in ("{{", "}}"):
            continue
        _require(token not in ("{", "}"), key, f"stray {token!r} {where(m.start())}; {_BRACE_HELP}")
        name = re.split(r"[!:]", m.group(1), maxsplit=1)[0]
        _require(name in _PLACEHOLDERS, key, f"unknown placeholder {token} {where(m.start())}; known: {known}; "
                 f"{_BRACE_HELP}")
        _require(token == "{" + name + "}", key, f"placeholder {token} {where(m.start())} has a conversion or "
                 f"format spec; write {{{name}}}: values are shell-quoted strings")
        fields.add(name)
    return fields


def resolve_engines(config: dict[str, Any], basedir: str) -> dict[str, dict[str, Any]]:
    """Engine settings with defaults filled in and source globs expanded (relative to `basedir`).
    An entry set to null (`engines: {numpy: null}` in an overlay config) disables that engine."""
    import glob
    import os

    engines = {}
    for name, entry in (config.get("engines") or {}).items():
        if entry is None:
            continue
        key = f"engines.{name}"
        e = {**copy.deepcopy(ENGINE_DEFAULTS), "models": sorted(config["models"]), **copy.deepcopy(entry)}
        fields = check_command_template(e["command"], f"{key}.command")
        _require("output" in fields and "bundle" in fields, f"{key}.command",
                 "must use {bundle} and {output}")
        for m in e["models"]:
            _require(m in config["models"], f"{key}.models", f"unknown model {m!r}")
        budgets = config["decoding"]["ddtree"]["budgets"]
        if e["ddtree_budgets"] is None:
            e["ddtree_budgets"] = list(budgets)
        unknown = [b for b in e["ddtree_budgets"] if b not in budgets]
        _require(not unknown, f"{key}.ddtree_budgets", f"budget(s) {unknown} not in decoding.ddtree.budgets "
                 f"{budgets}: the golden has DDTree traces for those budgets only")
        _require(len(set(e["ddtree_budgets"])) == len(e["ddtree_budgets"]), f"{key}.ddtree_budgets", "has duplicates")
        files: list[str] = []
        for pattern in e["sources"]:
            path = pattern if os.path.isabs(pattern) else os.path.join(basedir, pattern)
            matched = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            _require(bool(matched), f"{key}.sources", f"pattern {pattern!r} matches no file")
            files.extend(matched)
        e["source_files"] = sorted(set(files))
        if e["sandbox"]:
            from .engines.isolation import sandbox_problem
            problem = sandbox_problem()
            _require(problem is None, f"{key}.sandbox", f"{problem}; or set sandbox: false")
        engines[name] = e
    return engines


def engines_short_of_gpus(engines: dict[str, dict[str, Any]], n_devices: int) -> list[str]:
    """Engines that need more GPUs per run than the node's pool has (all GPU engines on a CPU machine)."""
    return [name for name, e in engines.items() if e["gpus"] > n_devices]


def engines_missing_modules(engines: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Engine name -> the modules of its `requires` that the pipeline's Python cannot import (e.g. the
    transformers engine where transformers is not installed); engines missing none are not listed."""
    import importlib.util

    missing = {}
    for name, e in engines.items():
        absent = [m for m in e["requires"] if importlib.util.find_spec(m) is None]
        if absent:
            missing[name] = absent
    return missing


def engine_runs(engines: dict[str, dict[str, Any]], budgets: list[int],
                left_out: list[str] = ()) -> list[tuple[str, str, str, str]]:
    """Every (engine, model, precision, mode) run: greedy, ddtree-b<budget> per DDTree budget of
    `budgets` that the engine runs (its `ddtree_budgets`), and score (forced decoding of the golden
    tokens); none for the engines in `left_out`."""
    runs = []
    for name, e in engines.items():
        if name in left_out:
            continue
        modes = (["greedy"] if "greedy" in e["modes"] else []) + (
            [f"ddtree-b{b}" for b in budgets if b in e["ddtree_budgets"]] if "ddtree" in e["modes"] else []) + (
            ["score"] if "score" in e["modes"] else [])
        runs.extend((name, m, p, mode) for m in e["models"] for p in e["precisions"] for mode in modes)
    return runs
