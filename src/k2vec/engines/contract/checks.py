"""A result against the contract: the JSON schema (strict types), then every shape and range the bundle implies."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.expectations import Expectations
from k2vec.engines.contract.modes import parse_mode
from k2vec.engines.contract.schema import conforms, is_integer, is_number

SCHEMA_PATH = Path(__file__).with_name("result.schema.json")


@lru_cache(maxsize=1)
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=1)
def _validator():
    """The schema's validator with strict types: JSON Schema counts 5.0 as an integer, and Python's
    reader turns 1e999 into inf; token ids must be integers and every number finite."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({
        "integer": lambda _, x: is_integer(x),
        "number": lambda _, x: is_number(x),
    })
    strict = jsonschema.validators.extend(base, type_checker=checker)
    return strict(_schema())


def check_result(result: Any, mode: str, expect: Expectations) -> None:
    """Raise InvalidResult naming the first contract violation."""
    # jsonschema, slow on long arrays, only for results the quick check does not pass: it names the error
    err = None if conforms(result, _schema()) else next(iter(_validator().iter_errors(result)), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        what = err.message
        if err.validator == "type" and err.validator_value == "integer":
            what = f"{err.instance!r} is not a JSON integer (write token ids and indices without a fraction)"
        elif err.validator == "type" and err.validator_value == "number" and isinstance(err.instance, float):
            what = f"{err.instance!r} is not a finite number"
        raise InvalidResult(f"result does not match the schema at {where}: {what}")
    kind, _ = parse_mode(mode)
    runs = result["runs"]
    want_drafters = [None] if kind in ("greedy", "score") else [{"accuracy": a} for a in expect.accuracies]
    got = [None if r["drafter"] is None else {"accuracy": r["drafter"]["accuracy"]} for r in runs]
    if got != want_drafters:
        raise InvalidResult(f"runs are for drafters {got}, expected {want_drafters}")
    for r_i, run in enumerate(runs):
        if len(run["prompts"]) != expect.n_prompts:
            raise InvalidResult(f"run {r_i}: {len(run['prompts'])} prompts, the bundle has {expect.n_prompts}")
        for p_i, prompt in enumerate(run["prompts"]):
            tokens = prompt["tokens"]
            if len(tokens) != expect.max_new_tokens:
                raise InvalidResult(f"run {r_i} prompt {p_i}: {len(tokens)} tokens, "
                                    f"expected max_new_tokens = {expect.max_new_tokens}")
            bad = next((t for t in tokens if t >= expect.vocab_size), None)
            if bad is not None:
                raise InvalidResult(f"run {r_i} prompt {p_i}: token {bad} outside the vocabulary "
                                    f"(size {expect.vocab_size})")
            if kind != "ddtree":
                _check_step_arrays(prompt, kind, p_i, expect)


def _array(value: Any, dtype, what: str) -> np.ndarray:
    """A nested list as an array; InvalidResult when its rows have different lengths."""
    try:
        return np.array(value, dtype=dtype)
    except ValueError:
        raise InvalidResult(f"{what}: rows of different lengths (expected a rectangular array)") from None
    except OverflowError:   # the schema bounds integers below only: 2**70 is a valid JSON token id
        raise InvalidResult(f"{what}: an integer does not fit in 64 bits") from None


def _check_step_arrays(prompt: dict, kind: str, p_i: int, expect: Expectations) -> None:
    """The per-step arrays of a greedy or score result (section 4): their lengths, the top-k order,
    and expert ids. Score mode requires the top-k and reports routing for every fed token."""
    n = expect.max_new_tokens
    where = f"prompt {p_i}"
    if kind == "score":
        missing = [k for k in ("topk_ids", "topk_logits") if k not in prompt]
        if missing:
            raise InvalidResult(f"{where}: score mode requires {' and '.join(missing)} (at least 1 per step)")
    if "topk_ids" in prompt or "topk_logits" in prompt:
        ids = _array(prompt.get("topk_ids", []), np.int64, f"{where} topk_ids")
        logits = _array(prompt.get("topk_logits", []), np.float64, f"{where} topk_logits")
        if ids.shape != logits.shape or ids.ndim != 2 or ids.shape[0] != n or ids.shape[1] < 1:
            raise InvalidResult(f"{where}: topk_ids {list(ids.shape)} and topk_logits {list(logits.shape)} must "
                                f"both be [max_new_tokens = {n}][k >= 1]")
        if (ids >= expect.vocab_size).any():
            step, col = np.argwhere(ids >= expect.vocab_size)[0]
            raise InvalidResult(f"{where} step {step}: topk id {ids[step, col]} outside the vocabulary "
                                f"(size {expect.vocab_size})")
        rising = np.argwhere(np.diff(logits, axis=1) > 0)
        if rising.size:
            raise InvalidResult(f"{where} step {rising[0][0]}: topk_logits are not in descending order")
        if kind == "score" and not np.array_equal(ids[:, 0], prompt["tokens"]):
            step = int(np.flatnonzero(ids[:, 0] != np.asarray(prompt["tokens"]))[0])
            raise InvalidResult(f"{where} step {step}: tokens must be the engine's own argmax, topk_ids[j][0]")
    if "router_experts" in prompt and expect.moe_layers is not None:
        # score mode: every fed token (P prompt tokens, then golden 0..N-2); greedy: the token of each step
        rows = expect.prompt_lengths[p_i] + n - 1 if kind == "score" else n
        routed = _array(prompt["router_experts"], np.int64, f"{where} router_experts")
        want = (rows, expect.moe_layers, expect.experts_per_token)
        if routed.shape != want:
            fed = "P + N - 1 fed positions (prompt, then golden tokens)" if kind == "score" else "N steps"
            raise InvalidResult(f"{where}: router_experts is {list(routed.shape)}, expected {list(want)}: "
                                f"[{fed}][MoE layers][num_experts_per_tok]")
        if routed.size and (routed >= expect.experts).any():
            pos = np.argwhere(routed >= expect.experts)[0]
            raise InvalidResult(f"{where}: router_experts{pos.tolist()} = {routed[tuple(pos)]} is not an expert "
                                f"(n_routed_experts = {expect.experts})")
        repeated = np.diff(np.sort(routed, axis=-1), axis=-1) == 0
        if repeated.any():
            pos = np.argwhere(repeated)[0][:2]
            raise InvalidResult(f"{where}: router_experts{pos.tolist()} names an expert twice")
    if "fingerprints" in prompt and expect.layers is not None:
        fp = _array(prompt["fingerprints"], np.float64, f"{where} fingerprints")
        if fp.ndim != 3 or fp.shape[:2] != (n, expect.layers):
            raise InvalidResult(f"{where}: fingerprints is {list(fp.shape)}, expected [max_new_tokens = {n}]"
                                f"[layers = {expect.layers}][hidden]")
