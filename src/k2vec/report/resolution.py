"""What a reduced-precision verdict cannot see: each bundle's resolution at each precision judged by a noise
model, the catalogue mutants below it, and the float32 run that would see them (docs/report.md "Resolution").

The resolution of a bundle at a precision is the smallest error of each kind that the noise rule calls over
the noise model, were an engine off by that much at every cell (NoiseModel.resolution): `margin` times the
envelope at its `fraction` quantile of cells. An engine of that precision that passes clean is clean down to
it, no further: a bug whose effect stays below it is rounding to the verdict. Which bugs those are is what the
mutation run measures (k2vec.mutation.score): each mutant's float32 runs judged by the same noise model,
per bundle, in MUTATION_RESOLUTION_FILE beside mutation.csv; the report reads it where it exists and was made
from the same golden.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from k2vec.report.gate import failing
from k2vec.report.golden_data import Golden, ReportError
from k2vec.report.noise import NoiseModel, Rule

# Written by the mutation report (k2vec.mutation.score), read here: one row per mutant, compute precision and
# bundle its float32 runs were judged on. The fractions are of each kind's cells beyond the noise model;
# tree_ahead (DDTree mutants, whose effect is on tokens, not cells): the fraction of its float32 DDTree rows that,
# judged at that precision, are caught and leave the golden before the unmutated engine of that precision does
# (the recorded drafts follow the golden's tokens: past an engine's own departure its tree is barely exercised);
# resolvable: the rule's verdict on the
# cells, for a DDTree mutant tree_ahead >= REQUIRED_CATCH_RATE; catch_rate: of the mutant's own runs at that
# precision there; below: neither resolvable nor caught there (in REQUIRED_CATCH_RATE of its rows), the
# mutants the report names.
MUTATION_RESOLUTION_FILE = "mutation_resolution.csv"
MUTATION_RESOLUTION_COLUMNS = ["mutant", "compute", "model", "precision", "golden_sha256", "hidden_beyond",
                               "logit_beyond", "kl_beyond", "router_beyond", "tree_ahead", "resolvable", "catch_rate",
                               "below"]
RESOLUTION_COLUMNS = ["model", "precision", "precision_class", "golden_sha256", "hidden_rel", "hidden_rel_layers",
                      "logit_abs", "kl", "hidden_cells", "step_cells", "below", "below_ddtree", "mixing_scale",
                      "mutation_note"]
EXAMPLES = 4   # mutants named in a summary line ("e.g. ...")
# The mixing-weight ladder: catalogue mutants (k2vec.mutation.catalogue) that put the routed experts' mixing weights
# off by growing amounts (at K2's routed_scaling_factor 2.827). The smallest step a bundle's verdict sees at a
# precision is its resolution in those terms (_mixing_scale).
MIXING_LADDER = (("router_scaling_truncated", "1%"), ("router_scaling_5pct_low", "5%"),
                 ("router_scaling_10pct_low", "10%"), ("router_scaling_v3_value", "12%"),
                 ("router_scaling_missing", "65%"))


def resolution_table(models: Mapping[tuple[str, str, str], NoiseModel], goldens: Mapping[tuple[str, str], Golden],
                     rule: Rule, mutation: str | Path | None = None) -> pd.DataFrame:
    """One row per noise model (bundle x precision): its resolution (NoiseModel.resolution); below: the
    catalogue mutants whose float32 effect is below it on that bundle, from the mutation run's `mutation`
    file (MUTATION_RESOLUTION_FILE) where it exists, else None and mutation_note says why."""
    measured = read_mutation_resolution(mutation)
    out = []
    for (m, p, c), nm in sorted(models.items()):
        below, note = _below(measured, m, p, c, goldens[(m, p)].sha256)
        out.append({"model": m, "precision": p, "precision_class": c, "golden_sha256": goldens[(m, p)].sha256,
                    **nm.resolution(rule), "below": below, "below_ddtree": _tree_mutants(measured, below),
                    "mixing_scale": _mixing_scale(measured, m, p, c) if below is not None else None,
                    "mutation_note": note})
    return pd.DataFrame(out, columns=RESOLUTION_COLUMNS)


def read_mutation_resolution(path: str | Path | None) -> pd.DataFrame | None:
    """The mutation run's per-bundle resolvability, or None where it has not run (no file)."""
    if path is None or not Path(path).exists():
        return None
    try:
        t = pd.read_csv(path)
    except (OSError, ValueError) as err:
        raise ReportError(f"{path}: unreadable: {err}; rerun `snakemake mutation_report`") from None
    missing = [c for c in MUTATION_RESOLUTION_COLUMNS if c not in t]
    if missing:
        raise ReportError(f"{path}: not the mutation run's resolution table (no column {missing[0]}); rerun "
                          f"`snakemake mutation_report`")
    return t


