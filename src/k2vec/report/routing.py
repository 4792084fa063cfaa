"""Routing: the engine's expert choices against the golden's, compared as sets per MoE layer.

Greedy and DDTree results give `router_experts` for the token fed at each step (positions P-1 ..
P+N-2); score results give every fed position, the prompt's included (0 .. P+N-2). Positions after
the first divergent step of a greedy run are not compared (the fed tokens differ).

The router evidence of a divergence (for the `router-near-tie` class) is taken at the divergence
only: where the engine reports its routing, the smallest golden routing margin among the decisions
(position, layer) where the engine chose other experts, up to the divergent step; where it does not,
the smallest golden routing margin over the MoE layers at the position the divergent step fed.
A greedy or DDTree row also takes the evidence of the same engine's score run on the same prompt at
the positions before the divergence (the prompt's included): up to there both runs fed the same tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from k2vec.report.arrays import first_2d, stack_rows
from k2vec.report.golden_data import Golden

ROUTER_COLUMNS = ("router_diff_step", "router_diff_layer", "router_margin", "router_layer", "router_position",
                  "router_evidence")


def compare_routing(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, fs: np.ndarray,
                    score: np.ndarray, cells: dict | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Columns: the first (step, MoE layer) whose expert set differs (step < 0: a prompt position of a
    score row), and the router evidence at the divergence (margin, layer, position, evidence kind);
    and per score row that reports routing, ([positions] smallest golden margin among the decisions
    where the engine chose otherwise (inf: none), [positions] its MoE layer), for score_evidence.
    `cells`, when given, gets "route_differs" [R, N, M]: the engine's experts differ from the golden's at the
    position step j fed, in MoE layer m (False where it reports no routing or the step is not compared), and
    "first_flip_position" [R]: the first compared position where they differ (inf: none)."""
    R, N = len(datas), g.N
    cols = {c: np.full(R, np.nan) for c in ROUTER_COLUMNS}
    cols["router_evidence"] = np.full(R, None, object)
    by_pos: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    M = g.moe_layers.size
    route_differs = np.zeros((R, N, M), bool)
    first_flip = np.full(R, np.inf)
    if cells is not None:   # filled in place below
        cells["route_differs"], cells["first_flip_position"] = route_differs, first_flip
    if not M or not R:
        return cols, by_pos
    n_pos, k = g.router_ids.shape[1], g.router_ids.shape[3]
    P = g.prompt_lengths[prompt]
    # fed position of the divergent step; the last one compared
    div_pos = P - 1 + np.minimum(fs, N - 1)
    last_pos = np.where(score, P + N - 2, div_pos)
    pos = np.arange(n_pos)[None, :]
    reported = np.array([d.get("router_experts") is not None for d in datas])
    if reported.any():
        r_idx = np.flatnonzero(reported)
        # the first reported position: 0 for score rows, P-1 for the others
        first = np.where(score[r_idx], 0, P[r_idx] - 1)
        raw = stack_rows([datas[r]["router_experts"] for r in r_idx], (M, k), n_pos, -1, np.int64)
        given = np.array([len(datas[r]["router_experts"]) for r in r_idx])
        # shift greedy rows onto absolute positions (one gather for all rows)
        src = pos - first[:, None]
        inside = (src >= 0) & (src < given[:, None])
        Er = np.sort(np.take_along_axis(raw, np.clip(src, 0, n_pos - 1)[:, :, None, None], axis=1), axis=-1)
        Gr = g.router_ids[prompt[r_idx]]
        compared = inside & (pos >= first[:, None]) & (pos <= last_pos[r_idx, None])
        differ = (Er != Gr).any(-1) & compared[:, :, None]                         # [T, pos, M]
        at_step = np.take_along_axis(differ, np.clip(g.fed_positions(prompt[r_idx]), 0, n_pos - 1)[:, :, None], axis=1)
        route_differs[r_idx] = at_step
        flipped = differ.any(-1)
        first_flip[r_idx] = np.where(flipped.any(1), flipped.argmax(1), np.inf)
        anyd, p_at, m_at = first_2d(differ)
        cols["router_diff_step"][r_idx] = np.where(anyd, p_at - (P[r_idx] - 1), np.nan)
        cols["router_diff_layer"][r_idx] = np.where(anyd, g.moe_layers[m_at], np.nan)
        # evidence: the nearest-tied decision the engine took otherwise, up to the divergent step
        upto_div = differ & (pos <= div_pos[r_idx, None])[:, :, None]
        rm = np.where(upto_div, g.router_margins[prompt[r_idx]], np.inf).reshape(len(r_idx), -1)
        arg = rm.argmin(1)
        has = np.isfinite(rm[np.arange(len(r_idx)), arg])
        cols["router_margin"][r_idx] = np.where(has, rm[np.arange(len(r_idx)), arg], np.nan)
        cols["router_position"][r_idx] = np.where(has, arg // M, np.nan)
        cols["router_layer"][r_idx] = np.where(has, g.moe_layers[arg % M], np.nan)
        cols["router_evidence"][r_idx] = np.where(has, "engine routing differs", None)
        s_rows = np.flatnonzero(score[r_idx])
        if s_rows.size:
            dm = np.where(differ[s_rows], g.router_margins[prompt[r_idx[s_rows]]], np.inf)    # [S, pos, M]
            for j, (m_min, m_arg) in zip(r_idx[s_rows], zip(dm.min(-1), g.moe_layers[dm.argmin(-1)])):
                by_pos[int(j)] = (m_min, m_arg)
    u_idx = np.flatnonzero(~reported)
    if u_idx.size:   # no routing from the engine: the golden's margins at the divergent step's position
        at = g.router_margins[prompt[u_idx], div_pos[u_idx]]                       # [U, M]
        m_at = at.argmin(1)
        cols["router_margin"][u_idx] = at[np.arange(u_idx.size), m_at]
        cols["router_position"][u_idx] = div_pos[u_idx]
        cols["router_layer"][u_idx] = g.moe_layers[m_at]
        cols["router_evidence"][u_idx] = "golden margin at the divergent position"
    return cols, by_pos


def score_evidence(margin: np.ndarray, layer: np.ndarray, div_pos: int) -> tuple[float, int, int] | None:
    """(golden margin, MoE layer, position) of the nearest-tied decision the engine's score run took
    otherwise at a position up to `div_pos`, or None."""
    m = margin[:div_pos + 1]
    if not m.size or not np.isfinite(m.min()):
        return None
    pos = int(m.argmin())
    return float(m[pos]), int(layer[pos]), pos
