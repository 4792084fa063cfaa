"""The summary text and the self-contained divergence.html (inline CSS, plots as base64 PNG).

Element ids are stable for tests and links: verdict, summary-text, summary-table, divergence-table,
tree-table, failure-table, format-effect, format-model-table, format-table, and one figure per plot
(figures.PLOTS: plot-match-grid, plot-logit-error, plot-first-bad-layer, plot-acceptance,
plot-format-effect).
"""

from __future__ import annotations

import base64
import html
import math
from typing import Any, Iterable, Sequence

import pandas as pd

from k2vec import __version__
from k2vec.model.conventions import CONVENTIONS
from k2vec.report.gate import FAILING_CLASSES, TREE_DIFFERS, failing
from k2vec.report.classes import CLASSES, SEVERITY
from k2vec.report.figures import COLORS, PLOTS, row_labels
from k2vec.report.metrics import Metrics
from k2vec.report.resolution import resolution_lines, resolution_words
from k2vec.report.words import plural

MAX_SUMMARY_ROWS = 200
MAX_DETAIL_ROWS = 300
MAX_TEXT_LINES = 10


# ------------------------------------------------------------------------------------------- values


def _na(v: Any) -> bool:
    try:
        return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
    except TypeError:
        return False


def fmt(v: Any, kind: str = "g") -> str:
    """Numbers for humans; missing values as an en dash. Kinds: "int" (thousands separated), "id" (a
    token id, as the tokenizer prints it), "rank" (0-based in the data, shown 1-based: 1 = top)."""
    if _na(v):
        return "\u2013"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "id":
        return str(int(v))
    if kind == "rank":
        return str(int(v) + 1)
    if kind == "pct":
        return f"{100 * float(v):.1f}%"
    if kind == "e":
        v = float(v)
        return "0" if v == 0 else ("inf" if math.isinf(v) else f"{v:.2e}")
    if kind == "f2":
        return f"{float(v):.2f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _step_layer(step: Any, layer: Any, short: bool = True) -> str:
    if _na(step):
        return "\u2013"
    return f"step {int(step)}, L{int(layer)}" if short else f"step {int(step)}, layer {int(layer)}"


# -------------------------------------------------------------------------------------------- text


def _row_where(r: pd.Series) -> str:
    acc = "" if _na(r["accuracy"]) else f" p={r['accuracy']:g}"
    return f"{r['engine']} {r['model']}/{r['precision']} {r['mode']}{acc} prompt {r['prompt']}"


def divergence_line(r: pd.Series) -> str:
    s = (f"{_row_where(r)}: step {int(r['first_step'])}, golden token {fmt(r['golden_token'], 'id')} vs engine "
         f"{fmt(r['engine_token'], 'id')} (golden's ranked {_rank(r['golden_rank_in_engine'])} by the engine, "
         f"engine's {_rank(r['engine_rank_in_golden'])} by the golden), "
         f"margin {fmt(r['margin'], 'e')}")
    if r["class"] == "router-near-tie":
        s += (f", router margin {fmt(r['router_margin'], 'e')} at layer {int(r['router_layer'])} "
              f"position {int(r['router_position'])} ({r['router_evidence']})")
    if r["class"] == "precision-tie" or (r["class"] == "real" and not _na(r["noise"])):
        source = "noise model" if not _na(r.get("noise_credit")) else "budget"
        s += (f", golden gap {fmt(r['golden_gap'], 'e')} vs tie credit {fmt(r['noise'], 'e')} "
              f"({r['precision_class']} {source})")
    if not _na(r["over_budget"]):
        s += f"; over budget: {r['over_budget']}"
    if not _na(r.get("lossless")):
        s += f"; not lossless: {r['lossless']}"
    return s


def why_line(r: pd.Series) -> str:
    """Why a row without a divergence from the golden has its class: over its budget, or not lossless."""
    return "; ".join(str(r[k]) for k in ("over_budget", "lossless") if not _na(r.get(k))) or "no reason recorded"


def _rank(v: Any) -> str:
    """A 0-based rank as people say it: "#1" is the top."""
    return "absent" if _na(v) else f"#{fmt(v, 'rank')}"


def _failing_counts(rows: pd.DataFrame) -> str:
    """What fails the strict verdict (report/gate.py), e.g. 'real 2, tree differs 1'."""
    counts = failing(rows)["verdict"].value_counts()
    return ", ".join(f"{v} {int(counts[v])}" for v in (*FAILING_CLASSES, TREE_DIFFERS) if v in counts)


def verdict_line(m: Metrics) -> str:
    """The one-line verdict of summary.txt and the HTML banner: it names the engines left out, so a
    report without some configured engine never reads as a clean bill for it."""
    left = sorted(m.left_out)
    left_part = [f"{plural(len(left), 'configured engine')} left out: {', '.join(left)}"
                 + (" (report.fail_on_left_out)" if m.fail_on_left_out else "")] if left else []
    if not m.strict_problem:
        n_ran = m.rows["engine"].nunique() if len(m.rows) else 0
        return "; ".join([f"OK for the {plural(n_ran, 'engine')} that ran: no real divergence, no over-budget row, "
                          f"no failed run", *left_part])
    failing_part = [_failing_counts(m.rows)] if len(failing(m.rows)) else []
    return "FAIL: " + "; ".join(failing_part + left_part)


