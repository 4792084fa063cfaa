"""Score-mode statistics per run, the figures of llama.cpp's --kl-divergence mode: same-top-1 rate,
mean / p99 / max KL(golden || engine) (logits.py says how ids missing from one side count), logit
NMSE, and the positions with the largest KL; checked against the budget of the declared precision.

A score run was fed the golden tokens at every step, so every step of every prompt is compared; the
statistics are pooled over all (prompt, step) positions of the run.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k2vec.report.arrays import REL_EPS

SCORE_COLUMNS = ["run", "engine", "model", "precision", "precision_class", "reference", "prompts", "positions",
                 "same_top1", "kl_mean", "kl_p99", "kl_max", "logit_nmse", "top_kl", "verdict", "over_budget"]
TOP_KL = 5   # positions listed per run


def score_stats(rows: pd.DataFrame, steps: pd.DataFrame, budgets) -> pd.DataFrame:
    """One row per score run. rows: the score rows (ok status) with run, engine, model, precision,
    precision_class, reference, prompt, same_top1, and their index = steps["row"]."""
    if rows.empty:
        return pd.DataFrame(columns=SCORE_COLUMNS)
    # float: the report's empty step frame (no run listed top-k logits) has object columns
    st = steps[steps["row"].isin(rows.index)].astype({"kl": float}).join(rows[["run", "prompt"]], on="row")
    out = []
    for run, grp in rows.groupby("run", sort=True):
        s = st[st["run"] == run]
        kl = s["kl"].to_numpy(float)
        finite = np.isfinite(kl)
        top = s[finite].nlargest(TOP_KL, "kl")
        first = grp.iloc[0]
        rec = {"run": run, "engine": first["engine"], "model": first["model"], "precision": first["precision"],
               "precision_class": first["precision_class"], "reference": bool(first["reference"]),
               "prompts": len(grp), "positions": int(finite.sum()),
               "same_top1": float(grp["same_top1"].mean()),
               "kl_mean": float(kl[finite].mean()) if finite.any() else np.nan,
               "kl_p99": float(np.percentile(kl[finite], 99)) if finite.any() else np.nan,
               "kl_max": float(kl[finite].max()) if finite.any() else np.nan,
               "logit_nmse": float(s["sq_err"].sum() / max(s["sq_ref"].sum(), REL_EPS)) if s["sq_ref"].notna().any()
               else np.nan,
               "top_kl": "; ".join(f"p{int(r.prompt)} step {int(r.step)}: {r.kl:.3g}" for r in top.itertuples())}
        rec["over_budget"] = None if rec["reference"] else _over_budget(rec, budgets.get(rec["precision_class"]))
        rec["verdict"] = "reference" if rec["reference"] else ("over budget" if rec["over_budget"] else "within budget")
        out.append(rec)
    return pd.DataFrame(out, columns=SCORE_COLUMNS)


def _over_budget(rec, budget) -> str | None:
    """Why the run's statistics exceed `budget`, or None."""
    if budget is None:
        return None
    if not rec["positions"]:
        return "no logits to score (topk_ids / topk_logits missing)"
    why = []
    if budget["same_top1"] is not None and rec["same_top1"] < budget["same_top1"]:
        why.append(f"same top-1 {rec['same_top1']:.3f} < {budget['same_top1']:g}")
    for key in ("kl_mean", "kl_p99"):
        if budget[key] is not None and rec[key] > budget[key]:
            why.append(f"{key} {rec[key]:.3g} > {budget[key]:g}")
    return "; ".join(why) or None
