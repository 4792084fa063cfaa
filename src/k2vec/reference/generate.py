"""Greedy generation with the reference model, recording everything the golden data needs.

Step j (0-based) is one forward whose last row's logits choose generated token j: step 0 feeds the
whole prompt, step j > 0 feeds generated token j-1. So every per-step array has one row per generated
token, and row j describes the token at position P-1+j (P = prompt length): the last prompt token,
then each generated token but the last, which is never fed (an engine generating N tokens does not
run it either). Router records cover every fed token, prompt included: P+N-1 rows by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from k2vec.reference.model import ReferenceModel, ReferenceModelError, Segment


@dataclass
class GreedyResult:
    """One prompt's greedy continuation. N = generated tokens, P = prompt length, K = top_k,
    L = layers, H = hidden size, M = number of MoE layers, k = experts per token."""
    prompt: np.ndarray          # int64 [P]
    tokens: np.ndarray          # int64 [N] generated ids (tokens[j] = topk_ids[j, 0])
    topk_ids: np.ndarray        # int64 [N, K] ids by descending logit, ties to the lower id
    topk_logits: np.ndarray     # float [N, K] their logits
    margins: np.ndarray         # float [N] top-1 minus top-2 logit (0 on an exact tie)
    hidden: np.ndarray          # float [N, L, H] residual stream after each layer, for the token fed at step j
    moe_layers: np.ndarray      # int64 [M] layer index of each MoE layer
    router_ids: np.ndarray      # int64 [M, P+N-1, k] experts per fed token (by position), selection order
    router_margins: np.ndarray  # float [M, P+N-1] router margin (k2vec.reference.model.route)

    @property
    def min_margin(self) -> float:
        return float(self.margins.min()) if self.margins.size else float("inf")


def top_k_sorted(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, descending, ties broken by the lower id (without a full sort)."""
    k = min(k, logits.size)
    kth = np.partition(logits, logits.size - k)[logits.size - k]
    cand = np.flatnonzero(logits >= kth)  # every tie with the k-th value is a candidate
    return cand[np.lexsort((cand, -logits[cand]))][:k]


def greedy_generate(model: ReferenceModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    top_k: int = 8, stop_tokens: Iterable[int] = (),
                    forced: Sequence[Sequence[int]] | None = None) -> list[GreedyResult]:
    """Greedy decoding of each prompt, one KV cache per prompt. All unfinished prompts advance together
    (`forward_many`: one pass over the weights per step for the whole batch; no padding, so each
    prompt's numbers equal a run on its own, up to BLAS blocking at the 1e-16 level). A prompt stops
    after `max_new_tokens` or right after emitting a token in `stop_tokens`.

    `forced` (score mode, docs/engine-contract.md): per prompt, the `max_new_tokens` tokens to feed
    instead of the model's own argmax; every step is recorded as in greedy decoding (`tokens` are
    still the model's argmax), so the forward of step j sees the prompt and forced[:j]."""
    if max_new_tokens < 1 or top_k < 1:
        raise ReferenceModelError("max_new_tokens and top_k must be >= 1")
    if forced is not None:
        forced = [np.asarray(f, dtype=np.int64).reshape(-1) for f in forced]
        if len(forced) != len(prompts) or any(f.size != max_new_tokens for f in forced):
            raise ReferenceModelError(f"forced decoding needs {max_new_tokens} tokens for each of the "
                                      f"{len(prompts)} prompts, got lengths {[f.size for f in forced]}")
    stop = set(int(s) for s in stop_tokens)
    prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    if any(p.size == 0 for p in prompts):
        raise ReferenceModelError("empty prompt")
    k_keep = max(top_k, 2)  # the margin needs the runner-up even when top_k == 1
    state = [_Record(model.new_cache(capacity=p.size + max_new_tokens), model.moe_layers) for p in prompts]
    feed = {j: p for j, p in enumerate(prompts)}  # prompt index -> tokens to feed next
    while feed:
        active = list(feed)
        outs = model.forward_many([Segment(feed[j], state[j].cache) for j in active], record=True, last_only=True)
        for j, out in zip(active, outs):
            tok = state[j].add(out, top_k_sorted(out.logits[0], k_keep))
            step = len(state[j].tokens)
            if (forced is None and tok in stop) or step == max_new_tokens:
                del feed[j]
            else:
                feed[j] = np.array([tok]) if forced is None else forced[j][step - 1: step]
    return [st.result(p, model, top_k) for p, st in zip(prompts, state)]


class _Record:
    """Per-prompt accumulator of greedy steps."""

    def __init__(self, cache, moe_layers):
        self.cache, self.moe_layers = cache, moe_layers
        self.tokens, self.ids, self.vals, self.hidden = [], [], [], []
        self.routed = {i: [] for i in moe_layers}
        self.margins = {i: [] for i in moe_layers}

    def add(self, out, best: np.ndarray) -> int:
        logits = out.logits[0]
        self.ids.append(best)
        self.vals.append(logits[best])
        self.hidden.append(out.hidden[:, -1].copy())  # not a view: frees the step's [L, T, H]
        for i in self.moe_layers:
            self.routed[i].append(out.router_ids[i])
            self.margins[i].append(out.router_margins[i])
        self.tokens.append(int(best[0]))
        return self.tokens[-1]

    def result(self, prompt: np.ndarray, model: ReferenceModel, top_k: int) -> GreedyResult:
        ids, vals = np.stack(self.ids), np.stack(self.vals)
        fed = prompt.size + len(self.tokens) - 1
        m = self.moe_layers
        return GreedyResult(
            prompt=prompt.copy(),
            tokens=np.array(self.tokens, dtype=np.int64),
            topk_ids=ids[:, :top_k].astype(np.int64),
            topk_logits=vals[:, :top_k],
            margins=vals[:, 0] - vals[:, 1],
            hidden=np.stack(self.hidden),
            moe_layers=np.array(m, dtype=np.int64),
            router_ids=(np.stack([np.concatenate(self.routed[i]) for i in m]) if m
                        else np.zeros((0, fed, model.dims.top_k), np.int64)),
            router_margins=(np.stack([np.concatenate(self.margins[i]) for i in m]) if m else np.zeros((0, fed))),
        )


def logits_no_cache(model: ReferenceModel, tokens: Sequence[int]) -> np.ndarray:
    """Logits [T, vocab] at every position of `tokens`, recomputed from scratch in one causal forward."""
    return model.forward(np.asarray(tokens, dtype=np.int64), cache=model.new_cache(len(tokens))).logits
