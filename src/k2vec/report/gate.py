"""The one strict verdict: which rows fail the pipeline under `report.strict: true`, `python -m k2vec.report
--strict` and the report's banner alike.

A row fails when its run diverged for real, went over the budget of its declared precision
(docs/report.md), matched a convention it did not declare (`convention`), failed, or changed after it ran; and when its
DDTree tree differs from the golden trace although every token matches (a tree-construction bug: DDTree's tokens are
lossless by design).
With report.fail_on_left_out, a configured engine that got no run fails it too."""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError

# changed: a run whose result or inputs changed under it; over-budget: errors beyond the declared
# precision's budget (report/classify.py), tokens equal or not; convention: off the golden but on a known
# convention's variant (report/metrics.py), which the engine did not declare: not a bug if intended, but the
# same numbers come from an engine that took the convention by accident, so only a declaration passes it
FAILING_CLASSES = ("real", "convention", "over-budget", "failed", "changed")
TREE_DIFFERS = "tree differs"
NEAR_TIE_CLASSES = ("near-tie", "router-near-tie", "precision-tie")
# engines.csv status of a configured engine that got no run (no GPU, a package missing, disabled)
LEFT_OUT = "left out"


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


def left_out_listing(left_out: Mapping[str, str]) -> str:
    """'a (why); b (why)': the configured engines that did not run."""
    return "; ".join(f"{name} ({why})" for name, why in sorted(left_out.items()))


def strict_problem(rows: pd.DataFrame, left_out: Mapping[str, str] | None = None) -> str | None:
    """Why the rows fail the strict verdict, run by run, and the engines of `left_out` (given where
    report.fail_on_left_out asks for every configured engine to run); None when they pass."""
    problems = []
    bad = failing(rows)
    if len(bad):
        runs = bad.groupby(["engine", "model", "precision", "mode"], sort=True)["verdict"].first()
        listing = "; ".join(f"{e}/{m}-{p}-{mode}: {c}" for (e, m, p, mode), c in runs.items())
        problems.append(f"{len(bad)} prompt run(s) with a real divergence, errors over the budget of the engine's "
                        f"declared precision, a failure or a DDTree tree that differs from the golden: {listing}")
    if left_out:
        problems.append(f"{len(left_out)} configured engine(s) left out, which report.fail_on_left_out does not "
                        f"allow: {left_out_listing(left_out)}")
    if not problems:
        return None
    return f"report.strict: {'; and '.join(problems)} (see results/report/divergence.html)"


def read_left_out(engines_csv: str) -> dict[str, str]:
    """The left-out engines recorded in the report's engines.csv."""
    table = pd.read_csv(engines_csv, keep_default_na=False)
    out = table[table["status"] == LEFT_OUT]
    return dict(zip(out["engine"], out["reason"]))


def check_strict(csv_path: str, ok_path: str, engines_csv: str | None = None) -> None:
    """The strict gate on divergence.csv, and on engines.csv's left-out engines when given."""
    rows = pd.read_csv(csv_path)
    problem = strict_problem(rows, read_left_out(engines_csv) if engines_csv else None)
    if problem:
        raise StrictFailure(problem)
    near = int(rows["class"].isin(NEAR_TIE_CLASSES).sum())
    write_text_atomic(ok_path, f"strict: ok ({len(rows)} prompt runs, {near} near-tie divergence(s))\n")
