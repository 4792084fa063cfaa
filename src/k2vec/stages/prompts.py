"""Prompt drawing with rejection of blind prompts: the `prompts` stage (docs/golden-format.md).

A prompt is *blind* under a set of weights when the golden is near-tied at one of its prompt
positions: a router margin (k-th minus (k+1)-th biased expert score, or the kept groups' lead where smaller) below
`router_near_tie` at any prompt position and MoE layer, or a top-1/top-2 logit gap below `near_tie` at its last position
(step 0). An engine that routes a near-tied prompt position otherwise is excused by the report for
every later divergence of that row (class `router-near-tie`), so such a row cannot show a real bug.

Each prompt index draws candidates from a stream seeded by (seed, model, "prompt", index, attempt),
never by call order. The fp32 prompts keep, per index, the first candidate not blind under the fp32
weights. The int4 prompts start from the fp32 choice (same attempt) and move on only where it is
blind under the int4 weights, so both goldens share nearly all their prompts while the fp32 side
never depends on the quantizer (a quantizer edit reruns the int4 side only). A candidate is judged
by one prefill forward.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from k2vec.errors import ConfigError
from k2vec.reference.model import ReferenceModel, Segment
from k2vec.seeds import rng_for

log = logging.getLogger("k2vec.stages.prompts")


def candidate(settings: Mapping[str, Any], model: Mapping[str, Any], index: int, attempt: int) -> list[int]:
    """Candidate `attempt` for prompt `index`: its length and tokens from its own named stream."""
    rng = rng_for(settings["seed"], model["name"], "prompt", index, "attempt", attempt)
    n = int(rng.integers(settings["min_length"], settings["max_length"] + 1))
    return [int(t) for t in rng.integers(0, model["vocab_size"], size=n)]


def prompt_margins(model: ReferenceModel, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: (smallest golden router margin over its prompt positions and MoE layers (inf
    without MoE layers), top-1/top-2 logit gap at its last position), from one batched prefill."""
    outs = model.forward_many([Segment(np.asarray(p), model.new_cache(len(p))) for p in prompts],
                              record=True, last_only=True)
    router = np.array([min((float(m.min()) for m in o.router_margins.values()), default=np.inf) for o in outs])
    top2 = np.sort(np.stack([o.logits[0] for o in outs]), axis=-1)[:, -2:]
    return router, top2[:, 1] - top2[:, 0]


def draw_prompts(settings: Mapping[str, Any], model_spec: Mapping[str, Any],
                 models: Mapping[str, ReferenceModel], start_from: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The prompts section with `tokens` filled in: for each index, the first candidate blind under none
    of `models` (precision -> reference model), with its attempt (`attempts`: the chosen attempt + 1) and
    margins per precision. Candidates start at attempt 0, or at the attempt chosen by `start_from` (another
    precision's prompts section: the int4 prompts keep every fp32 prompt that int4 does not make blind).
    ConfigError naming `prompts.redraw_attempts` when an index finds none."""
    count, limit = settings["count"], settings["redraw_attempts"]
    r_thr, t_thr = settings["router_near_tie"], settings["near_tie"]
    chosen: dict[int, list[int]] = {}
    attempts = np.zeros(count, np.int64) if start_from is None else np.asarray(start_from["attempts"], np.int64) - 1
    margins: dict[str, dict[str, list[float]]] = {p: {"router": [0.0] * count, "token": [0.0] * count} for p in models}
    pending = list(range(count))
    while pending:   # one batched prefill per round over every index still looking
        cands = {i: candidate(settings, model_spec, i, int(attempts[i])) for i in pending}
        ok = np.ones(len(pending), bool)
        got = {}
        for precision, ref in models.items():
            router, token = prompt_margins(ref, [cands[i] for i in pending])
            got[precision] = (router, token)
            ok &= (router >= r_thr) & (token >= t_thr)
        for j, i in enumerate(pending):
            if ok[j]:
                chosen[i] = cands[i]
                for precision, (router, token) in got.items():
                    margins[precision]["router"][i] = float(router[j])
                    margins[precision]["token"][i] = float(token[j])
        attempts[pending] += 1
        pending = [i for j, i in enumerate(pending) if not ok[j]]
        exhausted = [i for i in pending if attempts[i] >= limit]
        if exhausted:
            raise ConfigError("prompts.redraw_attempts",
                              f"model '{model_spec['name']}': no prompt of {limit} candidates for index(es) "
                              f"{exhausted} is free of near-ties at its prompt positions (router margin >= "
                              f"{r_thr:g} and step-0 logit gap >= {t_thr:g}); raise redraw_attempts, shorten "
                              f"prompts.max_length or change the model seed")
    log.info("model %s: %d prompts after %s draws each", model_spec["name"], count, attempts.tolist())
    return {**settings, "tokens": [chosen[i] for i in range(count)], "attempts": attempts.tolist(),
            "prompt_margins": margins}
