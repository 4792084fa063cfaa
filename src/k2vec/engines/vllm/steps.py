"""vLLM's top-k records as the contract's per-step rows (docs/engine-contract.md section 4).

vLLM gives, per position, a dict token id -> Logprob (`.logprob`: with `logprobs_mode="raw_logits"` the raw
logit, not a log-softmax value; `.rank`: 1 for the largest). A position's dict holds the k largest and, when it
is not among them, the sampled or prompt token as well (rank > k): that one is left out, and the k are sorted
by value, ties by lower id first (the golden's argmax rule).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from k2vec.errors import K2VecError


class VllmResultError(K2VecError):
    """vLLM returned fewer positions or top-k entries than asked for."""


def top_k_row(position: Mapping[int, Any] | None, k: int, where: str) -> tuple[list[int], list[float]]:
    """(ids, logits) of the k largest entries of one position's record, descending."""
    if position is None:
        raise VllmResultError(f"{where}: vLLM returned no top-k record")
    top = sorted(((float(lp.logprob), int(tok)) for tok, lp in position.items() if lp.rank is not None
                  and lp.rank <= k), key=lambda vt: (-vt[0], vt[1]))
    if len(top) != k:
        raise VllmResultError(f"{where}: vLLM returned {len(top)} of the top {k} entries")
    return [t for _, t in top], [v for v, _ in top]


def prompt_rows(steps: Sequence[Mapping[int, Any] | None], k: int, where: str) -> dict:
    """The contract's `tokens`, `topk_ids`, `topk_logits` from one top-k record per step."""
    rows = [top_k_row(s, k, f"{where}, step {j}") for j, s in enumerate(steps)]
    ids = [r[0] for r in rows]
    return {"tokens": [i[0] for i in ids], "topk_ids": ids, "topk_logits": [r[1] for r in rows]}


def score_steps(prompt_logprobs: Sequence[Mapping[int, Any] | None], sample_logprobs: Sequence[Mapping[int, Any]],
                prompt_len: int, n_new: int, where: str) -> list[Mapping[int, Any] | None]:
    """The N steps of a forced decode run as one prefill of the prompt (P tokens) and golden[0..N-2], then one
    generated token: step j < N-1 is the record of fed position P + j (vLLM's prompt logprobs: entry i is the
    distribution over token i given the tokens before it), step N-1 the generated token's."""
    if len(prompt_logprobs) != prompt_len + n_new - 1 or len(sample_logprobs) < 1:
        raise VllmResultError(f"{where}: vLLM returned {len(prompt_logprobs)} prompt positions and "
                              f"{len(sample_logprobs)} generated ones, expected {prompt_len + n_new - 1} and 1")
    return [*prompt_logprobs[prompt_len:], sample_logprobs[0]]
