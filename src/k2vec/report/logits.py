"""Logits: the engine's top-k against the golden's, by token id, per compared step.

- Absolute / relative errors and llama.cpp's NMSE (sum (e-g)^2 / sum g^2) are taken over the ids both
  sides list (the golden's top-K and the engine's top-k), compared by id.
- KL(golden || engine) per step, on the top-m of each side (m = the smaller of the two k), over the
  union of the two id sets: an id one side did not list gets that side's lowest listed logit there
  (the most it can be), then both sides are softmax-normalised over the union. Disjoint top-k sets
  thus still give a KL (none would be computable on the shared ids alone); identical sets give the KL
  of the two renormalised top-m distributions.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from k2vec.report.arrays import REL_EPS, logsumexp, nan_percentile_rows, stack_rows
from k2vec.report.golden_data import Golden

LOGIT_COLUMNS = ("golden_rank_in_engine", "logit_steps", "topk_overlap", "logit_abs_max", "logit_abs_mean",
                 "logit_abs_p99", "logit_rel_max", "logit_rel_mean", "logit_rel_p99", "logit_nmse", "kl_mean",
                 "kl_p99", "kl_max", "noise_before")
STEP_COLUMNS = ["i", "step", "abs_max", "kl", "overlap", "sq_err", "sq_ref"]


def lookup(ids: np.ndarray, logits: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logit of each `want` id in (ids, logits) or NaN, found) over the last axis, batched."""
    match = want[..., :, None] == ids[..., None, :]
    found = match.any(-1)
    at = np.take_along_axis(logits, match.argmax(-1), axis=-1)
    return np.where(found, at, np.nan), found


def topk_kl(Gids, Glog, Eids, Elog) -> np.ndarray:
    """KL(golden || engine) per step [..] on the union of the two top-m id sets (module docstring)."""
    m = min(Gids.shape[-1], Eids.shape[-1])
    g_ids, g_log, e_ids, e_log = Gids[..., :m], Glog[..., :m], Eids[..., :m], Elog[..., :m]
    with np.errstate(invalid="ignore"):
        e_floor = np.nanmin(np.where(e_ids >= 0, e_log, np.nan), axis=-1, keepdims=True)
        g_floor = np.nanmin(Glog, axis=-1, keepdims=True)
    e_at_g, _ = lookup(Eids, Elog, g_ids)                                   # engine logit of the golden's ids
    g_at_e, _ = lookup(Gids, Glog, e_ids)                                   # golden logit of the engine's ids
    only_e = ~(e_ids[..., :, None] == g_ids[..., None, :]).any(-1) & (e_ids >= 0)
    p = np.concatenate([g_log, np.where(only_e, np.where(np.isnan(g_at_e), g_floor, g_at_e), -np.inf)], -1)
    q = np.concatenate([np.where(np.isnan(e_at_g), e_floor, e_at_g), np.where(only_e, e_log, -np.inf)], -1)
    lp, lq = p - logsumexp(p), q - logsumexp(q)
    with np.errstate(invalid="ignore"):
        kl = np.where(np.isfinite(p), np.exp(lp) * (lp - lq), 0.0).sum(-1)
    return np.where(np.isfinite(kl), np.maximum(kl, 0.0), np.nan)


