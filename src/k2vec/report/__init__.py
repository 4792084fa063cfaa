"""The divergence report: engine results judged against the golden data (issue 8).

    from k2vec.report import build_report
    res = build_report(
        [{"engine": "myengine", "model": "tiny", "precision": "int4", "mode": "ddtree-b16",
          "result": "results/engines/myengine/tiny-int4-ddtree-b16.json"}, ...],
        {("tiny", "fp32"): "results/golden/tiny/fp32.kdtr", ("tiny", "int4"): "results/golden/tiny/int4.kdtr"},
        "results/report")
    res.rows            # one row per run x accuracy x prompt (= divergence.csv)
    res.summary         # = summary.txt
    res.strict_problem  # why the strict verdict fails (report/gate.py), or None
    res.paths           # every file written

Outputs in out_dir: divergence.html (self-contained), divergence.csv, engines.csv (each configured engine: ran or
left out, and why), format_effect.csv, resolution.csv (per bundle judged at a reduced precision: the
smallest errors its verdict resolves, the catalogue mutants below them; report/resolution.py), summary.txt and
each plot as PNG (figures.PLOTS). From Snakemake: rule `report`'s script (`workflow/scripts/report.py`)
unpacks `snakemake` and calls `write_report`; from a shell: `python -m k2vec.report --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from k2vec.atomic import write_bytes_atomic, write_text_atomic
from k2vec.report import gate
from k2vec.report.gate import StrictFailure
from k2vec.report.metrics import ROW_COLUMNS, Metrics, ReportError, compute_metrics, read_budgets
from k2vec.report.resolution import resolution_csv

__all__ = ["build_report", "ReportResult", "ReportError", "compute_metrics", "main", "write_report", "OUTPUTS"]

# Fixed output names (relative to out_dir), so a Snakemake rule can declare them.
OUTPUTS = {
    "html": "divergence.html", "csv": "divergence.csv", "summary": "summary.txt", "engines_csv": "engines.csv",
    "format_csv": "format_effect.csv", "score_csv": "score.csv", "resolution_csv": "resolution.csv",
    "match_grid": "match_grid.png", "logit_error": "logit_error.png", "first_bad_layer": "first_bad_layer.png",
    "acceptance": "acceptance.png", "format_effect": "format_effect.png", "score_kl": "score_kl.png",
}


@dataclass
class ReportResult:
    rows: pd.DataFrame            # run x accuracy x prompt (divergence.csv)
    runs: pd.DataFrame            # run x accuracy summary
    steps: pd.DataFrame           # per row and compared step: logit error, KL
    acceptance: pd.DataFrame      # DDTree acceptance-length histogram data
    score_runs: pd.DataFrame      # one row per score run, the int4-format rows included (score.csv)
    format_effect: pd.DataFrame   # fp32 vs int4 golden per model x prompt
    format_steps: pd.DataFrame    # ... per step
    format_models: pd.DataFrame   # ... per model
    summary: str
    strict_problem: str | None    # report/gate.py: the one strict verdict
    paths: dict[str, Path] = field(default_factory=dict)


def build_report(runs: Sequence[Mapping[str, Any]], goldens: Mapping[tuple[str, str], str | Path],
                 out_dir: str | Path, *, near_tie: float = 1e-3, router_near_tie: float = 1e-3,
                 fingerprint_rtol: float = 1e-3, budgets: Mapping[str, Mapping[str, Any]] | None = None,
                 noise: Mapping[tuple[str, str, str], str | Path] | None = None,
                 conventions: Mapping[tuple[str, str, str], str | Path] | None = None,
                 noise_rule: Mapping[str, Any] | None = None, left_out: Mapping[str, str] | None = None,
                 fail_on_left_out: bool = False, integrity_key: str | Path | None = None,
                 cache: str | Path | None = None, mutation_resolution: str | Path | None = None,
                 float32_engines: Mapping[str, str] | None = None) -> ReportResult:
    """Compute every metric, render the plots and the HTML, and write all outputs into `out_dir`.
    cache: a directory where the report keeps what a later report reuses: its plots, by what they show and the code
    that draws them (report/plot_cache.py), so that a report whose plots did not change draws none, and the parses
    of the results it read, by their bytes (engines/contract/result_cache.py); None draws and parses everything.
    integrity_key: the results directory's integrity key file, with which results' keyed records are
    checked (report/integrity.py); None checks their sha256 records and flags no verdict tamper-proof.
    budgets: per declared precision (classify.DEFAULT_BUDGETS, report.budgets in config.yaml); noise:
    {(model, precision, precision class): noise-model path}; conventions: {(model, precision, variant):
    convention-variant path} (report/metrics.py compute_metrics); noise_rule: report.noise (report/noise.py);
    left_out: {engine: why} for each configured engine that got no run; fail_on_left_out: those fail the
    strict verdict (report.fail_on_left_out). mutation_resolution: the mutation run's per-bundle resolvability
    (report/resolution.py), read where it exists; float32_engines: {reduced-precision engine: the float32
    engine of its command family} (k2vec.config.engines.float32_counterparts), named in its clean lines."""
    from k2vec.report.html import render_html, summary_text
    from k2vec.report.plot_cache import PlotCache
    from k2vec.engines.contract.result_cache import ResultCache

    results = ResultCache(cache)
    m: Metrics = compute_metrics(runs, goldens, near_tie=near_tie, router_near_tie=router_near_tie,
                                 fingerprint_rtol=fingerprint_rtol, budgets=budgets, noise=noise,
                                 conventions=conventions, noise_rule=noise_rule, integrity_key=integrity_key,
                                 mutation_resolution=mutation_resolution, result_cache=results)
    m = dataclasses.replace(m, left_out=dict(left_out or {}), fail_on_left_out=fail_on_left_out,
                            float32_engines=dict(float32_engines or {}))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_steps = dict(zip(m.format_models.get("model", []), m.format_models.get("max_new_tokens", [])))
    plot_cache = PlotCache(cache)
    pngs = {
        "match_grid.png": plot_cache.draw("match_grid", m.rows),
        "logit_error.png": plot_cache.draw("logit_error", m.rows, m.steps),
        "first_bad_layer.png": plot_cache.draw("first_bad_layer", m.rows),
        "acceptance.png": plot_cache.draw("acceptance", m.acceptance),
        "format_effect.png": plot_cache.draw("format_effect", m.format_effect, m.format_steps, n_steps),
        "score_kl.png": plot_cache.draw("score_kl", m.score_runs, m.rows, m.steps, m.score_reference_steps),
    }
    plot_cache.prune()
    results.prune()
    summary = summary_text(m)
    paths = {key: out / name for key, name in OUTPUTS.items()}
    for name, png in pngs.items():
        write_bytes_atomic(out / name, png)
    write_text_atomic(paths["csv"], m.rows[ROW_COLUMNS].to_csv(index=False))
    write_text_atomic(paths["format_csv"], m.format_effect.to_csv(index=False))
    write_text_atomic(paths["score_csv"], m.score_runs.to_csv(index=False))
    write_text_atomic(paths["resolution_csv"], resolution_csv(m.resolution).to_csv(index=False))
    write_text_atomic(paths["engines_csv"], engine_table(runs, m.left_out).to_csv(index=False))
    write_text_atomic(paths["summary"], summary)
    write_text_atomic(paths["html"], render_html(m, pngs, summary))
    return ReportResult(m.rows, m.runs, m.steps, m.acceptance, m.score_runs, m.format_effect, m.format_steps,
                        m.format_models, summary, m.strict_problem, paths)


def engine_table(runs: Sequence[Mapping[str, Any]], left_out: Mapping[str, str]) -> pd.DataFrame:
    """engines.csv: each configured engine, whether it ran (and how many runs) or was left out, and why."""
    counts = pd.Series([r["engine"] for r in runs if not r.get("reference")], dtype=object).value_counts()
    table = [{"engine": e, "status": "ran", "runs": int(n), "reason": ""} for e, n in counts.items()]
    table += [{"engine": e, "status": gate.LEFT_OUT, "runs": 0, "reason": why} for e, why in left_out.items()]
    return pd.DataFrame(table, columns=["engine", "status", "runs", "reason"]).sort_values("engine")


# ------------------------------------------------------------------------------------ entry points


def _goldens_from(value: Any) -> dict[tuple[str, str], str]:
    """{(model, precision): path}, or [{"model","precision","path"}], or {"model/precision": path}."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if isinstance(k, str):
                if "/" not in k:
                    raise ReportError(f"golden key {k!r}: expected 'model/precision' or a (model, precision) tuple")
                k = tuple(k.split("/", 1))
            out[(str(k[0]), str(k[1]))] = str(v)
        return out
    return {(str(g["model"]), str(g["precision"])): str(g["path"]) for g in value}