def score_line(r: pd.Series) -> str:
    """A score run's statistics and verdict (a row of Metrics.score_runs)."""
    noise = "" if _na(r.get("kl_cells")) else (
        f" (noise model: mean {fmt(r['noise_kl_mean'], 'e')} p99 {fmt(r['noise_kl_p99'], 'e')}; "
        f"{int(r['kl_beyond'])}/{int(r['kl_cells'])} positions beyond)")
    return (f"score {r['engine']} {r['model']}/{r['precision']} ({r['precision_class'] or 'reference'}): "
            f"same top-1 {r['same_top1']:.1%}, KL mean {fmt(r['kl_mean'], 'e')} p99 {fmt(r['kl_p99'], 'e')} "
            f"max {fmt(r['kl_max'], 'e')}{noise}, NMSE {fmt(r['logit_nmse'], 'e')}: {r['verdict']}"
            + "".join(f" ({r[k]})" for k in ("over_budget", "noise_over") if not _na(r.get(k))))


def noise_lines(noise_table: pd.DataFrame, rows: pd.DataFrame) -> list[str]:
    """Each reduced-precision engine's verdict against its noise model, and a plain line for each one
    judged without a noise model."""
    lines = [f"noise model {r['engine']} {r['model']}/{r['precision']} ({r['precision_class']}): {_beyond(r)}; "
             f"{r['verdict']}" for _, r in noise_table.iterrows()]
    reduced = rows[(rows["status"] == "ok") & rows["precision_class"].notna() & (rows["precision_class"] != "float32")]
    if "noise_hidden_cells" in reduced:
        reduced = reduced[reduced["noise_hidden_cells"].isna()]
    for (e, mo, p, c), _ in reduced.groupby(["engine", "model", "precision", "precision_class"]):
        lines.append(f"noise model {e} {mo}/{p} ({c}): none given; judged by the fixed {c} budgets only, "
                     f"tie credit the logit_abs budget")
    return lines


def variant_label(variant: str) -> str:
    """A convention variant (k2vec.model.conventions.variant_key) as the report names it."""
    return " and ".join(CONVENTIONS[n].label for n in variant.split("+"))


def convention_lines(rows: pd.DataFrame) -> list[str]:
    """Per engine and bundle whose failing rows a known convention explains (class `convention`): which, and how
    to accept it; per engine that declares conventions: the variant it is judged against."""
    lines = []
    named = rows[rows["convention"].notna()] if "convention" in rows else rows.iloc[:0]
    found = named[named["class"] == "convention"]
    for (e, mo, p, v, c), grp in found.groupby(["engine", "model", "precision", "convention", "precision_class"]):
        why = grp["over_budget"].dropna()
        lines.append(f"CONVENTION: {e} {mo}/{p}: {plural(len(grp), 'row')} off the golden"
                     + (f" ({why.iloc[0]})" if len(why) else "")
                     + f" match the variant {variant_label(v)} within the {c} budget: a known convention, not a bug "
                       f"if intended; undeclared, it fails the strict gate: declare it (engines.{e}.conventions: "
                       f"[{', '.join(v.split('+'))}]) to judge {e} against it")
    declared = named[named["class"] != "convention"]
    for (e, v), grp in declared.groupby(["engine", "convention"]):
        lines.append(f"convention: {e} judged against the variant {variant_label(v)} "
                     f"(declared: engines.{e}.conventions), not the golden")
    return lines


def tamper_lines(m: Metrics) -> list[str]:
    """One line when some verdicts are not tamper-proof (report/integrity.py), with each distinct why."""
    rows = m.rows
    if not len(rows) or "tamper_proof" not in rows:
        return []
    bad = rows[rows["tamper_proof"] != True]  # noqa: E712
    if not len(bad):
        return [f"  tamper-proof: all {plural(rows['run'].nunique(), 'run')} (sandboxed, keyed records intact)"]
    runs = bad.drop_duplicates("run")
    notes = sorted({str(n) for n in runs["tamper_note"].dropna()})
    lines = [f"  NOT TAMPER-PROOF: {runs['run'].nunique()} of {plural(rows['run'].nunique(), 'run')} "
             f"({plural(len(bad), 'row')}, column tamper_proof); why:"]
    lines += [f"    - {n}" for n in notes[:MAX_TEXT_LINES]]
    return lines


