"""What a result must hold for one bundle: prompt count, lengths, vocabulary, layers, experts (read from the bundle,
verified)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from k2vec.engines.contract.errors import InvalidResult


@dataclass(frozen=True)
class Expectations:
    """What a valid result must hold, from the bundle's metadata."""

    n_prompts: int
    max_new_tokens: int
    vocab_size: int
    accuracies: tuple[float, ...] = ()  # ddtree: one run per drafter accuracy
    # The shapes of the optional per-step arrays (section 4); None where the bundle does not say.
    prompt_lengths: tuple[int, ...] | None = None
    layers: int | None = None
    moe_layers: int | None = None
    experts: int | None = None            # n_routed_experts
    experts_per_token: int | None = None  # num_experts_per_tok
    hidden: int | None = None             # hidden_size: the width of a fingerprint row; None where not stated


def expectations_from_bundle(path: str | os.PathLike, verify: bool = True) -> Expectations:
    """What the engine's result must hold, from the bundle's metadata (the engine sees the same).

    The bundle's checksums are verified first (`verify=False` only where the caller has just verified
    them): an engine must never be run, nor judged, on a damaged bundle. Raises InvalidResult naming
    the file and what is wrong, so the run becomes a failed row."""
    from k2vec.kdtr import KdtrError, open_bundle

    try:
        with open_bundle(path, verify=verify) as b:
            meta = b.metadata
            lengths = {t.name: int(np.prod(t.shape)) for t in b.tensors if t.name.startswith("prompt.p")}
    except (KdtrError, OSError) as err:
        raise InvalidResult(f"bundle {path} failed verification, the engine was not run: {err}") from None
    fields = {"n_prompts": ("golden", "prompts"), "max_new_tokens": ("decoding", "max_new_tokens"),
              "vocab_size": ("model", "vocab_size"), "accuracies": ("golden", "ddtree", "accuracies")}
    got: dict[str, Any] = {}
    for name, keys in fields.items():
        value: Any = meta
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        ok = isinstance(value, list) and all(type(a) in (int, float) for a in value) if name == "accuracies" \
            else type(value) is int and value > 0
        if not ok:
            raise InvalidResult(f"bundle {path}: metadata {'.'.join(keys)} is {value!r}, expected "
                                f"{'a list of numbers' if name == 'accuracies' else 'a positive integer'}")
        got[name] = tuple(value) if name == "accuracies" else value
    return Expectations(**got, **_shapes(meta, lengths, path, got["n_prompts"]))


def _shapes(meta: dict, tensor_sizes: dict[str, int], path: Any, n_prompts: int) -> dict[str, Any]:
    """Prompt lengths and the layer/expert counts that fix the per-step arrays' shapes."""
    c = meta.get("hf_config")
    keys = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok")
    if not isinstance(c, dict) or any(type(c.get(k)) is not int for k in keys):
        raise InvalidResult(f"bundle {path}: metadata hf_config lacks integer {', '.join(keys)}")
    names = [f"prompt.p{i}.tokens" for i in range(n_prompts)]
    absent = [n for n in names if n not in tensor_sizes]
    if absent:
        raise InvalidResult(f"bundle {path}: tensor {absent[0]} is missing (metadata golden.prompts = {n_prompts})")
    layers = c["num_hidden_layers"]
    hidden = c.get("hidden_size")
    return {"prompt_lengths": tuple(tensor_sizes[n] for n in names), "layers": layers,
            "moe_layers": max(0, layers - c["first_k_dense_replace"]),
            "experts": c["n_routed_experts"], "experts_per_token": c["num_experts_per_tok"],
            "hidden": hidden if type(hidden) is int and hidden > 0 else None}