def _below(measured: pd.DataFrame | None, model: str, precision: str, precision_class: str, golden_sha256: str
           ) -> tuple[list[str] | None, str | None]:
    if measured is None:
        return None, "no mutation run: `snakemake mutation_report` names the catalogue's bugs below it"
    t = measured[(measured["model"] == model) & (measured["precision"] == precision)
                 & (measured["compute"] == precision_class)]
    if not len(t):
        return None, f"the mutation run did not judge {model}/{precision} at {precision_class}"
    if not (t["golden_sha256"] == golden_sha256).all():
        return None, "the mutation run's results are of another golden: rerun `snakemake mutation_report`"
    return sorted(t.loc[t["below"].astype(bool), "mutant"]), None


def _tree_mutants(measured: pd.DataFrame | None, names: list[str] | None) -> list[str] | None:
    """The DDTree mutants among `names` (those measured by tree_ahead): a verdict without DDTree runs does not
    miss them."""
    if measured is None or names is None:
        return None
    tree = set(measured.loc[measured["tree_ahead"].notna(), "mutant"])
    return [n for n in names if n in tree]


def _mixing_scale(measured: pd.DataFrame, model: str, precision: str, precision_class: str) -> str | None:
    """The smallest step of the mixing-weight ladder (catalogue.MIXING_LADDER) not below the bundle's resolution,
    and the largest below it: 'routed mixing weights off by 5% or more (1% is below it)'; None where the
    mutation run judged no step of it there."""
    t = measured[(measured["model"] == model) & (measured["precision"] == precision)
                 & (measured["compute"] == precision_class)].set_index("mutant")["below"].astype(bool)
    steps = [(name, label, bool(t[name])) for name, label in MIXING_LADDER if name in t.index]
    if not steps:
        return None
    seen = [label for _, label, below in steps if not below]
    hidden = [label for _, label, below in steps if below]
    if not seen:
        return f"routed mixing weights off by up to {hidden[-1]} are all below it"
    return f"routed mixing weights off by {seen[0]} or more" + (f" ({hidden[-1]} is below it)" if hidden else "")


def float32_advice(engine: str, float32_engines: Mapping[str, str], left_out: Mapping[str, str]) -> str:
    """Which run shows what a reduced-precision engine's verdict cannot: its float32 counterpart (the same
    command family, k2vec.config.engines.float32_counterparts) where one is configured."""
    other = float32_engines.get(engine)
    if other is None:
        return (f"the float32 run of this engine (none is configured: add one, engines.<name> with {engine}'s "
                f"command at float32 and precision: float32)")
    return f"the float32 run of this engine: {other}" + (" (left out of this run)" if other in left_out else "")


def resolution_words(r: Mapping) -> str:
    """'hidden-state rel. error 2.1e-02 (by layer 1.0e-02, 3.4e-02), logit error 1.5e-01, KL 3.2e-04'."""
    def e(v) -> str:
        return "\u2013" if v is None or not np.isfinite(v) else f"{v:.2e}"
    layers = ", ".join(e(v) for v in r["hidden_rel_layers"])
    return (f"hidden-state rel. error {e(r['hidden_rel'])} (by layer {layers}), logit error {e(r['logit_abs'])}, "
            f"KL {e(r['kl'])}")