def summary_text(m: Metrics) -> str:
    rows, lines = m.rows, []
    n_runs = rows["run"].nunique() if len(rows) else 0
    counts = rows["class"].value_counts()
    lines.append(f"k2vec divergence report: {plural(n_runs, 'run')}, "
                 f"{plural(rows['engine'].nunique() if len(rows) else 0, 'engine')}, {plural(len(rows), 'prompt row')}")
    lines.append("  " + " | ".join(f"{c} {int(counts.get(c, 0))}" for c in CLASSES))
    lines.append("  " + verdict_line(m))
    lines.extend(tamper_lines(m))
    for name, why in sorted(m.left_out.items()):
        lines.append(f"  LEFT OUT: {name}: {why}")
    for cls in ("real", "over-budget", "router-near-tie", "precision-tie", "near-tie"):
        sub = rows[rows["class"] == cls].sort_values(["run", "prompt"])
        for _, r in sub.head(MAX_TEXT_LINES).iterrows():
            if r["first_step"] is pd.NA or _na(r["first_step"]):
                lines.append(f"  {cls.upper()}: {_row_where(r)}: {why_line(r)}")
            else:
                lines.append(f"  {cls.upper()}: {divergence_line(r)}")
        if len(sub) > MAX_TEXT_LINES:
            lines.append(f"  ... and {plural(len(sub) - MAX_TEXT_LINES, f'more {cls} row')} (divergence.csv)")
    failed = m.runs[m.runs["status"] != "ok"] if len(m.runs) else m.runs
    for _, r in failed.drop_duplicates("run").head(MAX_TEXT_LINES).iterrows():
        label = "CHANGED" if r["status"] == "changed" else "FAILED"
        lines.append(f"  {label}: {r['engine']} {r['model']}/{r['precision']} {r['mode']}: {r['reason']}")
    if len(failed.drop_duplicates("run")) > MAX_TEXT_LINES:
        lines.append(f"  ... and {plural(len(failed.drop_duplicates('run')) - MAX_TEXT_LINES, 'more failed run')}")
    lines += ["  " + line for line in convention_lines(rows)]
    lines += ["  " + score_line(r) for _, r in m.score_runs.iterrows()]
    lines += ["  " + line for line in noise_lines(m.noise_table, rows)]
    lines += ["  " + line for line in resolution_lines(m.resolution, rows, m.noise_table, m.float32_engines,
                                                       m.left_out)]
    fp = rows.dropna(subset=["first_bad_step"])
    if len(fp):
        r = fp.sort_values(["first_bad_step", "first_bad_layer"]).iloc[0]
        lines.append(f"  fingerprints: {plural(len(fp), 'row exceeds', 'rows exceed')} "
                     f"rtol {m.thresholds['fingerprint_rtol']:g}; earliest "
                     f"{_row_where(r)} {_step_layer(r['first_bad_step'], r['first_bad_layer'], False)} "
                     f"(rel err {fmt(r['first_bad_rel_err'], 'e')})")
    rt = rows.dropna(subset=["router_diff_step"])
    if len(rt):
        r = rt.sort_values(["router_diff_step", "router_diff_layer"]).iloc[0]
        lines.append(f"  router: {plural(len(rt), 'row chooses', 'rows choose')} different experts; "
                     f"earliest {_row_where(r)} {_step_layer(r['router_diff_step'], r['router_diff_layer'], False)}")
    trees = rows["tree_match"].dropna()
    if len(trees):
        bad = rows[rows["tree_match"] == False]  # noqa: E712
        line = (f"  DDTree: {len(bad)} of {plural(len(trees), 'tree')} {'differs' if len(bad) == 1 else 'differ'} "
                "from the golden traces")
        if len(bad):
            r = bad.iloc[0]
            node = "" if _na(r["first_tree_diff_node"]) else f" node {int(r['first_tree_diff_node'])}"
            line += f"; first: {_row_where(r)} round {int(r['first_tree_diff_round'])}{node}: {r['tree_diff_what']}"
        lines.append(line)
    dd = rows[rows["mode"].astype(str).str.startswith("ddtree") & (rows["status"] == "ok")]
    no_trace = dd[dd["accept_mean_golden"].isna()]
    no_rounds = dd[dd["accept_mean_golden"].notna() & dd["tree_match"].isna()]
    if len(no_trace):
        lines.append(f"  DDTree: no golden trace for {', '.join(sorted(set(no_trace['mode'])))} "
                     f"(budget not in the golden): {plural(len(no_trace), 'row')} compared by tokens only")
    if len(no_rounds):
        lines.append(f"  DDTree: {plural(len(no_rounds), 'row')} without rounds in the result: trees not compared")
    if len(m.runs) and m.runs["accept_mean_engine"].notna().any():
        a = m.runs.dropna(subset=["accept_mean_engine"])
        lines.append(f"  DDTree mean acceptance: engines {a['accept_mean_engine'].mean():.3f}, "
                     f"golden {a['accept_mean_golden'].mean():.3f}")
    if len(m.runs) and m.runs["tokens_per_s"].notna().any():
        t = m.runs.drop_duplicates("run")["tokens_per_s"].dropna()
        lines.append(f"  throughput: {t.median():.1f} tokens/s median over {plural(len(t), 'run')} (wall clock)")
    for _, r in m.format_models.iterrows():
        lines.append(f"  format effect {r['model']} (fp32 vs int4 golden): {r['diverged']} of "
                     f"{plural(int(r['prompts']), 'prompt')} {'diverges' if r['diverged'] == 1 else 'diverge'}; "
                     f"same top-1 {100 * r['same_top1_rate']:.1f}% of compared steps; mean KL "
                     f"{fmt(r['kl_mean'], 'e')}")
    blind = m.prompt_strength[m.prompt_strength["blind"]] if not m.prompt_strength.empty else m.prompt_strength
    if len(blind):   # their rows cannot show a real divergence: say so next to the verdict
        lines.append("  golden: blind prompt(s), near-tied at a prompt position: " + ", ".join(
            f"{r['model']}/{r['precision']} p{r['prompt']}" for _, r in blind.iterrows()))
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------- HTML


