"""The mutation score: how many of the catalogue's realistic engine bugs (k2vec.mutation.catalogue) the vectors catch.

Every mutant's runs and the unmutated numpy engine's are judged by the same code as the divergence report
(`compute_metrics`: the same rows, the same classes, the budget or noise model of the precision the runs
declare). A row of a mutant is *caught* when its class is `real` or `over-budget`; near-tie, router-near-tie
and precision-tie never count, whatever the engine did. A mutant is caught when one of its rows is; its
catch rate is caught rows over the rows of the runs that execute its code path (the only runs it is
scheduled on). The unmutated engine's rows at each precision are the false-alarm check: none may be caught.

At a reduced precision (the numpy engine emulating it, `--precision`) a mutant is also measured against
what that precision can resolve: its *float32* runs are judged once more as if declared that precision, by
its noise model (report/noise.py), so a cell counts there when the bug's own effect, without rounding, is
beyond the envelope of correct engines. A mutant whose float32 effect is beyond the noise model (the rule's
verdict on those re-judged runs) is *resolvable*; one that is not is listed as below the precision's
resolution: run an engine's float32 build to see it.

Outputs (out_dir): mutation.html (the score section, the false-alarm line, every mutant's catching
case), mutation.csv (one row per mutant), mutation_rows.csv (every judged row of the mutation run:
divergence.csv's columns plus `mutant` and `caught`), mutation_resolution.csv (per mutant, reduced
precision and bundle: its float32 effect against that bundle's noise model, resolvable or not; the divergence
report names the mutants below each bundle's resolution from it, report/resolution.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from k2vec.atomic import write_text_atomic
from k2vec.report.html import CSS, _e, _table, badge, fmt
from k2vec.mutation.plan import TREE_AREA
from k2vec.report.metrics import ROW_COLUMNS, compute_metrics
from k2vec.report.noise import CELL_KINDS
from k2vec.report.resolution import MUTATION_RESOLUTION_COLUMNS, MUTATION_RESOLUTION_FILE

CAUGHT_CLASSES = ("real", "over-budget")
REQUIRED_CATCH_RATE = 0.75
OUTPUTS = {"html": "mutation.html", "csv": "mutation.csv", "rows_csv": "mutation_rows.csv",
           "resolution_csv": MUTATION_RESOLUTION_FILE}
SCORE_COLUMNS = [
    "mutant", "compute", "area", "caught", "catch_rate", "rows", "rows_caught", "runs", "real", "over_budget",
    "ties", "exact", "failed", "model", "precision", "mode", "accuracy", "prompt", "step", "layer", "class",
    "float32_beyond", "resolvable", "verdict", "changes", "stands_for",
]
AS_SUFFIX = "-as-"   # engine name of a float32 mutant re-judged at a reduced precision: mutant-NAME-as-bfloat16
_MODE_ORDER = {"greedy": 0, "score": 1}


@dataclass
class MutationResult:
    scores: pd.DataFrame          # one row per mutant (mutation.csv)
    rows: pd.DataFrame            # every judged row, mutant and control (mutation_rows.csv)
    control_rows: int             # the unmutated engine's rows
    false_alarms: int             # ... of them caught
    paths: dict[str, Path] = field(default_factory=dict)



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
            "mutant": info["name"], "compute": info.get("precision", "float32"), "area": info["area"],
            "caught": len(caught) > 0,
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
                          out_dir: str | Path, mutants: Mapping[str, Mapping[str, str]], controls: Mapping[str, str],
                          *, near_tie: float = 1e-3, router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                          budgets: Mapping[str, Mapping[str, Any]] | None = None,
                          noise: Mapping[tuple[str, str, str], str | Path] | None = None,
                          noise_rule: Mapping[str, Any] | None = None) -> MutationResult:
    """Judge every run (the controls' and each mutant's) and write the mutation score.
    mutants: engine name -> {name, precision (compute, default float32), area, changes, stands_for};
    controls: compute precision -> the unmutated engine's name there; noise: the reduced precisions' noise
    models ({(model, precision, class): path})."""
    # judged against the golden alone: a mutant stands for a bug, also where it equals a known convention
    # (docs/report.md "Conventions"), so no run here is judged against a convention variant
    runs = [{k: v for k, v in r.items() if k != "conventions"} for r in runs]
    reduced = sorted({info["precision"] for info in mutants.values() if info.get("precision", "float32") != "float32"})
    # each float32 mutant run once more, declared at each reduced precision: is its effect resolvable there?
    f32 = {e: info for e, info in mutants.items() if info.get("precision", "float32") == "float32"}
    rejudged = [{**r, "engine": f"{r['engine']}{AS_SUFFIX}{c}", "precision_class": c}
                for c in reduced for r in runs if r["engine"] in f32
                and (r["model"], r["precision"], c) in (noise or {})]
    m = compute_metrics(runs + rejudged, goldens, near_tie=near_tie, router_near_tie=router_near_tie,
                        fingerprint_rtol=fingerprint_rtol, budgets=budgets, noise=noise, noise_rule=noise_rule)
    as_runs = m.rows["engine"].str.contains(AS_SUFFIX, regex=False)
    rows = m.rows[~as_runs]
    names = {e: info["name"] for e, info in mutants.items()}
    rows = rows.assign(mutant=rows["engine"].map(names), caught=rows["class"].isin(CAUGHT_CLASSES))
    # a DDTree mutant's greedy runs are the reference of its lossless check (mutation/plan.py), not its code
    # path: its catch rate is over its DDTree rows
    tree = [e for e, info in mutants.items() if info["area"] == TREE_AREA]
    rows = rows[~(rows["engine"].isin(tree) & (rows["mode"] == "greedy"))]
    scores = mutation_scores(rows, mutants)
    # the mutants run at each reduced precision (their resolution is measured there only)
    planned = pd.DataFrame([(info["name"], info.get("precision", "float32")) for info in mutants.values()],
                           columns=["mutant", "compute"]).drop_duplicates()
    by_bundle = _bundle_resolution(m.noise_table, m.resolution, rows, planned, mutants, controls, m.rows[as_runs])
    scores = _resolution(scores, by_bundle)
    control_rows = rows[rows["engine"].isin(list(controls.values()))]
    res = MutationResult(scores, rows, len(control_rows), int(control_rows["caught"].sum()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res.paths = {k: out / v for k, v in OUTPUTS.items()}
    write_text_atomic(res.paths["csv"], scores.to_csv(index=False))
    write_text_atomic(res.paths["rows_csv"], rows[["mutant", "caught"] + ROW_COLUMNS].to_csv(index=False))
    write_text_atomic(res.paths["resolution_csv"], by_bundle.to_csv(index=False))
    write_text_atomic(res.paths["html"], render_mutation_html(res, controls, control_rows))
    return res


def _rejudged_names(engines: pd.Series) -> dict[str, pd.Series]:
    """mutant and compute of re-judged engine names, mutant-NAME-as-COMPUTE (AS_SUFFIX)."""
    parts = engines.str.removeprefix("mutant-").str.rsplit(AS_SUFFIX, n=1, expand=True)
    return {"mutant": parts[0], "compute": parts[1]}


def _tree_ahead(rows: pd.DataFrame, rejudged: pd.DataFrame, mutants: Mapping[str, Mapping[str, str]],
                controls: Mapping[str, str]) -> pd.Series:
    """Per (DDTree mutant, reduced compute precision, model, precision): the fraction of the mutant's float32
    DDTree rows that, judged at that precision (`rejudged`: its float32 runs declared that precision, engine
    mutant-NAME-as-COMPUTE), are caught, and leave the golden before the unmutated engine at that precision
    (`rows`, `controls`) does on the same mode, drafter accuracy and prompt (never, for a control row without a
    divergence). Judged at that precision, a divergence after a router decision a correct engine may flip is
    a router-near-tie (report/lossless.py): what the verdict can see is counted, no more."""
    key = ["mode", "accuracy", "prompt"]
    tree = {info["name"] for info in mutants.values() if info["area"] == TREE_AREA}
    if not len(rejudged):
        return pd.Series(dtype=float)
    mine = rejudged.assign(**_rejudged_names(rejudged["engine"]))
    mine = mine[mine["mutant"].isin(tree) & mine["mode"].str.startswith("ddtree")]
    out = {}
    for compute, grp in mine.groupby("compute"):
        control = controls.get(compute)
        ctl = rows[rows["engine"] == control].set_index(["model", "precision", *key])["first_step"].astype(float)
        at = pd.MultiIndex.from_frame(grp[["model", "precision", *key]])
        departs = ctl[~ctl.index.duplicated()].reindex(at).fillna(np.inf).to_numpy()
        ahead = grp["class"].isin(CAUGHT_CLASSES).to_numpy() & \
            (grp["first_step"].astype(float).fillna(np.inf).to_numpy() < departs)
        frac = grp.assign(ahead=ahead).groupby(["mutant", "model", "precision"])["ahead"].mean()
        out.update({(mu, compute, mo, pr): v for (mu, mo, pr), v in frac.items()})
    return pd.Series(out, dtype=float)


def _bundle_resolution(noise_table: pd.DataFrame, resolution: pd.DataFrame, rows: pd.DataFrame,
                       planned: pd.DataFrame, mutants: Mapping[str, Mapping[str, str]],
                       controls: Mapping[str, str], rejudged: pd.DataFrame) -> pd.DataFrame:
    """Per float32 mutant re-judged at a reduced precision and bundle (MUTATION_RESOLUTION_COLUMNS), for the
    (mutant, compute) pairs `planned` (run at that precision): the fraction of each
    kind's cells its float32 runs put beyond that bundle's noise model and the rule's verdict on them
    (resolvable); the catch rate of its runs at that precision there; below: neither (a mutant that flips an
    expert at once leaves few hidden and logit cells to judge, yet its own reduced-precision runs show it);
    the golden they were judged on."""
    t = noise_table[noise_table["engine"].str.contains(AS_SUFFIX, regex=False)] if len(noise_table) else noise_table
    if not len(t):
        return pd.DataFrame(columns=MUTATION_RESOLUTION_COLUMNS)
    out = pd.DataFrame({**_rejudged_names(t["engine"]), "model": t["model"], "precision": t["precision"]})
    for _, k in CELL_KINDS:
        out[f"{k}_beyond"] = (t[f"{k}_beyond"] / t[f"{k}_cells"].where(t[f"{k}_cells"] > 0)).to_numpy()
    ahead = _tree_ahead(rows, rejudged, mutants, controls)
    keys = pd.MultiIndex.from_frame(out[["mutant", "compute", "model", "precision"]])
    out["tree_ahead"] = ahead.reindex(keys).to_numpy(float) if len(ahead) else np.nan
    out["resolvable"] = np.where(out["tree_ahead"].notna(), out["tree_ahead"] >= REQUIRED_CATCH_RATE,
                                 t["verdict"].str.startswith("over").to_numpy())
    sha = resolution.set_index(["model", "precision", "precision_class"])["golden_sha256"]
    out["golden_sha256"] = sha.reindex(
        pd.MultiIndex.from_frame(t[["model", "precision", "precision_class"]])).to_numpy()
    out = out.merge(planned, on=["mutant", "compute"])
    rate = rows.groupby(["mutant", "precision_class", "model", "precision"])["caught"].mean()
    out["catch_rate"] = rate.reindex(
        pd.MultiIndex.from_frame(out[["mutant", "compute", "model", "precision"]])).to_numpy()
    out["below"] = ~out["resolvable"] & ~(out["catch_rate"] >= REQUIRED_CATCH_RATE)
    return (out[MUTATION_RESOLUTION_COLUMNS].sort_values(["compute", "mutant", "model", "precision"])
            .reset_index(drop=True))


def _resolution(scores: pd.DataFrame, by_bundle: pd.DataFrame) -> pd.DataFrame:
    """float32_beyond: at a reduced precision, the largest fraction of cells (hidden states, logits, KL,
    routing) that the mutant's float32 runs put beyond that precision's noise model on one bundle (a DDTree
    mutant's: of its float32 rows ahead of that precision's own departure, tree_ahead); resolvable:
    the noise rule's verdict on them on some bundle; verdict: caught (in at least REQUIRED_CATCH_RATE of its
    rows), below resolution (not resolvable and not caught so), missed (resolvable, yet not caught so), or not
    caught (float32)."""
    scores = scores.copy()
    g = by_bundle.assign(frac=by_bundle[[*(f"{k}_beyond" for _, k in CELL_KINDS), "tree_ahead"]].max(axis=1)
                         .fillna(0.0)) \
        .groupby(["mutant", "compute"]).agg(frac=("frac", "max"), over=("resolvable", "any"))
    keys = pd.MultiIndex.from_arrays([scores["mutant"], scores["compute"]])
    scores["float32_beyond"] = g["frac"].reindex(keys).to_numpy(float)
    over = g["over"].reindex(keys).to_numpy(object)
    scores["resolvable"] = np.where(scores["compute"] == "float32", True,
                                    np.where(pd.isna(over), True, over)).astype(bool)
    caught = scores["catch_rate"] >= REQUIRED_CATCH_RATE
    scores["verdict"] = np.select(
        [caught, scores["compute"] == "float32", ~scores["resolvable"]],
        ["caught", "not caught", "below resolution"], "missed")
    return scores


def summary_line(res: MutationResult) -> str:
    parts = []
    for compute, s in sorted(res.scores.groupby("compute", sort=False), key=lambda g: g[0] != "float32"):
        weak = s[s["catch_rate"] < REQUIRED_CATCH_RATE]
        below = weak[weak["verdict"] == "below resolution"]["mutant"].tolist()
        missed = weak[weak["verdict"] != "below resolution"]["mutant"].tolist()
        parts.append(f"{compute}: {int(s['caught'].sum())}/{len(s)} mutants caught ({fmt(s['caught'].mean(), 'pct')}), "
                     f"{len(s) - len(weak)}/{len(s)} in at least {REQUIRED_CATCH_RATE:.0%} of their rows"
                     + (f" (missed: {', '.join(missed)})" if missed else "")
                     + (f"; below {compute}'s resolution: {', '.join(below)}" if below else ""))
    return ("mutation score " + "; ".join(parts)
            + f"; unmutated engine: {res.false_alarms} false alarm(s) in {res.control_rows} rows")


def render_mutation_html(res: MutationResult, controls: Mapping[str, str], control_rows: pd.DataFrame) -> str:
    s = res.scores
    ok = bool(len(s)) and bool(s["verdict"].isin(["caught", "below resolution"]).all()) and res.false_alarms == 0
    header = [("mutant", ""), ("precision", ""), ("area", ""), ("verdict", ""), ("catch rate", "num"),
              ("rows caught", "num"), ("real", "num"), ("over-budget", "num"), ("ties", "num"), ("exact", "num"),
              ("failed", "num"), ("float32 effect beyond its noise model", "num"), ("first caught in", ""),
              ("step, layer", ""), ("class", ""), ("what it changes", ""), ("the real-world bug", "")]

    def where(r) -> str:
        if not r["caught"]:
            return "\u2013"
        acc = "" if pd.isna(r["accuracy"]) else f" p={r['accuracy']:g}"
        return _e(f"{r['model']}/{r['precision']} {r['mode']}{acc} prompt {int(r['prompt'])}")

    def step_layer(r) -> str:
        if pd.isna(r["step"]):
            return "\u2013"
        return f"step {int(r['step'])}" + ("" if pd.isna(r["layer"]) else f", layer {int(r['layer'])}")

    def verdict(r) -> str:
        v = _e(r["verdict"])
        return v if r["verdict"] in ("caught", "below resolution") else f"<b>{v}</b>"

    body = [[_e(r["mutant"]), _e(r["compute"]), _e(r["area"]), verdict(r),
             ("<b>" if r["catch_rate"] < REQUIRED_CATCH_RATE else "") + fmt(r["catch_rate"], "pct"),
             f"{int(r['rows_caught'])} / {int(r['rows'])}", fmt(r["real"], "int"), fmt(r["over_budget"], "int"),
             fmt(r["ties"], "int"), fmt(r["exact"], "int"), fmt(r["failed"], "int"), fmt(r["float32_beyond"], "pct"),
             where(r), step_layer(r), badge(r["class"]) if r["caught"] else "\u2013", _e(r["changes"]),
             _e(r["stands_for"])]
            for _, r in s.iterrows()]
    lines = []
    for compute, engine in controls.items():
        c = control_rows[control_rows["engine"] == engine]
        classes = c["class"].value_counts().to_dict()
        lines.append(f"The unmutated engine <b>{_e(engine)}</b> ({_e(compute)}) on the same runs: {len(c)} rows, "
                     f"{int(c['class'].isin(CAUGHT_CLASSES).sum())} caught (false alarms); classes: "
                     + ", ".join(f"{badge(k)} {n}" for k, n in sorted(classes.items())) + ".")
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        "<title>k2vec mutation score</title>", f"<style>{CSS}</style></head><body><main>",
        "<h1>k2vec mutation score</h1>",
        f'<section id="mutation-verdict" class="card verdict {"ok" if ok else "fail"}"><h2>{_e(summary_line(res))}</h2>'
        "<p>Each mutant is the numpy engine with one realistic fault (docs/mutants.md), run on every run that "
        "executes its code path, at each compute precision of <code>mutation.precisions</code> (a reduced one "
        "emulated, score runs), and judged by the divergence report's code. A row is caught "
        "when its class is <code>real</code> or <code>over-budget</code>; a near-tie, router-near-tie or "
        "precision-tie never counts. Catch rate: caught rows over the rows of the mutant's runs. At a reduced "
        "precision, <i>below resolution</i>: the bug's float32 effect is within that precision's noise model "
        "(its float32 runs judged by it), so no engine of the precision can show it; run the float32 build. "
        "<i>missed</i>: resolvable, yet caught in fewer than "
        f"{REQUIRED_CATCH_RATE:.0%} of its rows.</p></section>",
        '<section id="mutation-control" class="card">' + "".join(f"<p>{x}</p>" for x in lines) + "</section>",
        '<section id="mutation-score"><h2>Mutants</h2><div class="card">', _table("mutation-table", header, body),
        "</div></section>", "</main></body></html>",
    ]
    return "\n".join(parts)


def write_mutation_report(runs: Sequence[Mapping[str, Any]], goldens: Any, out_dir: str | Path,
                          mutants: Mapping[str, Mapping[str, str]], controls: Mapping[str, str], *,
                          near_tie: float = 1e-3, router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                          budgets: Mapping[str, Mapping[str, Any]] | None = None,
                          noise: Mapping[str, Any] | None = None,
                          noise_rule: Mapping[str, Any] | None = None) -> MutationResult:
    """Rule `mutation_report`: build_mutation_report, its summary line logged (run it inside the stage's
    stage_logging) and printed. runs: the controls' and every mutant's run records; goldens: as the
    divergence report's (k2vec.report.write_report: the rule passes {"model/precision": path}); noise:
    {"model/precision/class": path}, as the report rule's."""
    import logging

    from k2vec.report import _goldens_from, _keyed_by_three

    res = build_mutation_report(runs, _goldens_from(goldens), out_dir, dict(mutants), dict(controls),
                                near_tie=float(near_tie), router_near_tie=float(router_near_tie),
                                fingerprint_rtol=float(fingerprint_rtol), budgets=budgets,
                                noise=_keyed_by_three(noise, "noise-model", "precision_class"),
                                noise_rule=noise_rule)
    logging.getLogger("k2vec.mutation_report").info("%s", summary_line(res))
    print(summary_line(res))
    return res
