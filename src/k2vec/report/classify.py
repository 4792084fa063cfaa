"""Classification of each prompt row, aware of the compute precision the engine declares.

Budgets (`report.budgets` in config.yaml, one entry per declared precision) say how far an engine of
that precision may stray from the float64 golden and still be correct:

- logit_abs: largest |engine - golden| logit on the compared steps (shared top-k ids);
- hidden_rel: largest relative L2 error of a fingerprint on the compared steps (null: not checked);
- same_top1, kl_mean, kl_p99: the score run's statistics, pooled over its prompts (score.py).

A row (see docs/engine-contract.md "Report"):
- exact: tokens equal, errors within the budget;
- over-budget: tokens equal (or a score run), but the logits / hidden states (or the score run's
  statistics) exceed the budget of the declared precision: a float32 engine that is 0.5 off in its
  logits is flagged although its tokens happened not to flip;
- within-budget: a score row whose top-1 differs at some step while the run is within its budget;
- near-tie: the golden's own top-1/top-2 margin at the divergent step is below `near_tie`;
- router-near-tie: a routing near-tie at the divergence (routing.py says where the evidence comes from):
  the golden margin of a decision the engine took otherwise is below `router_near_tie`, or within twice
  what the noise model moves that margin by (a correct engine of the precision may flip it);
- precision-tie: the golden's gap between its token and the engine's at the divergent step is within
  twice the noise of a correct engine of its precision there: both logits may move by it, so the order
  can flip. That noise is never the engine's own errors (a bug inflates them): for a reduced precision
  it is the noise model's envelope at that step (report/noise.py); without a noise model, the
  precision's `logit_abs` budget;
- real: anything else, and every divergence of a row whose errors are beyond its budget, or whose
  engine on that bundle is over the noise model or has a score run over budget: a tie is only granted
  to an engine whose noise is that of its precision, so a real bug cannot hide behind its own errors.

Over-budget and real rows of an engine over the noise model say so in `over_budget`; the fixed budgets
of a reduced precision are then only an outer bound.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from k2vec.errors import K2VecError
from k2vec.report.gate import NEAR_TIE_CLASSES

PRECISION_CLASSES = ("float32", "bfloat16", "float16", "fp8")
BUDGET_KEYS = ("logit_abs", "hidden_rel", "same_top1", "kl_mean", "kl_p99")
# The same table as config.yaml's report.budgets (tests/test_report_classify.py keeps them equal).
DEFAULT_BUDGETS: dict[str, dict[str, float | None]] = {
    "float32": {"logit_abs": 1.0e-3, "hidden_rel": 1.0e-3, "same_top1": 0.98, "kl_mean": 1.0e-10, "kl_p99": 1.0e-9},
    "bfloat16": {"logit_abs": 8.0, "hidden_rel": None, "same_top1": 0.8, "kl_mean": 0.2, "kl_p99": 4.0},
    "float16": {"logit_abs": 1.0, "hidden_rel": None, "same_top1": 0.9, "kl_mean": 0.05, "kl_p99": 1.0},
    "fp8": {"logit_abs": 16.0, "hidden_rel": None, "same_top1": 0.7, "kl_mean": 0.4, "kl_p99": 6.0},
}


class BudgetError(K2VecError):
    """A `report.budgets` entry that is not a known precision, budget or number."""


def resolve_budgets(budgets: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, float | None]]:
    """The defaults with `budgets` laid over them, checked: every key known, values numbers or null."""
    out = {p: dict(b) for p, b in DEFAULT_BUDGETS.items()}
    for p, b in (budgets or {}).items():
        if p not in out:
            raise BudgetError(f"report.budgets.{p}: unknown precision; known: {', '.join(PRECISION_CLASSES)}")
        for k, v in (b or {}).items():
            if k not in BUDGET_KEYS:
                raise BudgetError(f"report.budgets.{p}.{k}: unknown budget; known: {', '.join(BUDGET_KEYS)}")
            if v is not None and not isinstance(v, (int, float)):
                raise BudgetError(f"report.budgets.{p}.{k}: {v!r} is not a number or null")
            out[p][k] = None if v is None else float(v)
    return out


def _limit(budgets, precision: pd.Series, key: str) -> np.ndarray:
    """Per row, the budget `key` of its precision; inf where not checked."""
    values = {p: (np.inf if b[key] is None else b[key]) for p, b in budgets.items()}
    return precision.map(values).fillna(np.inf).to_numpy(float)


def classify(rows: pd.DataFrame, budgets, *, near_tie: float, router_near_tie: float) -> pd.DataFrame:
    """Adds class, noise, over_budget (why, or None) to rows that carry the comparison columns, plus
    precision_class, kind (greedy | ddtree | score), run_over_budget (the score run's reasons, or None)
    and score_noise (the largest logit error of the engine's score run on the same model and weights); where a
    noise model judges the row, noise_credit, noise_over and noise_router_credit (report/noise.py)."""
    rows = rows.copy()
    kind = rows["kind"].to_numpy()
    logit_lim, hidden_lim = (_limit(budgets, rows["precision_class"], "logit_abs"),
                             _limit(budgets, rows["precision_class"], "hidden_rel"))
    is_score = kind == "score"
    has_div = rows["first_step"].notna().to_numpy()
    # A divergent step always shows an error of half the gap, and everything after it differs: a
    # greedy / DDTree divergence is checked against the budget by the errors before it (and anywhere in
    # the engine's score run on the same weights). Rows without a divergence, and score rows, by all steps.
    before = has_div & ~is_score
    # the tie credit: the noise model's at the divergent step, else the budget (never the engine's own errors)
    credit = rows["noise_credit"].to_numpy(float) if "noise_credit" in rows else np.full(len(rows), np.nan)
    noise = np.where(before, np.where(np.isfinite(credit), credit, np.where(np.isfinite(logit_lim), logit_lim, np.nan)),
                     np.nan)
    own = np.fmax(rows["noise_before"].to_numpy(float), rows["score_noise"].to_numpy(float))
    logit_err = np.where(before, own, rows["logit_abs_max"].to_numpy(float))
    hidden_err = np.where(before, rows["fingerprint_rel_before"], rows["fingerprint_rel_max"]).astype(float)
    logit_over = logit_err > logit_lim          # NaN (not reported) compares False
    hidden_over = hidden_err > hidden_lim
    what = np.where(before, " before the divergence", "")
    why = np.full(len(rows), None, object)
    why[hidden_over] = [f"fingerprint rel. error{w} {v:.3g} > hidden_rel {lim:g}" for w, v, lim in
                        zip(what[hidden_over], hidden_err[hidden_over], hidden_lim[hidden_over])]
    why[logit_over] = [f"logit error{w} {v:.3g} > logit_abs {lim:g}" for w, v, lim in
                       zip(what[logit_over], logit_err[logit_over], logit_lim[logit_over])]
    run_over = rows["run_over_budget"].to_numpy(object)
    has_run_over = pd.notna(run_over)
    why = np.where(pd.isna(why) & has_run_over, "score run over budget: " + run_over.astype(str), why)
    noise_over = rows["noise_over"].to_numpy(object) if "noise_over" in rows else np.full(len(rows), None, object)
    has_noise_over = pd.notna(noise_over)
    why = np.where(pd.isna(why) & has_noise_over, "over the noise model: " + noise_over.astype(str), why)
    untrusted = logit_over | hidden_over | has_run_over | has_noise_over
    margin, gap = rows["margin"].to_numpy(float), rows["golden_gap"].to_numpy(float)
    router = rows["router_margin"].to_numpy(float)
    near = ~untrusted & (margin < near_tie)
    # a flipped expert choice is a tie where the golden margin is below the threshold, or within what the
    # noise model moves that decision's margin by (report/noise.py router_credit)
    r_credit = rows["noise_router_credit"].to_numpy(float) if "noise_router_credit" in rows else np.nan
    router_tie = ~untrusted & ~near & ((router < router_near_tie) | (router <= r_credit))
    precision_tie = ~untrusted & ~near & ~router_tie & (gap <= 2 * noise)
    cls = np.select(
        [is_score & untrusted, is_score & ~has_div, is_score, ~has_div & untrusted, ~has_div, near, router_tie,
         precision_tie],
        ["over-budget", "exact", "within-budget", "over-budget", "exact", "near-tie", "router-near-tie",
         "precision-tie"], "real")
    # a DDTree row that leaves its own engine's greedy tokens where that run's choice led by more than rounding
    # moves (report/lossless.py) is a tree bug, whatever its distance from the golden
    lossless = rows["lossless"].to_numpy(object) if "lossless" in rows else np.full(len(rows), None, object)
    cls = np.where(pd.notna(lossless) & np.isin(cls, ["exact", *NEAR_TIE_CLASSES]), "real", cls)
    rows["class"] = cls
    rows["noise"] = noise
    rows["over_budget"] = why
    # router evidence is shown only where it is the reason for the class
    keep = cls == "router-near-tie"
    for c in ("router_margin", "router_layer", "router_position", "router_evidence"):
        rows[c] = rows[c].where(keep)
    return rows
