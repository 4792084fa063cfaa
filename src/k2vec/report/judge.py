"""One engine result judged as the report would judge it, without Snakemake, plots or HTML (issue 24).

    k2vec judge --bundle results/bundles/tiny-fp32.kdtr --result out/tiny-fp32-greedy.json

prints, per prompt, the class the report gives it, where it diverges and how far its logits and hidden
states stray, the score statistics of a score run, then PASSED or FAILED by the strict verdict
(report/gate.py): exit 0, 1, or 2 when an input cannot be read. From Python: `judge(bundle, result)`.

The classes are the report's own: the run goes through compute_metrics and classify with what the report
would give it. A class can depend on more than its own result: an engine's score run and its noise-model
verdict (every mode pooled) bear on its greedy and DDTree rows, so the engine's other results on the
bundle, named `{model}-{precision}-{mode}.json` beside it as the runner names them, are judged with it
(`--alone`: not). Defaults, so that the common call is short:

- model and precision: the bundle's metadata; the mode: the result's (the runner records it), else its
  file name, else --mode;
- the golden: the bundle's own copy (stages/bundle.py copies the golden verbatim and records its sha256);
- the noise model of a reduced precision: results/noise/{model}/{precision}-{class}.kdtr of the results
  tree the bundle sits in, when it exists; judging without one is said plainly;
- a result without the runner's sha256 record (straight from the engine) is checked against the contract
  as the runner checks one (docs/engine-contract.md), and a violation is a failed run;
- conventions (k2vec.model.conventions): `--convention NAME` says the engine follows one, and it is judged
  against that variant of the reference, results/conventions/{model}/{precision}-{variant}.kdtr of the
  results tree (or --variant); declaring none, it is judged against the golden, and where it fails there,
  against each known convention's variant found in that tree, as the report does (class `convention`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from k2vec.digests import record_path
from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.expectations import Expectations, expectations_from_bundle
from k2vec.engines.contract.modes import parse_mode
from k2vec.kdtr import KdtrError, open_bundle
from k2vec.model.conventions import CONVENTIONS, variant_key
from k2vec.report import gate
from k2vec.report.classify import PRECISION_CLASSES
from k2vec.report.html import divergence_line, fmt, noise_lines, score_line, why_line
from k2vec.report.classes import CLASSES
from k2vec.report.metrics import Metrics, ReportError, compute_metrics, read_budgets
from k2vec.report.words import plural

__all__ = ["Judgement", "judge", "main"]

MODE_IN_NAME = r"(greedy|score|ddtree-b\d+)"
# the classes whose rows get the report's line saying where and why (html.summary_text lists the same)
EXPLAINED = ("real", "over-budget", "router-near-tie", "precision-tie", "near-tie")


@dataclass
class Judgement:
    run: dict[str, Any]           # the run entry judged (compute_metrics' format)
    rows: pd.DataFrame            # its rows, as divergence.csv has them: accuracy x prompt
    metrics: Metrics              # everything computed, the pooled results' rows included
    golden: Path                  # where the golden data came from (the bundle, or --golden)
    noise: Path | None            # the noise model judged with, if any
    noise_looked_for: Path | None  # where the default noise model was looked for, if not found
    variants: dict[str, Path] = field(default_factory=dict)   # convention variant -> path, judged with
    pooled: list[dict[str, Any]] = field(default_factory=list)   # the engine's other results judged with it

    @property
    def problem(self) -> str | None:
        """Why the result fails the strict verdict (report/gate.py), or None."""
        return gate.strict_problem(self.rows)

    @property
    def passed(self) -> bool:
        return self.problem is None

    def text(self) -> str:
        return "\n".join(_lines(self)) + "\n"


def _bundle_case(bundle: Path) -> tuple[str, str]:
    """(model, precision) from the bundle's metadata."""
    if not bundle.is_file():
        raise ReportError(f"bundle not found: {bundle}")
    try:
        with open_bundle(bundle) as b:
            md = b.metadata
    except (KdtrError, OSError) as err:
        raise ReportError(f"bundle {bundle} is not readable: {err}") from None
    model = md.get("model")
    if md.get("kind") != "k2vec-bundle" or not isinstance(model, Mapping) or "name" not in model:
        raise ReportError(f"{bundle} is not a k2vec bundle (metadata kind {md.get('kind')!r}); "
                          f"give one of results/bundles/")
    return str(model["name"]), str(md.get("precision"))


