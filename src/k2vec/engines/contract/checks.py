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


# A failure reason is one line of a table: values in it are cut to about SHORT_VALUE characters, and the
# whole reason to MAX_REASON (a 4000-digit token id, or jsonschema quoting a whole list, made reasons of
# thousands of characters).
SHORT_VALUE = 40
MAX_REASON = 280


def short(value: Any, limit: int = SHORT_VALUE) -> str:
    """`value` for a failure reason, at most about `limit` characters: a long integer by its first
    digits and its length, anything else by the start of its repr."""
    if type(value) is int:
        if value.bit_length() > 14_000:   # past Python's 4300-digit str() limit: say its size only
            return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
        text = str(value)
        digits = len(text.lstrip("-"))
        return text if len(text) <= limit else f"{text[:limit // 2]}... ({digits} digits)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _capped(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


def check_result(result: Any, mode: str, expect: Expectations) -> None:
    """Raise InvalidResult naming the first contract violation, in a reason of at most MAX_REASON characters."""
    try:
        _check_result(result, mode, expect)
    except InvalidResult as err:
        raise InvalidResult(_capped(str(err))) from None


def _schema_error(err) -> str:
    """The first schema violation, with the offending value cut short."""
    where = "/".join(str(p)[:24] for p in err.absolute_path) or "(top level)"
    value, want = err.instance, err.validator_value
    if err.validator == "type" and want == "integer":
        what = f"{short(value)} is not a JSON integer (write token ids and indices without a fraction)"
    elif err.validator == "type" and want == "number" and isinstance(value, float):
        what = f"{short(value)} is not a finite number"
    elif err.validator == "type":
        what = f"{short(value)} is not of type {want!r}"
    elif err.validator == "minimum":
        what = f"{short(value)} is less than the minimum of {want}"
    elif err.validator == "maximum":
        what = f"{short(value)} is greater than the maximum of {want} (integers of the contract fit in int32)"
    else:
        what = err.message
    return f"result does not match the schema at {where}: {what}"


def _check_result(result: Any, mode: str, expect: Expectations) -> None:
    # jsonschema, slow on long arrays, only for results the quick check does not pass: it names the error
    err = None if conforms(result, _schema()) else next(iter(_validator().iter_errors(result)), None)
    if err is not None:
        raise InvalidResult(_schema_error(err))
    kind, _ = parse_mode(mode)
    runs = result["runs"]
    want_drafters = [None] if kind in ("greedy", "score") else [{"accuracy": a} for a in expect.accuracies]
    got = [None if r["drafter"] is None else {"accuracy": r["drafter"]["accuracy"]} for r in runs]
    if got != want_drafters:
        raise InvalidResult(f"runs are for drafters {short(got, 120)}, expected {short(want_drafters, 120)}")
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
                raise InvalidResult(f"run {r_i} prompt {p_i}: token {short(bad)} outside the vocabulary "
                                    f"(size {expect.vocab_size})")
            # DDTree prompts may carry the per-step arrays too (one row per generated token, as greedy)
            _check_step_arrays(prompt, "greedy" if kind == "ddtree" else kind, p_i, expect)
            if kind == "ddtree" and "rounds" in prompt:
                for k, rnd in enumerate(prompt["rounds"]):
                    _check_round(rnd, f"run {r_i} prompt {p_i} round {k}", p_i, expect)


def _first(values: list, bad) -> tuple[int, Any] | None:
    """(index, value) of the first value for which bad(value), or None."""
    return next(((i, v) for i, v in enumerate(values) if bad(v)), None)


def _check_round(rnd: dict, where: str, p_i: int, expect: Expectations) -> None:
    """One DDTree round (section 4, docs/ddtree.md): every integer within what the tree and the sequence
    allow, so no node, parent or position of the result points outside them. Node i of the round's tree
    is tokens[i] (0 the root); n + 1 = len(tokens)."""
    V = expect.vocab_size
    tokens, parents, accepted = rnd["tokens"], rnd["parents"], rnd["accepted"]
    size = len(tokens)
    if size == 0:
        raise InvalidResult(f"{where}: tokens is empty (the root comes first)")
    if max(tokens) >= V:
        i, t = _first(tokens, lambda t: t >= V)
        raise InvalidResult(f"{where}: tokens[{i}] = {short(t)} outside the vocabulary (size {V})")
    lengths = {"parents": len(parents), **({"depths": len(rnd["depths"])} if "depths" in rnd else {})}
    for key, n in lengths.items():
        if n != size:
            raise InvalidResult(f"{where}: {n} {key} for {size} tokens (one per node, the root first)")
    if parents[0] != -1:
        raise InvalidResult(f"{where}: parents[0] = {short(parents[0])}, the root's parent must be -1")
    bad = _first(parents[1:], lambda q: not 0 <= q < size)
    if bad is not None:
        raise InvalidResult(f"{where}: parents[{bad[0] + 1}] = {short(bad[1])} is not a node of the tree "
                            f"(0..{size - 1})")
    if "depths" in rnd:
        bad = _first(rnd["depths"], lambda d: d >= size)
        if bad is not None:
            raise InvalidResult(f"{where}: depths[{bad[0]}] = {short(bad[1])} is deeper than a tree of "
                                f"{size} nodes allows (at most {size - 1})")
    if not accepted or accepted[0] != 0:
        raise InvalidResult(f"{where}: accepted must start with the root, 0 (got "
                            f"{short(accepted[0]) if accepted else 'none'})")
    bad = _first(accepted, lambda a: a >= size)
    if bad is not None:
        raise InvalidResult(f"{where}: accepted[{bad[0]}] = {short(bad[1])} is not a node of the tree "
                            f"(0..{size - 1})")
    if rnd["bonus"] >= V:
        raise InvalidResult(f"{where}: bonus {short(rnd['bonus'])} outside the vocabulary (size {V})")
    start = rnd["start"]
    if expect.prompt_lengths is not None:   # the root is a generated token: position P .. P + N - 1
        lo = expect.prompt_lengths[p_i]
        hi = lo + expect.max_new_tokens
        if not lo <= start < hi:
            raise InvalidResult(f"{where}: start {short(start)} is outside the generated positions "
                                f"{lo}..{hi - 1} (prompt length {lo} + max_new_tokens {expect.max_new_tokens})")


def _array(value: Any, dtype, what: str) -> np.ndarray:
    """A nested list as an array; InvalidResult when its rows have different lengths."""
    try:
        return np.array(value, dtype=dtype)
    except ValueError:
        raise InvalidResult(f"{what}: rows of different lengths (expected a rectangular array)") from None
    except OverflowError:   # the schema caps the contract's integers at int32; a caller's own data may not be
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
        width = "hidden" if expect.hidden is None else f"hidden_size = {expect.hidden}"
        if fp.ndim != 3 or fp.shape[:2] != (n, expect.layers) or fp.shape[2] < 1 \
                or expect.hidden is not None and fp.shape[2] != expect.hidden:
            raise InvalidResult(f"{where}: fingerprints is {list(fp.shape)}, expected [max_new_tokens = {n}]"
                                f"[layers = {expect.layers}][{width}]")