CSS = """
:root { --fg:#1f2933; --muted:#616e7c; --line:#e4e7eb; --bg:#f7f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Arial, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; }
main { max-width: 1800px; margin: 0 auto; padding: 18px 22px 60px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 2px solid var(--line); }
.sub { color: var(--muted); margin: 0 0 14px; }
.card { background: white; border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; margin: 10px 0;
        overflow-x: auto; }
.verdict { border-left: 6px solid; }
.verdict.ok { border-left-color: #43a047; }
.verdict.fail { border-left-color: #e53935; }
.verdict h2 { border: 0; margin: 0 0 6px; padding: 0; }
pre { font: 12px/1.4 "DejaVu Sans Mono", Menlo, Consolas, monospace; white-space: pre-wrap; margin: 0; }
table { border-collapse: collapse; width: 100%; font-size: 12.5px; }
th, td { padding: 4px 7px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; \
white-space: nowrap; }
th { background: #f0f2f5; position: sticky; top: 0; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { white-space: normal; min-width: 200px; max-width: 420px; }
/* the divergent-prompts table fits a 1400-px window: its headers, run labels and router notes wrap */
#divergence-table th { white-space: normal; }
#divergence-table td.label { white-space: normal; overflow-wrap: anywhere; min-width: 120px; max-width: 220px; }
#divergence-table td.note-cell { white-space: normal; min-width: 90px; max-width: 150px; }
.reason { color: #b71c1c; font-size: 11.5px; margin-top: 2px; }
tr:hover td { background: #fafbfc; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 11.5px; font-weight: 600; }
.bar { display: inline-flex; width: 110px; height: 12px; border-radius: 3px; overflow: hidden; vertical-align: middle;
       background: #eee; }
.bar span { display: block; height: 100%; }
.legend span { margin-right: 10px; }
figure { margin: 12px 0; background: white; border: 1px solid var(--line); border-radius: 8px; padding: 10px; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12.5px; margin-top: 6px; }
.note { color: var(--muted); font-size: 12.5px; }
details summary { cursor: pointer; color: #1565c0; }
dl.defs dt { font-weight: 600; margin-top: 6px; }
dl.defs dd { margin: 0 0 0 16px; color: #3e4c59; }
"""


def _beyond(r: pd.Series) -> str:
    """'hidden 3/270, logits 0/90, KL 0/90, routing 1/180 cells beyond' of a noise_table row."""
    parts = [f"{what} {int(r[k + '_beyond'])}/{int(r[k + '_cells'])}"
             for what, k in (("hidden", "hidden"), ("logits", "logit"), ("KL", "kl"), ("routing", "router"))]
    return ", ".join(parts) + " cells beyond"


def _noise_section(m: Metrics) -> str:
    t = m.noise_table
    if t.empty:
        return ""
    rule = m.thresholds.get("noise_rule", {})
    header = [("engine", ""), ("model/precision", ""), ("precision", ""), ("cells beyond", "wrap"),
              ("held-out correct schedule, worst", "num"), ("verdict", "wrap")]
    body = [[_e(r["engine"]), _e(f"{r['model']}/{r['precision']}"), _e(r["precision_class"]), _e(_beyond(r)),
             fmt(r["held_out_worst"], "pct"), _e(r["verdict"])] for _, r in t.iterrows()]
    return ('<section id="noise"><h2>Noise model</h2><div class="card"><p class="note">Each reduced-precision '
            'engine against what correct engines of its precision show on the same case (emulated rounding '
            f'schedules, docs/report.md "Noise model"): a cell is beyond at over {rule.get("margin", 0):g}x their '
            f'largest error ({rule.get("margin", 0) ** 2:g}x their largest KL); over the noise model at more than '
            f'{rule.get("fraction", 0):.0%} of at least '
            f'{rule.get("min_cells", 0)} cells of a kind. The held-out column is the worst fraction a correct '
            'schedule shows when judged against the others: the rule\'s false-alarm margin on this case.</p>'
            + _table("noise-table", header, body) + "</div>" + _resolution_card(m) + "</section>")


def _resolution_card(m: Metrics) -> str:
    """Per bundle and precision: the smallest errors its verdict resolves, the mutants below them, and the
    clean engines with their float32 run (report/resolution.py)."""
    from k2vec.report.resolution import clean_engines, float32_advice

    res = m.resolution
    if res.empty:
        return ""
    rule = m.thresholds.get("noise_rule", {})
    clean = clean_engines(m.rows, m.noise_table)
    header = [("model/precision", ""), ("precision", ""), ("resolves", "wrap"), ("judged steps", "num"),
              ("catalogue mutants below it (float32 effect)", "wrap"),
              ("clean engines: the run that sees below", "wrap")]
    body = []
    for _, r in res.iterrows():
        below = r["below"]
        mine = clean[(clean["model"] == r["model"]) & (clean["precision"] == r["precision"])
                     & (clean["precision_class"] == r["precision_class"])]["engine"]
        body.append([_e(f"{r['model']}/{r['precision']}"), _e(r["precision_class"]), _e(resolution_words(r)),
                     fmt(r["step_cells"], "int"),
                     _e(r["mutation_note"]) if not isinstance(below, list) else _e(", ".join(below) or "none"),
                     "<br>".join(f"<b>{_e(e)}</b>: {_e(float32_advice(e, m.float32_engines, m.left_out))}"
                                 for e in mine)
                     or "\u2013"])
    return ('<div class="card" id="resolution"><p class="note">Resolution: the smallest error of each kind that '
            'the verdict calls over the noise model, were an engine off by it at every cell: '
            f'{rule.get("margin", 0):g}x '
            f'the noise model\'s largest error at the {rule.get("fraction", 0):.0%} quantile of judged cells, '
            f'{rule.get("margin", 0) ** 2:g}x for KL, which is second order in the logit error (docs/report.md '
            '"Resolution"). An engine of that precision that passes clean is clean down to it, no '
            'further; the mutation run names the catalogue\'s bugs whose float32 effect stays below it.</p>'
            + _table("resolution-table", header, body) + "</div>")


def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


def badge(cls: str) -> str:
    fg = "#1f2933" if cls in ("near-tie", "exact") else "white"
    return f'<span class="badge cls-{_e(cls)}" style="background:{COLORS.get(cls, "#999")};color:{fg}">{_e(cls)}</span>'