def clean_engines(rows: pd.DataFrame, noise_table: pd.DataFrame) -> pd.DataFrame:
    """The reduced-precision engines and bundles that pass clean: within their noise model, no row that fails
    the strict verdict (report/gate.py). Columns engine, model, precision, precision_class."""
    cols = ["engine", "model", "precision", "precision_class"]
    if noise_table.empty:
        return pd.DataFrame(columns=cols)
    within = noise_table[noise_table["verdict"] == "within"][cols]
    bad = failing(rows)[["engine", "model", "precision"]].drop_duplicates()
    merged = within.merge(bad, how="left", on=["engine", "model", "precision"], indicator=True)
    return merged[merged["_merge"] == "left_only"][cols].reset_index(drop=True)


def resolution_lines(resolution: pd.DataFrame, rows: pd.DataFrame, noise_table: pd.DataFrame,
                     float32_engines: Mapping[str, str], left_out: Mapping[str, str]) -> list[str]:
    """Per clean engine and bundle: clean down to the resolution, the mutants below it, its float32 run; per
    bundle with no clean engine: its resolution and the mutants below it."""
    if resolution.empty:
        return []
    clean = clean_engines(rows, noise_table)
    lines = []
    def below_words(r, with_tree: bool) -> tuple[str, str]:
        """(examples, note) for the mutants below a bundle's resolution; without DDTree runs, not DDTree's."""
        below = r["below"]
        if not isinstance(below, list):
            examples, note = "", f" ({r['mutation_note']})"
        else:
            if not with_tree:
                below = [n for n in below if n not in (r.get("below_ddtree") or ())]
            more = f" and {len(below) - EXAMPLES} more" if len(below) > EXAMPLES else ""
            examples = f" (e.g. {', '.join(below[:EXAMPLES])}{more} of the catalogue)" if below else ""
            note = "" if below else " (no catalogue mutant judged on this bundle is below it)"
        if isinstance(r.get("mixing_scale"), str):
            note += f"; it sees {r['mixing_scale']}"
        return examples, note

    tree_rows = rows[rows["mode"].astype(str).str.startswith("ddtree")] if len(rows) else rows
    tree_runs = set(zip(tree_rows["engine"], tree_rows["model"], tree_rows["precision"])) if len(tree_rows) else set()
    for _, r in resolution.iterrows():
        c = r["precision_class"]
        mine = clean[(clean["model"] == r["model"]) & (clean["precision"] == r["precision"])
                     & (clean["precision_class"] == c)]
        where = f"{r['model']}/{r['precision']}"
        if not len(mine):
            examples, note = below_words(r, True)
            lines.append(f"resolution {where} at {c}: the noise model's verdict resolves {resolution_words(r)}; "
                         f"bugs smaller than that{examples} need a float32 run{note}")
        for e in mine["engine"]:
            examples, note = below_words(r, (e, r["model"], r["precision"]) in tree_runs)
            lines.append(f"CLEAN {e} {where}: clean at {c} down to {resolution_words(r)}; bugs smaller than that"
                         f"{examples} need {float32_advice(e, float32_engines, left_out)}{note}")
    return lines


def resolution_csv(resolution: pd.DataFrame) -> pd.DataFrame:
    """resolution.csv: the table with its lists as text (layers space-separated, mutants ';'-separated)."""
    return resolution.assign(
        hidden_rel_layers=resolution["hidden_rel_layers"].map(lambda v: " ".join(f"{x:.6g}" for x in v)),
        below=resolution["below"].map(lambda v: "; ".join(v) if isinstance(v, list) else ""),
        below_ddtree=resolution["below_ddtree"].map(lambda v: "; ".join(v) if isinstance(v, list) else ""))