def _peek(path: Path) -> dict[str, Any]:
    """The result's JSON where it is readable; {} otherwise (compute_metrics then says why it is not)."""
    try:
        with open(path) as fh:
            res = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return res if isinstance(res, dict) else {}


def _mode(result: Path, recorded: Any, given: str | None, case: str) -> str:
    mode = given or (recorded if isinstance(recorded, str) else None)
    if mode is None:
        m = re.fullmatch(re.escape(case) + "-" + MODE_IN_NAME + r"\.json", result.name)
        if m is None:
            raise ReportError(f"{result}: the result records no mode and its name is not {case}-MODE.json; "
                              f"give --mode (greedy, score or ddtree-b<budget>)")
        mode = m.group(1)
    try:
        parse_mode(mode)
    except ValueError as err:
        raise ReportError(f"{result}: {err}") from None
    return mode


def _contract(result: Path, bundle: Path, expect: list[Expectations]) -> Expectations | None:
    """The bundle's expectations for a result without the runner's sha256 record, else None."""
    if record_path(result).exists():
        return None
    if not expect:
        try:
            expect.append(expectations_from_bundle(bundle))
        except InvalidResult as err:
            raise ReportError(str(err)) from None
    return expect[0]


def _siblings(result: Path, case: str) -> list[tuple[Path, str]]:
    """The engine's other results on the same bundle: (path, mode) of each `{case}-{mode}.json` beside it."""
    out = []
    for p in sorted(result.parent.glob(f"{case}-*.json")):
        m = re.fullmatch(re.escape(case) + "-" + MODE_IN_NAME + r"\.json", p.name)
        if m and p.resolve() != result.resolve():
            out.append((p, m.group(1)))
    return out


def _variants(bundle: Path, model: str, precision: str, declared: Sequence[str],
              variant: str | Path | None) -> dict[str, Path]:
    """{variant key: path} to judge with: the declared conventions' variant (--variant, else the results tree's,
    which must exist), or, declaring none, every known convention's variant the results tree holds."""
    unknown = sorted(set(declared) - set(CONVENTIONS))
    if unknown:
        raise ReportError(f"unknown convention {unknown[0]!r}; known: {', '.join(CONVENTIONS)}")
    key = variant_key(declared)
    tree = bundle.parent.parent / "conventions" / model if bundle.parent.name == "bundles" else None
    if key:
        path = Path(variant) if variant is not None else None if tree is None else tree / f"{precision}-{key}.kdtr"
        if path is None or not path.is_file():
            where = path or "no results tree beside the bundle"
            raise ReportError(f"convention variant {key!r} of {model}/{precision} not found ({where}); run Snakemake "
                              f"with an engine declaring it, or give --variant")
        return {key: path}
    if variant is not None:
        raise ReportError("--variant needs --convention: the conventions the variant follows")
    if tree is None:
        return {}
    return {name: tree / f"{precision}-{name}.kdtr" for name in CONVENTIONS
            if (tree / f"{precision}-{name}.kdtr").is_file()}