def _class_bar(r: pd.Series, total: int) -> str:
    parts = "".join(f'<span title="{c}: {int(r[c])}" '
                    f'style="width:{100 * r[c] / total:.2f}%;background:{COLORS[c]}"></span>'
                    for c in CLASSES if r[c])
    return f'<span class="bar">{parts}</span>'


def _table(table_id: str, header: Sequence[tuple[str, str]], body: Iterable[Sequence[str]]) -> str:
    """header: (label, css class); body cells are already HTML."""
    head = "".join(f'<th class="{c}">{_e(h)}</th>' for h, c in header)
    rows = "".join("<tr>" + "".join(f'<td class="{c}">{cell}</td>' for cell, (_, c) in zip(r, header)) + "</tr>"
                   for r in body)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def _capped(df: pd.DataFrame, cap: int, what: str) -> tuple[pd.DataFrame, str]:
    if len(df) <= cap:
        return df, ""
    return df.head(cap), f'<p class="note">Showing the first {cap:,} of {len(df):,} {what}; divergence.csv has all.</p>'


def _summary_table(m: Metrics) -> str:
    runs = m.runs
    if runs.empty:
        return '<p class="note" id="summary-table">No engine runs.</p>'
    runs = runs.assign(sev=runs["worst"].map(SEVERITY)).sort_values(["sev", "run", "accuracy"],
                                                                     ascending=[False, True, True], kind="stable")
    runs, note = _capped(runs, MAX_SUMMARY_ROWS, "run x accuracy rows (worst first)")
    header = [("run", "wrap"), ("precision", ""), ("worst", ""), ("prompts", ""), ("exact", "num"),
              ("first div. step", "num"),
              ("max |\u0394logit|", "num"), ("max KL", "num"), ("bad fingerprint", ""),
              ("router diff step", "num"), ("trees differ", "num"), ("\u03c4 eng / gold", "num"), ("tok/s", "num"),
              ("GPU", "wrap")]
    body = []
    for _, r in runs.iterrows():
        tau = ("\u2013" if _na(r["accept_mean_engine"])
               else f"{r['accept_mean_engine']:.2f} / {r['accept_mean_golden']:.2f}")
        trees = "\u2013" if not r["trees"] else f"{int(r['trees_differ'])} of {int(r['trees'])}"
        body.append([
            _e(r["label"]) + ("" if _na(r["reason"]) else f'<div class="reason">{_e(r["reason"])}</div>'),
            _e(r["precision_class"]), badge(r["worst"]), _class_bar(r, int(r["prompts"])),
            f"{int(r['exact'])}/{int(r['prompts'])}", fmt(r["first_step"], "int"), fmt(r["logit_abs_max"], "e"),
            fmt(r["kl_max"], "e"), _step_layer(r["first_bad_step"], r["first_bad_layer"]),
            fmt(r["router_diff_step"], "int"), trees, tau, fmt(r["tokens_per_s"], "f2"),
            "\u2013" if _na(r["gpu"]) else _e(r["gpu"]),
        ])
    legend = '<p class="legend note">' + "".join(f"<span>{badge(c)}</span>" for c in CLASSES) + "</p>"
    return legend + _table("summary-table", header, body) + note


def _divergence_table(m: Metrics) -> str:
    rows = m.rows
    d = rows[rows["class"].isin(["near-tie", "router-near-tie", "precision-tie", "real"]) & (rows["mode"] != "score")]
    if d.empty:
        return '<p class="note" id="divergence-table">No token divergence.</p>'
    d = d.assign(sev=d["class"].map(SEVERITY), label=row_labels(d)).sort_values(
        ["sev", "run", "accuracy", "prompt"], ascending=[False, True, True, True], kind="stable")
    d, note = _capped(d, MAX_DETAIL_ROWS, "divergent prompts (worst first)")
    header = [("run", "label"), ("prompt", "num"), ("class", ""), ("step", "num"),
              ("token golden \u2192 engine", "num"),
              ("ranks g\u2208e / e\u2208g", "num"), ("golden margin", "num"), ("gap / noise", "num"),
              ("router near-tie", "note-cell"), ("max |\u0394logit|", "num"), ("max KL", "num"),
              ("first bad fingerprint", "note-cell"), ("router differs", "note-cell")]
    body = []
    for _, r in d.iterrows():
        router = "\u2013" if _na(r["router_layer"]) else \
            f"layer {int(r['router_layer'])}, pos {int(r['router_position'])} ({fmt(r['router_margin'], 'e')})"
        body.append([
            _e(r["label"]), str(int(r["prompt"])), badge(r["class"]), fmt(r["first_step"], "int"),
            f"{fmt(r['golden_token'], 'id')} \u2192 {fmt(r['engine_token'], 'id')}",
            f'{fmt(r["golden_rank_in_engine"], "rank")} / {fmt(r["engine_rank_in_golden"], "rank")}',
            fmt(r["margin"], "e"), f'{fmt(r["golden_gap"], "e")} / {fmt(r["noise"], "e")}', router,
            fmt(r["logit_abs_max"], "e"), fmt(r["kl_max"], "e"),
            _step_layer(r["first_bad_step"], r["first_bad_layer"]),
            _step_layer(r["router_diff_step"], r["router_diff_layer"]),
        ])
    return _table("divergence-table", header, body) + note


