"""Score-mode statistics per run, the figures of llama.cpp's --kl-divergence mode: same-top-1 rate,
mean / p99 / max KL(golden || engine) (logits.py says how ids missing from one side count), logit
NMSE, and the positions with the largest KL; checked against the budget of the declared precision and, where
a noise model judges the run (report/noise.py), beside that noise model's KL: the run is over it when more
than the rule's fraction of its KL cells (positions on judged steps, up to its first flipped expert) exceed
`margin` times the largest KL of the rounding schedules there, the rule of every other kind of cell.

A score run was fed the golden tokens at every step, so every step of every prompt is compared; the
statistics are pooled over all (prompt, step) positions of the run.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k2vec.report.arrays import REL_EPS
from k2vec.report.noise import Rule, over_rule

SCORE_COLUMNS = ["run", "engine", "model", "precision", "precision_class", "reference", "prompts", "positions",
                 "same_top1", "kl_mean", "kl_p99", "kl_max", "noise_kl_mean", "noise_kl_p99", "kl_cells", "kl_beyond",
                 "logit_nmse", "top_kl", "verdict", "over_budget", "noise_over"]
TOP_KL = 5   # positions listed per run


def score_stats(rows: pd.DataFrame, steps: pd.DataFrame, budgets, noise_kl=None, rule: Rule | None = None
                ) -> pd.DataFrame:
    """One row per score run. rows: the score rows (ok status) with run, engine, model, precision,
    precision_class, reference, prompt, same_top1, where a noise model judges them noise_kl_cells and
    noise_kl_beyond (report/noise.py noise_cells), and their index = steps["row"]. noise_kl: {(model,
    precision, precision class): (mean, p99)} of the noise models' KL (NoiseModel.kl_stats); rule: theirs.
    over_budget: why the run exceeds its fixed budget; noise_over: why its KL is over its noise model."""
    noise_kl = noise_kl or {}
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
               **dict(zip(("noise_kl_mean", "noise_kl_p99"),
                          noise_kl.get((first["model"], first["precision"], first["precision_class"]), (np.nan,) * 2))),
               **_kl_cells(grp),
               "logit_nmse": float(s["sq_err"].sum() / max(s["sq_ref"].sum(), REL_EPS)) if s["sq_ref"].notna().any()
               else np.nan,
               "top_kl": "; ".join(f"p{int(r.prompt)} step {int(r.step)}: {r.kl:.3g}" for r in top.itertuples())}
        rec["over_budget"] = None if rec["reference"] else _over_budget(rec, budgets.get(rec["precision_class"]))
        rec["noise_over"] = None if rec["reference"] or rule is None else \
            over_rule("kl", rec["kl_cells"], rec["kl_beyond"], rule, "positions of its score run")
        rec["verdict"] = ("reference" if rec["reference"] else "over budget" if rec["over_budget"]
                          else "over the noise model" if rec["noise_over"] else "within budget")
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


def _kl_cells(grp: pd.DataFrame) -> dict[str, float]:
    """The run's KL cells judged by its noise model and how many are beyond it; NaN without one."""
    if "noise_kl_cells" not in grp or not grp["noise_kl_cells"].notna().any():
        return {"kl_cells": np.nan, "kl_beyond": np.nan}
    return {"kl_cells": float(grp["noise_kl_cells"].sum()), "kl_beyond": float(grp["noise_kl_beyond"].sum())}
