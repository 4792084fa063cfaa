"""One prompt's rows of several runs against the golden, and the typed frame they end in."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from k2vec.report.fingerprints import compare_fingerprints
from k2vec.report.golden_data import Golden
from k2vec.report.logits import compare_logits
from k2vec.report.routing import compare_routing
from k2vec.report.tokens import compare_tokens

# Integer columns of the row frame (nullable: a row without a divergence has no first step).
INT_COLUMNS = [
    "budget", "first_step", "matched_steps", "golden_token", "engine_token", "golden_rank_in_engine",
    "engine_rank_in_golden", "router_layer", "router_position", "logit_steps", "first_bad_step",
    "first_bad_layer", "router_diff_step", "router_diff_layer", "first_tree_diff_round",
    "first_tree_diff_node",
]


def compare_rows(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, ref_tokens: np.ndarray,
                 *, score: np.ndarray | None = None, fingerprint_rtol: float, cells: dict | None = None
                 ) -> tuple[dict[str, np.ndarray], pd.DataFrame, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Token, logit, fingerprint and router comparison of R engine rows against golden `g` (unclassified).

    datas[r]: the engine's prompt object ({"tokens", optional "topk_ids", "topk_logits",
    "fingerprints", "router_experts"}); prompt[r]: golden prompt index; ref_tokens: [R, N] the golden
    tokens to match (greedy, or the DDTree trace); score[r]: row r is a score-mode row. Returns column
    arrays, the per-step frame (logits.STEP_COLUMNS) and the score rows' routing evidence by position
    (routing.compare_routing). `cells`, when given, receives what the noise-model verdict needs per row:
    "hidden_rel" (fingerprints.compare_fingerprints) and "route_differs" (routing.compare_routing)."""
    score = np.zeros(len(datas), bool) if score is None else score
    cols, t = compare_tokens(g, datas, prompt, ref_tokens, score)
    logit_cols, steps = compare_logits(g, datas, prompt, t["upto"], t["fs"], t["fs_c"], t["has_div"], t["g_tok"])
    cols.update(logit_cols)
    cols.update(compare_fingerprints(g, datas, prompt, t["upto"], t["fs"], fingerprint_rtol,
                                     None if cells is None else cells.setdefault("hidden_rel", [])))
    routing, by_pos = compare_routing(g, datas, prompt, t["fs"], score, cells)
    cols.update(routing)
    return cols, steps, by_pos


def finish_frame(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    for c in columns:
        if c not in df:
            df[c] = np.nan
    df = df[list(columns) + [c for c in df.columns if c not in columns]]
    for c in INT_COLUMNS:
        if c in df:
            df[c] = pd.array(pd.to_numeric(df[c], errors="coerce").round(), dtype="Int64")
    return df