def _score_table(m: Metrics) -> str:
    sr = m.score_runs
    if sr.empty:
        return '<p class="note" id="score-table">No score run.</p>'
    sr = sr.sort_values(["reference", "engine", "model", "precision"], kind="stable")
    header = [("engine", ""), ("model/precision", ""), ("precision", ""), ("positions", "num"),
              ("same top-1", "num"), ("KL mean", "num"), ("KL p99", "num"), ("KL max", "num"),
              ("noise model KL mean / p99", "num"), ("KL beyond the noise model", "num"), ("NMSE", "num"),
              ("verdict", ""), ("largest KL at", "wrap")]
    body = []
    for _, r in sr.iterrows():
        why = "; ".join(str(r[k]) for k in ("over_budget", "noise_over") if not _na(r.get(k)))
        verdict = _e(r["verdict"]) + (f": {_e(why)}" if why else "")
        body.append([_e(r["engine"]), _e(f"{r['model']}/{r['precision']}"), _e(r["precision_class"] or "\u2013"),
                     str(int(r["positions"])), f"{r['same_top1']:.1%}", fmt(r["kl_mean"], "e"), fmt(r["kl_p99"], "e"),
                     fmt(r["kl_max"], "e"), f'{fmt(r["noise_kl_mean"], "e")} / {fmt(r["noise_kl_p99"], "e")}',
                     "\u2013" if _na(r["kl_cells"]) else f'{int(r["kl_beyond"])} / {int(r["kl_cells"])}',
                     fmt(r["logit_nmse"], "e"), verdict, _e(r["top_kl"])])
    return ('<p class="note">Every engine fed the golden tokens (score mode): its distribution at every '
            'position against the golden\'s. The int4-format rows are the int4 golden model forced on the fp32 '
            'golden sequence: what INT4 itself costs, for scale. A reduced-precision run is set beside its noise '
            'model: the largest mean and p99 KL of the correct rounding schedules on the same bundle, and its '
            'positions whose KL is beyond the noise rule\'s margin times theirs (over the noise model past the '
            'rule\'s fraction, docs/report.md "Score statistics").</p>' + _table("score-table", header, body))


def _tree_table(m: Metrics) -> str:
    rows = m.rows
    if rows["tree_match"].notna().sum() == 0:
        return '<p class="note" id="tree-table">No DDTree run returned rounds.</p>'
    bad = rows[rows["tree_match"] == False]  # noqa: E712
    n = int(rows["tree_match"].notna().sum())
    if bad.empty:
        return (f'<p class="note" id="tree-table">{"The" if n == 1 else "All"} {plural(n, "DDTree trace")} '
                f'{"matches" if n == 1 else "match"} the golden trees exactly.</p>')
    bad = bad.assign(label=row_labels(bad))
    bad, note = _capped(bad, MAX_DETAIL_ROWS, "differing trees")
    header = [("run", ""), ("prompt", "num"), ("class", ""), ("round", "num"), ("node", "num"),
              ("what differs", "wrap"), ("\u03c4 engine", "num"), ("\u03c4 golden", "num")]
    body = [[_e(r["label"]), str(int(r["prompt"])), badge(r["class"]), fmt(r["first_tree_diff_round"], "int"),
             fmt(r["first_tree_diff_node"], "int"), _e(r["tree_diff_what"]), fmt(r["accept_mean_engine"], "f2"),
             fmt(r["accept_mean_golden"], "f2")] for _, r in bad.iterrows()]
    return (f'<p class="note">{len(bad)} of {plural(n, "DDTree trace")} '
            f'{"differs" if len(bad) == 1 else "differ"} from the golden.</p>'
            + _table("tree-table", header, body) + note)


def _failure_table(m: Metrics) -> str:
    runs = m.runs
    failed = runs[runs["status"] != "ok"].drop_duplicates("run") if len(runs) else runs
    if failed.empty:
        return '<p class="note" id="failure-table">No failed runs.</p>'
    failed, note = _capped(failed, MAX_DETAIL_ROWS, "failed runs")
    header = [("engine", ""), ("model/precision", ""), ("mode", ""), ("reason", "wrap"), ("stderr tail", "wrap"),
              ("result", "")]
    body = []
    for _, r in failed.iterrows():
        tail = r.get("stderr_tail")
        tail_html = "\u2013" if _na(tail) or not tail else \
            f"<details><summary>show</summary><pre>{_e(tail)}</pre></details>"
        body.append([_e(r["engine"]), _e(f"{r['model']}/{r['precision']}"), _e(r["mode"]), _e(r["reason"]),
                     tail_html, _e(r["result"])])
    return _table("failure-table", header, body) + note


