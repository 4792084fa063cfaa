"""Reference results in the contract's JSON shape: one greedy, score or DDTree prompt entry."""

from __future__ import annotations

import numpy as np


def greedy_prompt(r, prompt_len: int) -> dict:
    # Router choices for the token fed at each step: the last prompt token, then generated tokens.
    fed = np.arange(len(r.tokens)) + prompt_len - 1
    return {"tokens": r.tokens.tolist(), "topk_ids": r.topk_ids.tolist(), "topk_logits": r.topk_logits.tolist(),
            "fingerprints": r.hidden.astype(np.float32).tolist(),
            "router_experts": r.router_ids[:, fed].transpose(1, 0, 2).tolist()}


def score_prompt(r) -> dict:
    # Router choices for every fed token: the P prompt tokens, then golden tokens 0..N-2.
    return {"tokens": r.tokens.tolist(), "topk_ids": r.topk_ids.tolist(), "topk_logits": r.topk_logits.tolist(),
            "fingerprints": r.hidden.astype(np.float32).tolist(),
            "router_experts": r.router_ids.transpose(1, 0, 2).tolist()}


def ddtree_round(x) -> dict:
    return {"start": x.start, "tokens": x.node_tokens.tolist(), "parents": x.parents.tolist(),
            "depths": x.depths.tolist(), "accepted": x.accepted.tolist(), "bonus": x.bonus}
