"""Tokens: where an engine's tokens first leave the golden ones, and the golden's margins there.

Greedy and DDTree rows compare steps 0..k (k = first divergent step): after k the two sides fed
different tokens. Score rows were fed the golden tokens at every step, so every step is compared and
k is only the first step whose top-1 differs.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from k2vec.report.arrays import stack_rows
from k2vec.report.golden_data import Golden


def compare_tokens(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, ref_tokens: np.ndarray,
                   score: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(columns, arrays for the other comparisons). score[r]: row r is a score-mode row."""
    R, N = len(datas), g.N
    # missing tokens are -1, never equal to a golden token
    E = stack_rows([[] if d.get("tokens") is None else d["tokens"] for d in datas], (), N, -1, np.int64)
    diff = E != ref_tokens
    has_div = diff.any(axis=1)
    fs = np.where(has_div, diff.argmax(axis=1), N)          # N = never diverged
    fs_c = np.minimum(fs, N - 1)
    # the steps both sides fed the same tokens: all of them in score mode
    upto = (np.arange(N)[None, :] <= fs[:, None]) | score[:, None]
    rr = np.arange(R)
    g_tok, e_tok = ref_tokens[rr, fs_c], E[rr, fs_c]
    margin = g.margins[prompt, fs_c]
    # golden logit of its own token minus that of the engine's, where the golden lists the engine's
    # token; else the gap to the golden's last listed logit (the least it can be)
    hit = g.topk_ids[prompt, fs_c] == e_tok[:, None]
    g_logits = g.topk_logits[prompt, fs_c]
    gap = g_logits[:, 0] - np.where(hit.any(1), g_logits[rr, hit.argmax(1)], g_logits[:, -1])
    cols = {
        "first_step": np.where(has_div, fs, np.nan),
        "matched_steps": fs.astype(float),
        "same_top1": np.where(score, (~diff).mean(axis=1), np.nan),
        "golden_token": np.where(has_div, g_tok, np.nan),
        "engine_token": np.where(has_div & (e_tok >= 0), e_tok, np.nan),
        "margin": np.where(has_div, margin, np.nan),
        "golden_gap": np.where(has_div, gap, np.nan),
        "engine_rank_in_golden": np.where(has_div & hit.any(1), hit.argmax(1), np.nan),
    }
    return cols, {"has_div": has_div, "fs": fs, "fs_c": fs_c, "upto": upto, "g_tok": g_tok}