def _format_section(m: Metrics) -> str:
    out = ['<section id="format-effect"><h2>Format effect (fp32 vs int4 golden)</h2>',
           '<p class="note">How far INT4 quantization moves the model: the int4 golden compared to the fp32 golden '
           'as if it were an engine. Both decode their own tokens, so steps are compared up to and including the '
           'first divergence. Same top-1 = matched steps / compared steps, pooled over prompts. Compared: the prompts '
           'both goldens share (the int4 prompts stage re-draws a prompt blind under the int4 weights).</p>']
    if m.format_models.empty:
        out.append('<p class="note" id="format-model-table">No model has both an fp32 and an int4 golden.</p>')
    else:
        header = [("model", ""), ("prompts", "num"), ("diverged", "num"), ("same top-1", "num"),
                  ("mean first div. step", "num"), ("mean KL", "num"), ("max KL", "num"), ("top-k overlap", "num"),
                  ("max |\u0394logit|", "num")]
        body = [[_e(r["model"]),
                 str(r["prompts"]) + (f" (int4 re-drew {', '.join(map(str, r['int4_redrawn_prompts']))})"
                                      if len(r["int4_redrawn_prompts"]) else ""),
                 str(r["diverged"]), fmt(r["same_top1_rate"], "pct"),
                 fmt(r["mean_first_step"], "f2"), fmt(r["kl_mean"], "e"), fmt(r["kl_max"], "e"),
                 fmt(r["topk_overlap"], "pct"), fmt(r["logit_abs_max"], "e")] for _, r in m.format_models.iterrows()]
        out.append('<div class="card">' + _table("format-model-table", header, body) + "</div>")
        header = [("model", ""), ("prompt", "num"), ("class", ""), ("first div. step", "num"),
                  ("fp32 \u2192 int4 token", "num"), ("fp32 rank in int4", "num"), ("int4 rank in fp32", "num"),
                  ("fp32 margin", "num"), ("int4 margin", "num"), ("same top-1", "num"), ("mean KL", "num"),
                  ("max |\u0394logit|", "num"), ("first bad fingerprint", ""), ("router differs", "")]
        body = []
        for _, r in m.format_effect.iterrows():
            body.append([_e(r["model"]), str(int(r["prompt"])), badge(r["class"]), fmt(r["first_step"], "int"),
                         f"{fmt(r['fp32_token'], 'id')} \u2192 {fmt(r['int4_token'], 'id')}",
                         fmt(r["fp32_rank_in_int4"], "rank"), fmt(r["int4_rank_in_fp32"], "rank"),
                         fmt(r["fp32_margin"], "e"),
                         fmt(r["int4_margin"], "e"), fmt(r["same_top1"], "pct"), fmt(r["kl_mean"], "e"),
                         fmt(r["logit_abs_max"], "e"), _step_layer(r["first_bad_step"], r["first_bad_layer"]),
                         _step_layer(r["router_diff_step"], r["router_diff_layer"])])
        out.append('<div class="card">' + _table("format-table", header, body) + "</div>")
    return "\n".join(out)


def _strength_section(m: Metrics) -> str:
    """The goldens' strength: a degenerate golden (few distinct tokens, experts never routed to, many
    near-ties) or a blind prompt (near-tied at a prompt position) shows here at a glance."""
    out = ['<section id="golden-strength"><h2>Golden strength</h2>',
           '<p class="note">What each golden exercises. Near-tie fractions: generated steps with a top-1/top-2 '
           'gap under near_tie, and router decisions (every fed position x MoE layer) with a margin under '
           'router_near_tie. Experts / groups: routed to at least once, per MoE layer. A prompt is <b>blind</b> '
           'when the golden is near-tied at one of its prompt positions (smallest router margin or step-0 gap '
           'under its threshold): every divergence of its rows would then be excused as a near-tie.</p>']
    if m.golden_strength.empty:
        return "\n".join(out + ['<p class="note" id="strength-table">No golden.</p></section>'])

    def of(counts, total):
        return "\u2013" if counts is None else ", ".join(f"{c}/{total}" for c in counts)

    header = [("golden", ""), ("steps", "num"), ("token near-ties", "num"), ("router near-ties", "num"),
              ("experts per MoE layer", "num"), ("groups per MoE layer", "num"), ("blind prompts", "num")]
    ps = m.prompt_strength
    body = []
    for _, r in m.golden_strength.iterrows():
        mine = ps[(ps["model"] == r["model"]) & (ps["precision"] == r["precision"])]
        body.append([_e(f"{r['model']}/{r['precision']}"), str(r["steps"]), fmt(r["token_near_tie"], "pct"),
                     fmt(r["router_near_tie"], "pct"), of(r["experts_routed"], r["n_routed_experts"]),
                     of(r["groups_routed"], r["n_group"]), f"{int(mine['blind'].sum())} of {len(mine)}"])
    out.append('<div class="card">' + _table("strength-table", header, body) + "</div>")
    header = [("golden", ""), ("prompt", "num"), ("length", "num"), ("distinct tokens", "num"),
              ("min router margin (prompt)", "num"), ("step-0 margin", "num"), ("blind", "")]
    body = [[_e(f"{r['model']}/{r['precision']}"), str(r["prompt"]), str(r["prompt_length"]),
             str(r["distinct_tokens"]), fmt(r["prompt_router_margin"], "e"), fmt(r["step0_margin"], "e"),
             "blind" if r["blind"] else "no"] for _, r in ps.iterrows()]
    out.append('<div class="card">' + _table("prompt-strength-table", header, body) + "</div></section>")
    return "\n".join(out)


def _figure(name: str, png: bytes) -> str:
    fid, caption = PLOTS[name]
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure id="{fid}"><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
            f'<figcaption>{_e(caption)} <span class="note">({_e(name)})</span></figcaption></figure>')


def _left_out_list(m: Metrics) -> str:
    """The banner's list of configured engines that did not run, each with its reason."""
    if not m.left_out:
        return ""
    items = "".join(f"<li><b>{_e(name)}</b>: {_e(why)}</li>" for name, why in sorted(m.left_out.items()))
    return f'<p>Not judged (left out of this run):</p><ul id="left-out">{items}</ul>'


