"""Which weights are quantized: compressed-tensors-style `targets` / `ignore` matching over module names.

A module name is a tensor name without its trailing `.weight`. Matching follows compressed-tensors
(`utils/match.py`): a pattern starting with `re:` is a regular expression applied with `re.match`
(anchored at the start only); the bare word `Linear` targets every linear projection; any other
pattern must equal the module name. The Linear modules are the architecture's
(k2vec.model.architecture.LINEAR_MODULES, `kv_a_proj_with_mqa` among them, and `lm_head`); like DeepSeek's
remote code, the router `mlp.gate` is not a Linear module and is never quantized.
"""

from __future__ import annotations

import re
from typing import Iterable

from k2vec.model.architecture import LINEAR_MODULES

# Named schemes. `default` quantizes every SwiGLU MLP (dense, shared and routed experts);
# `k2-checkpoint` reproduces the ignore list of the released Kimi K2 Thinking checkpoint,
# which leaves only the routed experts quantized.
SCHEMES: dict[str, dict[str, list[str]]] = {
    "default": {
        "targets": ["Linear"],
        "ignore": ["lm_head", r"re:.*self_attn.*"],
    },
    "k2-checkpoint": {
        "targets": ["Linear"],
        "ignore": [
            "lm_head",
            r"re:.*self_attn.*",
            r"re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        ],
    },
}


def is_linear(module: str) -> bool:
    return module == "lm_head" or module.rpartition(".")[2] in LINEAR_MODULES


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern == "Linear":
        return is_linear(module)
    return module == pattern


def is_quantized(tensor_name: str, targets: Iterable[str], ignore: Iterable[str]) -> bool:
    """True when a 2-D weight tensor is selected by `targets` and not excluded by `ignore`."""
    if not tensor_name.endswith(".weight"):
        return False
    module = tensor_name[: -len(".weight")]
    if not is_linear(module):
        return False
    if not any(_matches(module, p) for p in targets):
        return False
    return not any(_matches(module, p) for p in ignore)


def check_patterns(patterns: Iterable[str]) -> str | None:
    """Return the first pattern whose regular expression does not compile, else None."""
    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error:
                return p
    return None
