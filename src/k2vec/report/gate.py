"""`report.strict: true`: fail the pipeline when a run diverged for real, went over the budget of its
declared precision (docs/report.md), or failed."""

from __future__ import annotations

import pandas as pd

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError

# changed: a run whose result or inputs changed under it; over-budget: errors beyond the declared
# precision's budget (report/classify.py), tokens equal or not
FAILING_CLASSES = ("real", "over-budget", "failed", "changed")


class StrictFailure(K2VecError):
    pass


def check_strict(csv_path: str, ok_path: str) -> None:
    rows = pd.read_csv(csv_path)
    # A DDTree tree that differs from the golden trace is a tree-construction bug even when the
    # emitted tokens (lossless by design) still match.
    tree_differs = rows["tree_match"].astype(str) == "False"
    verdict = rows["class"].where(~(tree_differs & (rows["class"] == "exact")), "tree differs")
    flagged = rows.assign(verdict=verdict)
    bad = flagged[flagged["verdict"].isin(FAILING_CLASSES + ("tree differs",))]
    if len(bad):
        runs = bad.groupby(["engine", "model", "precision", "mode"], sort=True)["verdict"].first()
        listing = "; ".join(f"{e}/{m}-{p}-{mode}: {c}" for (e, m, p, mode), c in runs.items())
        raise StrictFailure(f"report.strict: {len(bad)} prompt run(s) with a real divergence, errors over the "
                            f"budget of the engine's declared precision, a failure or a DDTree tree that "
                            f"differs from the golden: {listing} "
                            f"(see results/report/divergence.html)")
    near = int((rows["class"].isin(("near-tie", "router-near-tie", "precision-tie"))).sum())
    write_text_atomic(ok_path, f"strict: ok ({len(rows)} prompt runs, {near} near-tie divergence(s))\n")