def render_html(m: Metrics, pngs: dict[str, bytes], summary: str) -> str:
    th = m.thresholds
    rows = m.rows
    ok = not m.strict_problem
    n_runs = rows["run"].nunique() if len(rows) else 0
    defs = {
        "exact": "every generated token equals the golden's, and the logit / fingerprint errors are within the "
                 "budget of the engine's declared precision (report.budgets).",
        "within-budget": "a score run's row whose top-1 differs at some position, the run's statistics within budget.",
        "near-tie": f"first divergent step's golden top-1 minus top-2 logit &lt; near_tie = {th['near_tie']:g}.",
        "router-near-tie": f"otherwise, a routing near-tie at the divergence: where the engine reports its routing, "
                           f"it chose other experts than the golden, up to the divergent step, at a decision whose "
                           f"golden router margin (k-th minus (k+1)-th expert score, or the kept groups' lead) is "
                           f"&lt; router_near_tie = {th['router_near_tie']:g}, or within twice the margin by which "
                           f"the noise model moves that decision; where it does not, the golden router margin at "
                           f"the position fed at the divergent step is.",
        "precision-tie": "otherwise, the golden's gap between its token and the engine's at the divergent step is "
                         "within twice a correct engine's logit noise there: for a reduced precision the noise "
                         "model's envelope at that step (report.noise margin times it), else its precision's "
                         "logit_abs budget. Never the engine's own errors, which a bug inflates.",
        "convention": "a row that is real or over-budget against the golden, of an engine that, on that bundle, "
                      "matches a known convention's variant of the reference (the golden of the reference with "
                      "e.g. the latent norms' epsilon = rms_norm_eps, as vLLM computes it) with no failing row: "
                      "not a bug if intended; it fails the strict gate until the engine declares the convention "
                      "(engines.&lt;name&gt;.conventions), which judges it against the variant instead "
                      "(docs/report.md \"Conventions\").",
        "over-budget": "tokens equal (or a score run), but the logit or fingerprint errors, or the score run's "
                       "same-top-1 / KL, exceed the budget of the engine's declared precision, or the engine on "
                       "that bundle is over the noise model of its precision (docs/report.md \"Noise model\").",
        "real": "a divergence with nothing above to explain it, or any divergence of an engine whose errors are "
                "beyond its precision's budget or over the noise model (no tie credit then).",
        "failed": "the engine run failed (time limit, crash, invalid output); the reason is shown.",
        "changed": "not judged: the result, or the bundle or golden it used, changed after the run (its sha256 "
                   "no longer matches the one recorded when it was written); the reason names the file.",
    }
    defs_html = "".join(f"<dt>{badge(c)}</dt><dd>{d}</dd>" for c, d in defs.items())
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>k2vec divergence report</title>", f"<style>{CSS}</style></head><body><main>",
        "<h1>k2vec divergence report</h1>",
        f'<p class="sub">{plural(n_runs, "engine run")}, {plural(len(rows), "prompt row")}. '
        f'Thresholds: near_tie {th["near_tie"]:g}, '
        f'router_near_tie {th["router_near_tie"]:g}, fingerprint_rtol {th["fingerprint_rtol"]:g}. '
        f"k2vec {_e(__version__)}.</p>",
        f'<section id="verdict" class="card verdict {"ok" if ok else "fail"}">'
        f'<h2>{_e(verdict_line(m))}</h2>{_left_out_list(m)}'
        f'<pre id="summary-text">{_e(summary)}</pre></section>',
        '<section id="summary"><h2>Runs</h2><div class="card">', _summary_table(m), "</div></section>",
        '<section id="divergences"><h2>Divergent prompts</h2><div class="card">', _divergence_table(m),
        "</div></section>",
        '<section id="score"><h2>Score mode</h2><div class="card">', _score_table(m), "</div>",
        _figure("score_kl.png", pngs["score_kl.png"]), "</section>",
        '<section id="plots"><h2>Plots</h2>',
        *(_figure(name, pngs[name]) for name in ("match_grid.png", "logit_error.png", "first_bad_layer.png")),
        "</section>",
        '<section id="ddtree"><h2>DDTree</h2><div class="card">', _tree_table(m), "</div>",
        _figure("acceptance.png", pngs["acceptance.png"]), "</section>",
        '<section id="failures"><h2>Failed runs</h2><div class="card">', _failure_table(m), "</div></section>",
        _format_section(m), _figure("format_effect.png", pngs["format_effect.png"]), "</section>",
        _strength_section(m),
        _noise_section(m),
        '<section id="definitions"><h2>Definitions</h2><div class="card"><dl class="defs">', defs_html,
        "<dt>compared steps</dt><dd>steps 0..k for a prompt first diverging at step k (all steps if exact): "
        "up to k both sides fed the same tokens.</dd>"
        "<dt>logit error</dt><dd>on the ids in both top-k lists, compared by id: abs and rel error (max, mean, "
        "p99), NMSE = &Sigma;(e&minus;g)&sup2;/&Sigma;g&sup2;.</dd>"
        "<dt>KL</dt><dd>KL(golden || engine) per position on the top-m of each side (m = the smaller k), over the "
        "union of the two id sets: an id one side did not list gets that side's lowest listed logit, then both "
        "are softmax-normalised over the union.</dd>"
        "<dt>ranks</dt><dd>1 = top: the golden token's rank in the engine's top-k, the engine token's rank in "
        "the golden top-k; &ndash; when absent. (The CSV columns <code>*_rank_in_*</code> hold 0-based offsets: "
        "0 = top.)</dd>"
        "<dt>first bad fingerprint</dt><dd>first (step, layer) whose relative L2 error "
        "||e&minus;g||/||g|| exceeds fingerprint_rtol.</dd>"
        "<dt>trees</dt><dd>a DDTree round differs at the first node whose token, parent or depth differs (or "
        "where one tree ends); &tau; = tokens committed per round, root included.</dd>"
        "</dl></div></section>",
        "</main></body></html>",
    ]
    return "\n".join(parts)
