"""The mutation score: how many of the catalogue's realistic engine bugs (k2vec.mutation.catalogue) the vectors catch.

Every mutant's runs and the unmutated numpy engine's are judged by the same code as the divergence report
(`compute_metrics`: the same rows, the same classes, the float32 budget the mutants declare). A row of a
mutant is *caught* when its class is `real` or `over-budget`; near-tie, router-near-tie and precision-tie
never count, whatever the engine did. A mutant is caught when one of its rows is; its catch rate is
caught rows over the rows of the runs that execute its code path (the only runs it is scheduled on). The
unmutated engine's rows in the same report are the false-alarm check: none of them may be caught.

Outputs (out_dir): mutation.html (the score section, the false-alarm line, every mutant's catching
case), mutation.csv (one row per mutant), mutation_rows.csv (every judged row of the mutation run:
divergence.csv's columns plus `mutant` and `caught`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from k2vec.atomic import write_text_atomic
from k2vec.report.html import CSS, _e, _table, badge, fmt
from k2vec.report.metrics import ROW_COLUMNS, compute_metrics

CAUGHT_CLASSES = ("real", "over-budget")
REQUIRED_CATCH_RATE = 0.75
OUTPUTS = {"html": "mutation.html", "csv": "mutation.csv", "rows_csv": "mutation_rows.csv"}
SCORE_COLUMNS = [
    "mutant", "area", "caught", "catch_rate", "rows", "rows_caught", "runs", "real", "over_budget", "ties",
    "exact", "failed", "model", "precision", "mode", "accuracy", "prompt", "step", "layer", "class",
    "changes", "stands_for",
]
_MODE_ORDER = {"greedy": 0, "score": 1}


@dataclass
class MutationResult:
    scores: pd.DataFrame          # one row per mutant (mutation.csv)
    rows: pd.DataFrame            # every judged row, mutant and control (mutation_rows.csv)
    control_rows: int             # the unmutated engine's rows
    false_alarms: int             # ... of them caught
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def score(self) -> float:
        return float(self.scores["caught"].mean()) if len(self.scores) else float("nan")


def mutation_scores(rows: pd.DataFrame, mutants: Mapping[str, Mapping[str, str]]) -> pd.DataFrame:
    """Per mutant (engine name -> {name, area, changes, stands_for}): caught or not, catch rate over its
    rows, how its rows were classified, and its catching case (the earliest divergence among its caught
    rows, greedy first)."""
    out = []
    for engine, info in mutants.items():
        r = rows[rows["engine"] == engine]
        caught = r[r["class"].isin(CAUGHT_CLASSES)]
        step = caught["first_step"].astype(float).fillna(caught["first_bad_step"].astype(float))
        best = caught.assign(_step=step.fillna(np.inf), _mode=caught["mode"].map(_MODE_ORDER).fillna(2)) \
            .sort_values(["_step", "_mode", "model", "precision", "mode", "accuracy", "prompt"], kind="stable")
        first = best.iloc[0] if len(best) else None
        out.append({
            "mutant": info["name"], "area": info["area"], "caught": len(caught) > 0,
            "catch_rate": len(caught) / len(r) if len(r) else np.nan, "rows": len(r), "rows_caught": len(caught),
            "runs": r["run"].nunique(), "real": int((r["class"] == "real").sum()),
            "over_budget": int((r["class"] == "over-budget").sum()),
            "ties": int(r["class"].isin(("near-tie", "router-near-tie", "precision-tie", "within-budget")).sum()),
            "exact": int((r["class"] == "exact").sum()), "failed": int(r["class"].isin(("failed", "changed")).sum()),
            **({"model": first["model"], "precision": first["precision"], "mode": first["mode"],
                "accuracy": first["accuracy"], "prompt": first["prompt"], "step": first["_step"],
                "layer": first["first_bad_layer"], "class": first["class"]} if first is not None else {}),
            "changes": info["changes"], "stands_for": info["stands_for"],
        })
    df = pd.DataFrame(out, columns=SCORE_COLUMNS)
    df["step"] = df["step"].where(np.isfinite(df["step"].astype(float)))
    return df


def build_mutation_report(runs: Sequence[Mapping[str, Any]], goldens: Mapping[tuple[str, str], str | Path],
                          out_dir: str | Path, mutants: Mapping[str, Mapping[str, str]], control: str, *,
                          near_tie: float = 1e-3, router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                          budgets: Mapping[str, Mapping[str, Any]] | None = None) -> MutationResult:
    """Judge every run (the control engine's and each mutant's) and write the mutation score.
    mutants: engine name -> {name, area, changes, stands_for}; control: the unmutated engine's name."""
    m = compute_metrics(runs, goldens, near_tie=near_tie, router_near_tie=router_near_tie,
                        fingerprint_rtol=fingerprint_rtol, budgets=budgets)
    rows = m.rows
    names = {e: info["name"] for e, info in mutants.items()}
    rows = rows.assign(mutant=rows["engine"].map(names), caught=rows["class"].isin(CAUGHT_CLASSES))
    scores = mutation_scores(rows, mutants)
    control_rows = rows[rows["engine"] == control]
    res = MutationResult(scores, rows, len(control_rows), int(control_rows["caught"].sum()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res.paths = {k: out / v for k, v in OUTPUTS.items()}
    write_text_atomic(res.paths["csv"], scores.to_csv(index=False))
    write_text_atomic(res.paths["rows_csv"], rows[["mutant", "caught"] + ROW_COLUMNS].to_csv(index=False))
    write_text_atomic(res.paths["html"], render_mutation_html(res, control, control_rows))
    return res


def summary_line(res: MutationResult) -> str:
    s = res.scores
    weak = s[s["catch_rate"] < REQUIRED_CATCH_RATE]["mutant"].tolist()
    return (f"mutation score {int(s['caught'].sum())}/{len(s)} mutants caught ({fmt(res.score, 'pct')}); "
            f"{len(s) - len(weak)}/{len(s)} in at least {REQUIRED_CATCH_RATE:.0%} of their rows"
            + (f" (below: {', '.join(weak)})" if weak else "")
            + f"; unmutated engine: {res.false_alarms} false alarm(s) in {res.control_rows} rows")


def render_mutation_html(res: MutationResult, control: str, control_rows: pd.DataFrame) -> str:
    s = res.scores
    ok = bool(len(s)) and bool(s["caught"].all()) and res.false_alarms == 0
    header = [("mutant", ""), ("area", ""), ("caught", ""), ("catch rate", "num"), ("rows caught", "num"),
              ("real", "num"), ("over-budget", "num"), ("ties", "num"), ("exact", "num"), ("failed", "num"),
              ("first caught in", ""), ("step, layer", ""), ("class", ""), ("what it changes", ""),
              ("the real-world bug", "")]

    def where(r) -> str:
        if not r["caught"]:
            return "\u2013"
        acc = "" if pd.isna(r["accuracy"]) else f" p={r['accuracy']:g}"
        return _e(f"{r['model']}/{r['precision']} {r['mode']}{acc} prompt {int(r['prompt'])}")

    def step_layer(r) -> str:
        if pd.isna(r["step"]):
            return "\u2013"
        return f"step {int(r['step'])}" + ("" if pd.isna(r["layer"]) else f", layer {int(r['layer'])}")

    body = [[_e(r["mutant"]), _e(r["area"]), "yes" if r["caught"] else "<b>no</b>",
             ("<b>" if r["catch_rate"] < REQUIRED_CATCH_RATE else "") + fmt(r["catch_rate"], "pct"),
             f"{int(r['rows_caught'])} / {int(r['rows'])}", fmt(r["real"], "int"), fmt(r["over_budget"], "int"),
             fmt(r["ties"], "int"), fmt(r["exact"], "int"), fmt(r["failed"], "int"), where(r), step_layer(r),
             badge(r["class"]) if r["caught"] else "\u2013", _e(r["changes"]), _e(r["stands_for"])]
            for _, r in s.iterrows()]
    classes = control_rows["class"].value_counts().to_dict()
    control_line = (f"The unmutated engine <b>{_e(control)}</b> on the same runs: {len(control_rows)} rows, "
                    f"{res.false_alarms} caught (false alarms); classes: "
                    + ", ".join(f"{badge(c)} {n}" for c, n in sorted(classes.items())) + ".")
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>k2vec mutation score</title>", f"<style>{CSS}</style></head><body><main>",
        "<h1>k2vec mutation score</h1>",
        f'<section id="mutation-verdict" class="card verdict {"ok" if ok else "fail"}"><h2>{_e(summary_line(res))}</h2>'
        "<p>Each mutant is the numpy engine with one realistic fault (docs/mutants.md), run as a float32 engine "
        "on every run that executes its code path and judged by the divergence report's code. A row is caught "
        "when its class is <code>real</code> or <code>over-budget</code>; a near-tie, router-near-tie or "
        "precision-tie never counts. Catch rate: caught rows over the rows of the mutant's runs.</p></section>",
        f'<section id="mutation-control" class="card"><p>{control_line}</p></section>',
        '<section id="mutation-score"><h2>Mutants</h2><div class="card">', _table("mutation-table", header, body),
        "</div></section>", "</main></body></html>",
    ]
    return "\n".join(parts)


def write_mutation_report(runs: Sequence[Mapping[str, Any]], goldens: Any, out_dir: str | Path,
                          mutants: Mapping[str, Mapping[str, str]], control: str, *, near_tie: float = 1e-3,
                          router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                          budgets: Mapping[str, Mapping[str, Any]] | None = None) -> MutationResult:
    """Rule `mutation_report`: build_mutation_report, its summary line logged (run it inside the stage's
    stage_logging) and printed. runs: the control's and every mutant's run records; goldens: as the
    divergence report's (k2vec.report.write_report: the rule passes {"model/precision": path})."""
    import logging

    from k2vec.report import _goldens_from

    res = build_mutation_report(list(runs), _goldens_from(goldens), out_dir, dict(mutants), control,
                                near_tie=float(near_tie), router_near_tie=float(router_near_tie),
                                fingerprint_rtol=float(fingerprint_rtol), budgets=budgets)
    logging.getLogger("k2vec.mutation_report").info("%s", summary_line(res))
    print(summary_line(res))
    return res