def compare_logits(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, upto: np.ndarray,
                   fs: np.ndarray, fs_c: np.ndarray, has_div: np.ndarray, g_tok: np.ndarray
                   ) -> tuple[dict[str, np.ndarray], pd.DataFrame]:
    """Columns (LOGIT_COLUMNS) and the per-step frame (STEP_COLUMNS) for rows that report top-k logits.
    noise_before: the largest logit error on the steps before the first divergent one (the engine's own
    noise where it still fed the golden's tokens)."""
    R, N, K = len(datas), g.N, g.K
    cols = {c: np.full(R, np.nan) for c in LOGIT_COLUMNS}
    steps = pd.DataFrame(columns=STEP_COLUMNS)
    t_idx = np.array([r for r, d in enumerate(datas)
                      if d.get("topk_ids") is not None and d.get("topk_logits") is not None], np.int64)
    if not t_idx.size:
        return cols, steps
    ke = max((len(datas[r]["topk_ids"][0]) for r in t_idx if len(datas[r]["topk_ids"])), default=1)
    Eids = stack_rows([datas[r]["topk_ids"] for r in t_idx], (ke,), N, -1, np.int64)
    Elog = stack_rows([datas[r]["topk_logits"] for r in t_idx], (ke,), N, np.nan, np.float64)
    Gids, Glog = g.topk_ids[prompt[t_idx]], g.topk_logits[prompt[t_idx]]       # [T, N, K]
    e_at, found = lookup(Eids, Elog, Gids)                                     # engine logit per golden id
    shared = found & upto[t_idx][:, :, None]
    valid = shared & np.isfinite(e_at)
    err = np.where(valid, np.abs(e_at - Glog), np.nan)
    rel = err / np.maximum(np.abs(Glog), REL_EPS)
    n_valid = valid.sum(axis=(1, 2))
    some = n_valid > 0
    T = len(t_idx)
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, a in (("abs", err.reshape(T, -1)), ("rel", rel.reshape(T, -1))):
            cols[f"logit_{name}_max"][t_idx] = np.where(some, np.nanmax(a, axis=1), np.nan)
            cols[f"logit_{name}_mean"][t_idx] = np.where(some, np.nansum(a, axis=1) / np.maximum(n_valid, 1), np.nan)
            cols[f"logit_{name}_p99"][t_idx] = nan_percentile_rows(a, 99.0)
        sq_err = np.nansum(err ** 2, axis=-1)                                    # [T, N]
        sq_ref = np.where(valid, Glog, 0.0) ** 2
        sq_ref = sq_ref.sum(-1)
        cols["logit_nmse"][t_idx] = np.where(some, sq_err.sum(1) / np.maximum(sq_ref.sum(1), REL_EPS), np.nan)
        step_valid = valid.any(-1)                                                # [T, N]
        # KL needs no shared id (the union covers disjoint lists), only a listed engine logit
        listed = (Eids[..., 0] >= 0) & np.isfinite(Elog[..., 0])
        kl = np.where(upto[t_idx] & listed, topk_kl(Gids, Glog, Eids, Elog), np.nan)
        some_kl = np.isfinite(kl).any(1)
        cols["kl_mean"][t_idx] = np.where(some_kl, np.nanmean(kl, axis=1), np.nan)
        cols["kl_p99"][t_idx] = nan_percentile_rows(kl, 99.0)
        cols["kl_max"][t_idx] = np.where(some_kl, np.nanmax(kl, axis=1), np.nan)
        overlap = np.where(upto[t_idx], found.sum(-1) / K, np.nan)
        cols["topk_overlap"][t_idx] = np.nanmean(overlap, axis=1)
        step_abs = np.nanmax(np.where(step_valid[..., None], err, -np.inf), axis=-1)
        step_abs = np.where(step_valid, step_abs, np.nan)
        before = np.arange(N)[None, :] < fs[t_idx, None]
        cols["noise_before"][t_idx] = np.nanmax(np.where(before & step_valid, step_abs, -np.inf), axis=1)
    cols["noise_before"] = np.where(np.isfinite(cols["noise_before"]), cols["noise_before"], np.nan)
    cols["logit_steps"][t_idx] = step_valid.sum(1)
    # golden token's rank in the engine's top-k at the divergent step
    fst = fs_c[t_idx]
    ghit = Eids[np.arange(T), fst] == g_tok[t_idx, None]
    cols["golden_rank_in_engine"][t_idx] = np.where(has_div[t_idx] & ghit.any(1), ghit.argmax(1), np.nan)
    ti, sj = np.nonzero(upto[t_idx])
    steps = pd.DataFrame({"i": t_idx[ti], "step": sj, "abs_max": step_abs[ti, sj], "kl": kl[ti, sj],
                          "overlap": overlap[ti, sj], "sq_err": np.where(step_valid[ti, sj], sq_err[ti, sj], np.nan),
                          "sq_ref": np.where(step_valid[ti, sj], sq_ref[ti, sj], np.nan)})
    return cols, steps