def judge(bundle: str | Path, result: str | Path, *, mode: str | None = None, precision_class: str = "float32",
          noise: str | Path | None = None, golden: str | Path | None = None, alone: bool = False,
          conventions: Sequence[str] = (), variant: str | Path | None = None,
          near_tie: float = 1e-3, router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
          budgets: Mapping[str, Mapping[str, Any]] | None = None,
          noise_rule: Mapping[str, Any] | None = None) -> Judgement:
    """Judge `result` (an engine's JSON) on `bundle` as the report does; ReportError naming the file when an
    input cannot be read. The thresholds, budgets and noise_rule are the report's (config.yaml `report`).
    `conventions`: those the engine follows (judged against their variant: `variant`, else the results tree's)."""
    bundle, result = Path(bundle), Path(result)
    model, precision = _bundle_case(bundle)
    case = f"{model}-{precision}"
    if not result.is_file():
        raise ReportError(f"result not found: {result}")
    if precision_class not in PRECISION_CLASSES:
        raise ReportError(f"precision class {precision_class!r} is not one of {', '.join(PRECISION_CLASSES)}")
    for what, path in (("golden", golden), ("noise model", noise)):
        if path is not None and not Path(path).is_file():
            raise ReportError(f"{what} not found: {path}")
    golden_path = Path(golden) if golden is not None else bundle
    looked_for = None
    if noise is None and precision_class != "float32" and bundle.parent.name == "bundles":
        looked_for = bundle.parent.parent / "noise" / model / f"{precision}-{precision_class}.kdtr"
        if looked_for.is_file():
            noise, looked_for = looked_for, None
    variants = _variants(bundle, model, precision, conventions, variant)
    peeked = _peek(result)
    engine = str(peeked.get("engine") or result.parent.name)
    expect: list[Expectations] = []

    def entry(path: Path, mode: str) -> dict[str, Any]:
        return {"engine": engine, "model": model, "precision": precision, "mode": mode, "result": str(path),
                "precision_class": precision_class, "bundle": str(bundle), "conventions": list(conventions),
                "contract": _contract(path, bundle, expect)}

    run = entry(result, _mode(result, peeked.get("mode"), mode, case))
    pooled = [] if alone else [entry(p, m) for p, m in _siblings(result, case)]
    m = compute_metrics([run] + pooled, {(model, precision): golden_path}, near_tie=near_tie,
                        router_near_tie=router_near_tie, fingerprint_rtol=fingerprint_rtol, budgets=budgets,
                        noise=None if noise is None else {(model, precision, precision_class): noise},
                        conventions={(model, precision, v): p for v, p in variants.items()}, noise_rule=noise_rule)
    rows = m.rows[m.rows["run"] == 0].reset_index(drop=True)
    return Judgement(run, rows, m, golden_path, None if noise is None else Path(noise), looked_for, variants, pooled)


# ------------------------------------------------------------------------------------------------ text


def _label(r: pd.Series) -> str:
    return f"{int(r['prompt'])}" + ("" if pd.isna(r["accuracy"]) else f" p={r['accuracy']:g}")


def _lines(j: Judgement) -> list[str]:
    run, rows = j.run, j.rows
    out = [f"judge: {run['engine']} {run['model']}/{run['precision']} {run['mode']} ({run['precision_class']}): "
           f"{run['result']}"]
    out.append(f"  golden: {'the copy in the bundle ' if j.golden == Path(run['bundle']) else ''}{j.golden}")
    if j.noise is not None:
        out.append(f"  noise model: {j.noise}")
    elif run["precision_class"] != "float32":
        where = f" ({j.noise_looked_for} does not exist)" if j.noise_looked_for else ""
        out.append(f"  noise model: none{where}; judged by the fixed {run['precision_class']} budgets only, "
                   f"tie credit the logit_abs budget (--noise)")
    if run["conventions"]:
        (path,) = j.variants.values()
        labels = "; ".join(CONVENTIONS[c].label for c in sorted(run["conventions"]))
        out.append(f"  judged against the variant of the reference that follows {labels}: {path}")
    if run["contract"] is not None:
        out.append("  no sha256 record beside the result: not written by the engine runner, so checked against "
                   "the contract here (docs/engine-contract.md)")
    if j.pooled:
        out.append("  judged with the engine's other results on this bundle, as the report pools them (score "
                   "statistics, noise-model verdict): " + ", ".join(p["mode"] for p in j.pooled) + " (--alone: not)")
    if (rows["status"] != "ok").all():
        out.append(f"  {rows['class'].iloc[0].upper()} run: {rows['reason'].iloc[0]}")
    else:
        head = ("prompt", "class", "first step", "golden/engine", "first bad", "logit err", "KL max", "tree")
        table = [head] + [(
            _label(r), r["class"], fmt(r["first_step"], "id"),
            "\u2013" if pd.isna(r["first_step"]) else f"{fmt(r['golden_token'], 'id')}/{fmt(r['engine_token'], 'id')}",
            "\u2013" if pd.isna(r["first_bad_step"]) else
            f"step {int(r['first_bad_step'])} L{int(r['first_bad_layer'])}",
            fmt(r["logit_abs_max"], "e"), fmt(r["kl_max"], "e"),
            "\u2013" if pd.isna(r["tree_match"]) else ("same" if r["tree_match"] else
                                                       f"differs, round {int(r['first_tree_diff_round'])}"))
            for _, r in rows.iterrows()]
        widths = [max(len(str(t[c])) for t in table) for c in range(len(head))]
        out += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    for name, grp in rows[rows["class"] == "convention"].groupby("convention"):
        out.append(f"  CONVENTION: {plural(len(grp), 'row')} match the golden under {CONVENTIONS[name].label} "
                   f"and fail it without: give --convention {name} if the engine follows it on purpose")
    for cls in EXPLAINED:
        for _, r in rows[rows["class"] == cls].iterrows():
            if pd.isna(r["first_step"]):
                out.append(f"  {cls.upper()}: prompt {_label(r)}: {why_line(r)}")
            else:
                out.append(f"  {cls.upper()}: {divergence_line(r)}")
    if (rows["status"] != "ok").any() and (rows["status"] == "ok").any():   # some drafter runs only
        for (cls, reason), grp in rows[rows["status"] != "ok"].groupby(["class", "reason"], sort=False):
            out.append(f"  {cls.upper()}: {plural(len(grp), 'row')}: {reason}")
    for _, r in rows[(rows["tree_match"] == False) & (rows["class"] == "exact")].iterrows():  # noqa: E712
        out.append(f"  TREE DIFFERS: prompt {_label(r)} round {int(r['first_tree_diff_round'])}: {r['tree_diff_what']}")
    mine = j.metrics.score_runs[j.metrics.score_runs["engine"] == run["engine"]]
    out += ["  " + score_line(r) for _, r in mine.iterrows()]
    out += ["  " + line for line in noise_lines(j.metrics.noise_table, j.metrics.rows)]
    counts = rows["class"].value_counts()
    tally = ", ".join(f"{c} {int(counts[c])}" for c in CLASSES if c in counts)
    if j.passed:
        out.append(f"PASSED: {plural(len(rows), 'prompt row')}: {tally}")
    else:
        bad = gate.failing(rows)["verdict"].value_counts()
        out.append(f"FAILED: {', '.join(f'{v} {int(n)}' for v, n in bad.items())} of "
                   f"{plural(len(rows), 'prompt row')} (strict verdict, report/gate.py); {tally}")
    return out


