"""The one strict verdict: which rows fail the pipeline under `report.strict: true`, `python -m k2vec.report
--strict` and the report's banner alike.

A row fails when its run diverged for real, went over the budget of its declared precision
(docs/report.md), failed, or changed after it ran; and when its DDTree tree differs from the golden
trace although every token matches (a tree-construction bug: DDTree's tokens are lossless by design)."""

from __future__ import annotations

import pandas as pd

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError

# changed: a run whose result or inputs changed under it; over-budget: errors beyond the declared
# precision's budget (report/classify.py), tokens equal or not
FAILING_CLASSES = ("real", "over-budget", "failed", "changed")
TREE_DIFFERS = "tree differs"
NEAR_TIE_CLASSES = ("near-tie", "router-near-tie", "precision-tie")


class StrictFailure(K2VecError):
    pass


def verdicts(rows: pd.DataFrame) -> pd.Series:
    """Each row's strict verdict: its class, or TREE_DIFFERS for an exact row whose tree differs. `rows`
    is the report's row frame or divergence.csv read back (tree_match True/False there, "False" here)."""
    tree_differs = rows["tree_match"].astype(str) == "False"
    return rows["class"].where(~(tree_differs & (rows["class"] == "exact")), TREE_DIFFERS)


def failing(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that fail the strict verdict, with their verdict as a column."""
    flagged = rows.assign(verdict=verdicts(rows))
    return flagged[flagged["verdict"].isin(FAILING_CLASSES + (TREE_DIFFERS,))]


def strict_problem(rows: pd.DataFrame) -> str | None:
    """Why the rows fail the strict verdict, run by run; None when they pass."""
    bad = failing(rows)
    if not len(bad):
        return None
    runs = bad.groupby(["engine", "model", "precision", "mode"], sort=True)["verdict"].first()
    listing = "; ".join(f"{e}/{m}-{p}-{mode}: {c}" for (e, m, p, mode), c in runs.items())
    return (f"report.strict: {len(bad)} prompt run(s) with a real divergence, errors over the budget of the "
            f"engine's declared precision, a failure or a DDTree tree that differs from the golden: {listing} "
            f"(see results/report/divergence.html)")


def check_strict(csv_path: str, ok_path: str) -> None:
    rows = pd.read_csv(csv_path)
    problem = strict_problem(rows)
    if problem:
        raise StrictFailure(problem)
    near = int(rows["class"].isin(NEAR_TIE_CLASSES).sum())
    write_text_atomic(ok_path, f"strict: ok ({len(rows)} prompt runs, {near} near-tie divergence(s))\n")