def _keyed_by_three(value: Mapping[str, Any] | None, what: str, third: str) -> dict[tuple[str, str, str], str]:
    """{(model, precision, third): path} from a rule's {"model/precision/third": path}."""
    out = {}
    for k, v in (value or {}).items():
        parts = tuple(k.split("/")) if isinstance(k, str) else tuple(k)
        if len(parts) != 3:
            raise ReportError(f"{what} key {k!r}: expected 'model/precision/{third}'")
        out[tuple(str(x) for x in parts)] = str(v)
    return out


def write_report(runs: Sequence[Mapping[str, Any]], goldens: Any, out_dir: str | Path, *, near_tie: float = 1e-3,
                 router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                 budgets: Mapping[str, Mapping[str, Any]] | None = None, strict: bool = False,
                 noise: Mapping[str, Any] | None = None, conventions: Mapping[str, Any] | None = None,
                 noise_rule: Mapping[str, Any] | None = None, left_out: Mapping[str, str] | None = None,
                 fail_on_left_out: bool = False, integrity_key: str | Path | None = None,
                 cache: str | Path | None = None, mutation_resolution: str | Path | None = None,
                 float32_engines: Mapping[str, str] | None = None) -> ReportResult:
    """Rule `report`: build_report, with its summary logged (run it inside the stage's stage_logging).

    runs: {"engine","model","precision","mode","result"} dicts (result = the JSON path); goldens:
    {(model, precision): path}, [{"model","precision","path"}] or {"model/precision": path} (the rule's
    params.goldens); budgets: report.budgets; noise: {"model/precision/class": noise-model path} (params.noise);
    conventions: {"model/precision/variant": convention-variant path} (params.conventions);
    noise_rule: report.noise; left_out, fail_on_left_out, integrity_key, cache, mutation_resolution,
    float32_engines: as build_report. strict: raise StrictFailure (report/gate.py) on a real
    divergence, an over-budget row or a failed run, after writing the outputs.
    """
    res = build_report(list(runs), _goldens_from(goldens), out_dir, near_tie=float(near_tie),
                       router_near_tie=float(router_near_tie), fingerprint_rtol=float(fingerprint_rtol),
                       budgets=budgets, noise=_keyed_by_three(noise, "noise-model", "precision_class"),
                       conventions=_keyed_by_three(conventions, "convention-variant", "variant"),
                       noise_rule=noise_rule, left_out=left_out,
                       fail_on_left_out=fail_on_left_out, integrity_key=integrity_key, cache=cache,
                       mutation_resolution=mutation_resolution, float32_engines=float32_engines)
    logging.getLogger("k2vec.report").info("%s", res.summary)
    if strict and res.strict_problem:
        raise StrictFailure(res.strict_problem)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k2vec.report", description="Build the divergence report.")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--golden", nargs=3, action="append", default=[], metavar=("MODEL", "PRECISION", "PATH"))
    ap.add_argument("--run", nargs=5, action="append", default=[],
                    metavar=("ENGINE", "MODEL", "PRECISION", "MODE", "RESULT"))
    ap.add_argument("--near-tie", type=float, default=1e-3)
    ap.add_argument("--router-near-tie", type=float, default=1e-3)
    ap.add_argument("--fingerprint-rtol", type=float, default=1e-3)
    ap.add_argument("--precision-class", nargs=2, action="append", default=[], metavar=("ENGINE", "PRECISION"),
                    help="an engine's declared compute precision (float32, bfloat16, float16, fp8; default float32)")
    ap.add_argument("--noise", nargs=4, action="append", default=[], metavar=("MODEL", "PRECISION", "CLASS", "PATH"),
                    help="a noise model (results/noise/MODEL/PRECISION-CLASS.kdtr) for the engines of that class")
    ap.add_argument("--convention", nargs=4, action="append", default=[],
                    metavar=("MODEL", "PRECISION", "VARIANT", "PATH"),
                    help="a convention variant's golden (results/conventions/MODEL/PRECISION-VARIANT.kdtr): "
                         "failing engines are checked against it")
    ap.add_argument("--declare", nargs=2, action="append", default=[], metavar=("ENGINE", "CONVENTION"),
                    help="a convention an engine follows (engines.<name>.conventions): judged against that variant")
    ap.add_argument("--budgets", help="JSON file: per precision, budgets laid over the defaults (report.budgets)")
    ap.add_argument("--left-out", nargs=2, action="append", default=[], metavar=("ENGINE", "REASON"),
                    help="a configured engine that got no run, named with its reason in the report")
    ap.add_argument("--fail-on-left-out", action="store_true",
                    help="with --strict, a left-out engine fails the verdict (report.fail_on_left_out)")
    ap.add_argument("--integrity-key", metavar="PATH",
                    help="the results directory's integrity key (results/.integrity.key): check each result's keyed "
                         "record; without it, sha256 records only and no verdict is tamper-proof")
    ap.add_argument("--mutation-resolution", metavar="PATH",
                    help="the mutation run's results/mutation/mutation_resolution.csv: name the catalogue's bugs below "
                         "each reduced-precision verdict's resolution")
    ap.add_argument("--float32-engine", nargs=2, action="append", default=[], metavar=("ENGINE", "FLOAT32_ENGINE"),
                    help="the float32 engine of a reduced-precision engine's command family, named where it "
                         "passes clean")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when the strict verdict fails (report/gate.py): a real divergence, an over-budget "
                         "row, a failed run or a DDTree tree that differs")
    a = ap.parse_args(argv)
    declared = dict(a.precision_class)
    follows: dict[str, list[str]] = {}
    for engine, name in a.declare:
        follows.setdefault(engine, []).append(name)
    runs = [{**dict(zip(("engine", "model", "precision", "mode", "result"), r)),
             "precision_class": declared.get(r[0], "float32"), "conventions": follows.get(r[0], [])} for r in a.run]
    goldens = {(m, p): path for m, p, path in a.golden}
    try:
        res = build_report(runs, goldens, a.out, near_tie=a.near_tie, router_near_tie=a.router_near_tie,
                           fingerprint_rtol=a.fingerprint_rtol, budgets=read_budgets(a.budgets),
                           noise={(m, p, c): path for m, p, c, path in a.noise},
                           conventions={(m, p, v): path for m, p, v, path in a.convention}, left_out=dict(a.left_out),
                           fail_on_left_out=a.fail_on_left_out, integrity_key=a.integrity_key,
                           mutation_resolution=a.mutation_resolution, float32_engines=dict(a.float32_engine))
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(res.summary)
    print(f"report: {res.paths['html']}")
    if a.strict and res.strict_problem:
        print(res.strict_problem, file=sys.stderr)
        return 1
    return 0