# ------------------------------------------------------------------------------------------ entry point


def main(argv: Sequence[str] | None = None, prog: str = "python -m k2vec.report.judge") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Judge one engine result as the divergence report would: "
                                 "per prompt its class and where it diverges, then PASSED or FAILED by the strict "
                                 "verdict. Exit 0: passed, 1: failed, 2: an input cannot be read.")
    ap.add_argument("--bundle", required=True,
                    help="the bundle the engine ran on (results/bundles/MODEL-PRECISION.kdtr)")
    ap.add_argument("--result", required=True, help="the engine's result JSON")
    ap.add_argument("--mode", help="greedy, score or ddtree-b<budget> (default: recorded in the result, else its "
                    "file name MODEL-PRECISION-MODE.json)")
    ap.add_argument("--precision-class", default="float32", choices=PRECISION_CLASSES,
                    help="the precision the engine computes in, which picks its budgets (default float32)")
    ap.add_argument("--noise", help="noise model (default for a reduced precision: "
                    "results/noise/MODEL/PRECISION-CLASS.kdtr beside the bundle's results/bundles/)")
    ap.add_argument("--golden", help="golden file (default: the golden data the bundle carries)")
    ap.add_argument("--convention", action="append", default=[], choices=sorted(CONVENTIONS), metavar="NAME",
                    help="a convention the engine follows (k2vec.model.conventions: "
                    + ", ".join(sorted(CONVENTIONS)) + "); judged against that variant of the reference")
    ap.add_argument("--variant", help="the variant golden of the --convention(s) (default: "
                    "results/conventions/MODEL/PRECISION-VARIANT.kdtr beside the bundle's results/bundles/)")
    ap.add_argument("--alone", action="store_true", help="judge this result only, not with the engine's other "
                    "results on the bundle (MODEL-PRECISION-*.json beside it)")
    ap.add_argument("--near-tie", type=float, default=1e-3)
    ap.add_argument("--router-near-tie", type=float, default=1e-3)
    ap.add_argument("--fingerprint-rtol", type=float, default=1e-3)
    ap.add_argument("--budgets", help="JSON file: per precision, budgets laid over the defaults (report.budgets)")
    a = ap.parse_args(argv)
    try:
        budgets = read_budgets(a.budgets)
        j = judge(a.bundle, a.result, mode=a.mode, precision_class=a.precision_class, noise=a.noise,
                  golden=a.golden, alone=a.alone, conventions=a.convention, variant=a.variant, near_tie=a.near_tie,
                  router_near_tie=a.router_near_tie, fingerprint_rtol=a.fingerprint_rtol, budgets=budgets)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(j.text())
    return 0 if j.passed else 1


if __name__ == "__main__":
    sys.exit(main())
