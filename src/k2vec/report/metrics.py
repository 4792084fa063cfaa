"""Divergence metrics: engine results (and the int4 golden) against the golden data.

One row per run x drafter accuracy x prompt. Everything per step is computed on arrays stacked over
all rows that share a golden (numpy, one [rows, steps, k] block per golden), so the cost per row is
the JSON load plus a few array conversions; only rows whose DDTree trace differs from the golden get
a per-round Python walk (to locate the first difference).

Conventions (docs/golden-format.md): step j produces generated token j and feeds the token at
position P-1+j. Up to and including the first divergent step k both sides fed the same tokens, so
logits, fingerprints and router choices are compared on steps 0..k (all steps for an exact prompt,
and for every score-mode row, which was fed the golden tokens); after k the inputs differ and the
comparison would mean nothing.

By concern: tokens.py, logits.py (errors, KL), fingerprints.py, routing.py, ddtree.py, score.py (score
statistics), classify.py (precision-aware classes), format_effect_table.py, integrity.py; this module loads
the results and puts the rows together.
"""

from __future__ import annotations

import contextlib
import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.modes import parse_mode
from k2vec.engines.gpus import short_uuid
from k2vec.model.conventions import CONVENTIONS, variant_key
from k2vec.report.classify import BudgetError, classify, resolve_budgets
from k2vec.report import gate
from k2vec.report.compare import compare_rows, finish_frame
from k2vec.report.ddtree import acceptance_hist, compare_tree
from k2vec.report.lossless import LOSSLESS_COLUMNS, flippable_steps, lossless_columns, tie_credit
from k2vec.report.format_effect_table import format_effect
from k2vec.report.classes import CLASSES, SEVERITY
from k2vec.report.golden_data import Golden, ReportError, golden_strength
from k2vec.report.integrity import CHANGED, RunChecks
from k2vec.report.logits import STEP_COLUMNS
from k2vec.report.noise import NoiseModel, Rule, noise_cells, noise_table, noise_verdicts, router_credit
from k2vec.report.resolution import resolution_table
from k2vec.engines.contract.result_cache import ResultCache
from k2vec.report.routing import score_evidence
from k2vec.report.score import SCORE_COLUMNS, score_stats
from k2vec.report.words import plural

__all__ = ["ROW_COLUMNS", "Metrics", "ReportError", "compute_metrics"]

# Columns of divergence.csv, in order (rows DataFrame).
ROW_COLUMNS = [
    "run", "engine", "model", "precision", "precision_class", "mode", "budget", "accuracy", "prompt", "status",
    "class", "convention", "first_step", "matched_steps", "same_top1", "golden_token", "engine_token",
    "golden_rank_in_engine", "engine_rank_in_golden", "margin", "golden_gap", "noise", "over_budget", "router_margin",
    "router_layer", "router_position", "router_evidence",
    "logit_steps", "topk_overlap", "logit_abs_max", "logit_abs_mean", "logit_abs_p99", "logit_rel_max",
    "logit_rel_mean", "logit_rel_p99", "logit_nmse", "kl_mean", "kl_p99", "kl_max",
    "first_bad_step", "first_bad_layer", "first_bad_rel_err", "fingerprint_rel_max", "fingerprint_rel_before",
    "router_diff_step", "router_diff_layer",
    "tree_match", "first_tree_diff_round", "first_tree_diff_node", "tree_diff_what", *LOSSLESS_COLUMNS,
    "accept_mean_engine", "accept_mean_golden", "tokens_per_s", "decode_tokens_per_s", "wall_s",
    "device", "gpu", "gpu_uuid", "reason", "tamper_proof", "tamper_note", "result",
]
OBJECT_COLUMNS = ("class", "tree_diff_what", "tree_match", "router_evidence", "lossless")


# ------------------------------------------------------------------------------------------ engine rows


@dataclass
class _Item:
    """One run x accuracy x prompt before the metrics."""
    base: dict[str, Any]
    data: Mapping[str, Any] | None   # the prompt's result object (tokens, topk_ids, ...); None if failed
    rounds_ref: tuple[int, int] | None = None  # (budget, accuracy index) of the golden DDTree trace


@dataclass
class Metrics:
    rows: pd.DataFrame          # one row per run x accuracy x prompt (divergence.csv)
    runs: pd.DataFrame          # one row per run x accuracy (the summary table)
    steps: pd.DataFrame         # per row and compared step: logit error, KL (the logit-error plot)
    acceptance: pd.DataFrame    # DDTree acceptance-length histogram data, engine and golden
    score_runs: pd.DataFrame    # one row per score run (score.py), the int4-format reference rows included
    format_effect: pd.DataFrame  # fp32 vs int4 golden, one row per model x prompt
    format_steps: pd.DataFrame  # fp32 vs int4 golden per step: KL, logit error, top-k overlap
    format_models: pd.DataFrame  # fp32 vs int4 golden per model: same-top-1 rate etc.
    score_reference_steps: pd.DataFrame  # per step KL of the int4-format reference runs (model, prompt, step, kl)
    thresholds: dict[str, float] = field(default_factory=dict)
    golden_strength: pd.DataFrame = field(default_factory=pd.DataFrame)   # per golden (report/golden_data.py)
    prompt_strength: pd.DataFrame = field(default_factory=pd.DataFrame)   # per golden x prompt: margins, blind
    noise_calibration: pd.DataFrame = field(default_factory=pd.DataFrame)  # per noise model x held-out schedule
    noise_table: pd.DataFrame = field(default_factory=pd.DataFrame)  # per reduced-precision engine x bundle
    resolution: pd.DataFrame = field(default_factory=pd.DataFrame)  # per noise model: what its verdict resolves
    float32_engines: dict[str, str] = field(default_factory=dict)  # reduced-precision engine -> its float32 one
    left_out: dict[str, str] = field(default_factory=dict)  # configured engines with no run -> why
    fail_on_left_out: bool = False  # report.fail_on_left_out: a left-out engine fails the strict verdict

    @property
    def strict_problem(self) -> str | None:
        """Why these rows, and the engines left out where they count, fail the strict verdict
        (report/gate.py), or None."""
        return gate.strict_problem(self.rows, self.left_out if self.fail_on_left_out else {})


def _load_result(path: str | Path, results: ResultCache) -> tuple[dict[str, Any] | None, str | None]:
    """The result JSON, or (None, reason) when it cannot be read: the report shows it as a failed run
    instead of stopping (the runner always writes one, but a report over old files may meet anything)."""
    try:
        res = results.load(path)
    except FileNotFoundError:
        return None, f"result file missing: {path}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"result file unreadable: {err}"
    if not isinstance(res, dict) or not isinstance(res.get("runs"), list):
        return None, "result file is not an engine result (no 'runs' list)"
    return res, None


def gpu_identity(res: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """(label, UUIDs) of the GPUs a run used, from the runner's `gpu_devices`: 'NVIDIA H200 GPU-1a2b3c4d'
    per device for the report, full UUIDs for grouping failures by GPU; (None, None) for CPU runs."""
    devices = (res or {}).get("gpu_devices")
    if not isinstance(devices, list) or not devices:
        return None, None
    labels, uuids = [], []
    for d in devices:
        d = d if isinstance(d, dict) else {}
        if d.get("uuid"):
            labels.append(f"{d.get('name') or 'GPU'} {short_uuid(str(d['uuid']))}")
            uuids.append(str(d["uuid"]))
        else:
            labels.append(f"GPU {d.get('id')} (unidentified: {(res or {}).get('gpu_identity_error') or 'no UUID'})")
    return "; ".join(labels), ";".join(uuids) or None


def _run_items(r_i: int, spec: Mapping[str, Any], g: Golden, checks: RunChecks,
               results: ResultCache) -> tuple[list[_Item], dict[str, Any]]:
    """The rows of one run entry and its run-level facts (status, throughput)."""
    kind, budget = parse_mode(spec["mode"])
    res, reason = _load_result(spec["result"], results)
    if res is not None and spec.get("contract") is not None and res.get("status", "ok") == "ok":
        try:   # straight from an engine (report/judge.py): the runner's checks, which the report relies on
            check_result(res, spec["mode"], spec["contract"])
        except InvalidResult as err:
            res, reason = None, f"not a valid result (docs/engine-contract.md): {err}"
    status = "failed" if res is None else str(res.get("status", "ok"))
    if res is not None and status != "ok":
        reason = str(res.get("reason") or f"status {status!r}")
        status = "failed"
    changed = checks.problem(spec, res)
    if changed:
        status, reason = CHANGED, changed
    base = {"run": r_i, "engine": spec["engine"], "model": spec["model"], "precision": spec["precision"],
            "precision_class": spec.get("precision_class", "float32"), "reference": bool(spec.get("reference")),
            "convention": judged_against(spec),
            "mode": spec["mode"], "kind": kind, "budget": budget if kind == "ddtree" else None,
            "result": str(spec["result"]), "device": (res or {}).get("device")}
    base["gpu"], base["gpu_uuid"] = gpu_identity(res)
    # for the tamper verdict, once every run is loaded (_tamper_columns)
    base["ran_unsandboxed"] = (res is not None and status != CHANGED and not spec.get("reference")
                               and res.get("sandbox") is not True)
    accs: list[float | None] = list(g.accuracies) if kind == "ddtree" else [None]
    items: list[_Item] = []

    def failed(why: str, accuracies: Sequence[float | None], status: str = "failed") -> None:
        for acc in accuracies:
            for p in range(g.n_prompts):
                items.append(_Item({**base, "accuracy": acc, "prompt": p, "status": status, "reason": why}, None))

    if status != "ok":
        failed(reason, accs, status)
    else:
        for run in res["runs"]:
            drafter = run.get("drafter")
            acc = None if drafter is None else float(drafter["accuracy"])
            prompts = run.get("prompts") or []
            if kind != "ddtree" and acc is not None:
                failed(f"{kind} result has a drafter run (accuracy {acc})", [acc])
            elif kind == "ddtree" and acc not in g.accuracies:
                failed(f"drafter accuracy {acc} is not in the golden's {g.accuracies}", [acc])
            elif len(prompts) != g.n_prompts:
                failed(f"{plural(len(prompts), 'prompt')} in the result, the golden has {g.n_prompts}", [acc])
            else:
                ref = None
                if kind == "ddtree" and g.has_trace(budget, g.accuracies.index(acc)):
                    ref = (budget, g.accuracies.index(acc))
                for p, pd_ in enumerate(prompts):
                    items.append(_Item({**base, "accuracy": acc, "prompt": p, "status": "ok", "reason": None},
                                       pd_, ref))
        seen = {it.base["accuracy"] for it in items}
        missing = [a for a in accs if a not in seen]
        if missing:   # the runner checks this; a result from elsewhere may still lack a run
            failed("no run in the result" + ("" if kind != "ddtree" else " for this drafter accuracy"), missing)
    tokens = sum(len(it.data.get("tokens", ())) for it in items if it.data is not None)
    wall = (res or {}).get("wall_s")
    decode = ((res or {}).get("timing") or {}).get("decode_s")
    facts = {
        "result_json": res,
        "tokens_per_s": tokens / wall if wall and tokens else np.nan,
        "decode_tokens_per_s": tokens / decode if decode and tokens else np.nan,
        "wall_s": np.nan if wall is None else float(wall), "stderr_tail": (res or {}).get("stderr_tail"),
    }
    for it in items:
        it.base.update({k: v for k, v in facts.items() if k not in ("stderr_tail", "result_json")})
    return items, facts


# ---------------------------------------------------------------------------------------------- driver


def judged_against(spec: Mapping[str, Any]) -> str | None:
    """The convention variant a run is judged against: that of the conventions its engine declares, or None
    (the golden)."""
    return variant_key(spec.get("conventions") or ()) or None


def _check_golden(goldens: Mapping[tuple[str, str], Any], key: tuple[str, str], who: str) -> None:
    if key not in goldens:
        have = ", ".join(f"{m}/{p}" for m, p in sorted(goldens)) or "none"
        raise ReportError(f"no golden for model {key[0]!r} precision {key[1]!r} (needed by {who}); "
                          f"goldens given: {have}")


def read_budgets(path: str | Path | None) -> dict[str, Any] | None:
    """A command line's --budgets FILE: per precision, budgets laid over the defaults (report.budgets)."""
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"--budgets {path}: {err}") from None


def compute_metrics(runs: Sequence[Mapping[str, Any]], goldens: Mapping[tuple[str, str], str | Path], *,
                    near_tie: float = 1e-3, router_near_tie: float = 1e-3, fingerprint_rtol: float = 1e-3,
                    budgets: Mapping[str, Mapping[str, Any]] | None = None,
                    noise: Mapping[tuple[str, str, str], str | Path] | None = None,
                    conventions: Mapping[tuple[str, str, str], str | Path] | None = None,
                    noise_rule: Mapping[str, Any] | None = None, integrity_key: str | Path | None = None,
                    mutation_resolution: str | Path | None = None, result_cache: ResultCache | None = None) -> Metrics:
    """All report data for `runs` ({"engine","model","precision","mode","result"}, optional
    "precision_class" (default float32), "reference" (the int4-format row: scored, not judged), and for
    the judge (report/judge.py) "bundle" (integrity.RunChecks) and "contract" (the bundle's Expectations:
    a result straight from an engine, checked as the runner checks one) each) against `goldens`
    ({(model, precision): golden KDTR path, or the bundle that carries the golden}). `budgets`: per precision class,
    laid over classify.DEFAULT_BUDGETS. `noise`: {(model, precision, precision class): noise-model
    path} (k2vec.stages.noise), judged by `noise_rule` (report/noise.py, laid over NOISE_RULE).
    `conventions`: {(model, precision, variant): convention-variant path} (k2vec.stages.convention): a run
    whose spec lists "conventions" (its engine's declared ones) is judged against that variant; an engine that
    declares none and fails the golden on a bundle is judged against each variant there too, and where it
    passes one, its failing rows there are `convention` (_recognise_conventions).
    `integrity_key`: the results directory's integrity key file (digests.integrity_key_path), with which
    engine results' keyed records are checked; None: their sha256 records, every row not tamper-proof.
    `mutation_resolution`: the mutation run's per-bundle resolvability (report/resolution.py
    MUTATION_RESOLUTION_FILE), read where it exists: the mutants below each noise model's resolution.
    `result_cache`: where the results' parses are kept for later reports (engines/contract/result_cache.py); None parses
    each."""

    try:
        budgets = resolve_budgets(budgets)
    except BudgetError as err:
        raise ReportError(str(err)) from None
    opened: dict[tuple[str, str], Golden] = {}
    variants: dict[tuple[str, str, str], Golden] = {}
    try:
        needed = set()
        for i, spec in enumerate(runs):
            missing = [k for k in ("engine", "model", "precision", "mode", "result") if k not in spec]
            if missing:
                raise ReportError(f"run entry {i} lacks {', '.join(missing)}: {dict(spec)}")
            try:
                parse_mode(spec["mode"])
            except ValueError as err:
                raise ReportError(f"run entry {i} ({spec['engine']}): {err}") from None
            pc = spec.get("precision_class", "float32")
            if pc not in budgets:
                raise ReportError(f"run entry {i} ({spec['engine']}): precision_class {pc!r} is not one of "
                                  f"{', '.join(budgets)} (engines.{spec['engine']}.precision)")
            key = (spec["model"], spec["precision"])
            _check_golden(goldens, key, f"engine {spec['engine']!r} {spec['mode']} ({spec['result']})")
            needed.add(key)
        models = {m for m, _ in goldens}
        for m in sorted(models):   # the format comparison needs both goldens of a model
            if (m, "fp32") in goldens and (m, "int4") in goldens:
                needed |= {(m, "fp32"), (m, "int4")}
        for key in sorted(needed):
            opened[key] = Golden(key[0], key[1], goldens[key])
        variants = {}
        for (m, p, v), path in sorted((conventions or {}).items()):
            if (m, p) in opened:
                variants[(m, p, v)] = g = Golden(m, p, path, variant=v)
                if g.metadata.get("golden_sha256") != opened[(m, p)].sha256:
                    raise ReportError(f"{path}: convention variant made from another golden than "
                                      f"{opened[(m, p)].path}; rerun Snakemake to rebuild it")
        for i, spec in enumerate(runs):
            v = judged_against(spec)
            if v is not None and (spec["model"], spec["precision"], v) not in variants:
                raise ReportError(f"run entry {i} ({spec['engine']}) declares conventions {v!r}, but no convention "
                                  f"variant of {spec['model']}/{spec['precision']} was given for it")
        rule = Rule.from_config(noise_rule)
        models = {}
        for (m, p, c), path in sorted((noise or {}).items()):
            if (m, p) in opened:
                models[(m, p, c)] = NoiseModel(path, opened[(m, p)], c)
        th = {"near_tie": near_tie, "router_near_tie": router_near_tie, "fingerprint_rtol": fingerprint_rtol}
        rows, runs_df, steps, acceptance, score_runs, ref_steps = _engine_metrics(
            runs, opened, th, budgets, RunChecks({k: g.sha256 for k, g in opened.items()}, integrity_key),
            result_cache or ResultCache(None), models, rule, variants)
        fe, fe_steps, fe_models = format_effect(opened, th, budgets)
        strength, prompt_strength = golden_strength(opened, near_tie, router_near_tie)
        calibration = pd.DataFrame([{"model": m, "precision": p, "precision_class": c, **rec}
                                    for (m, p, c), nm in models.items() for rec in nm.calibration(rule)])
        return Metrics(rows, runs_df, steps, acceptance, score_runs, fe, fe_steps, fe_models, ref_steps,
                       {**th, "budgets": budgets, "noise_rule": vars(rule)}, strength, prompt_strength, calibration,
                       noise_table(rows, calibration, rule),
                       resolution_table(models, opened, rule, mutation_resolution))
    finally:
        for g in [*opened.values(), *variants.values()]:
            g.close()


@contextlib.contextmanager
def _no_gc():
    """Keep the cyclic GC off while millions of JSON lists stay alive: each full collection would walk
    them all again (2,000 results: 6.0 s to load with it, 2.5 s without). JSON data has no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _engine_metrics(runs, opened: dict[tuple[str, str], Golden], th: dict[str, float], budgets, checks: RunChecks,
                    results: ResultCache, noise: dict[tuple[str, str, str], NoiseModel], rule: Rule,
                    variants: dict[tuple[str, str, str], Golden]):
    with _no_gc():
        return _engine_metrics_inner(runs, opened, th, budgets, checks, results, noise, rule, variants)


def _engine_metrics_inner(runs, opened: dict[tuple[str, str], Golden], th: dict[str, float], budgets,
                          checks: RunChecks, results: ResultCache, noise_models: dict[tuple[str, str, str], NoiseModel],
                          rule: Rule,
                          variants: dict[tuple[str, str, str], Golden], recognise: bool = True):
    def golden_for(model: str, precision: str, variant: Any) -> Golden:
        return variants[(model, precision, variant)] if isinstance(variant, str) else opened[(model, precision)]

    items: list[_Item] = []
    stderr: dict[int, str | None] = {}
    loaded: dict[int, tuple[Mapping[str, Any], Mapping[str, Any] | None, str]] = {}
    for r_i, spec in enumerate(runs):
        its, facts = _run_items(r_i, spec, golden_for(spec["model"], spec["precision"], judged_against(spec)), checks,
                                results)
        items.extend(its)
        stderr[r_i] = facts["stderr_tail"]
        if its:
            loaded[r_i] = (spec, facts["result_json"], its[0].base["status"])
    _tamper_columns(items, loaded, checks)
    if not items:   # no engine runs: the report still shows the format effect
        empty = finish_frame(pd.DataFrame(columns=ROW_COLUMNS), ROW_COLUMNS)
        return empty, pd.DataFrame(), pd.DataFrame(columns=["row"] + STEP_COLUMNS[1:]), acceptance_hist([]), \
            pd.DataFrame(columns=SCORE_COLUMNS), pd.DataFrame(columns=["model", "prompt", "step", "kl"])
    base = pd.DataFrame([it.base for it in items])
    extra: dict[str, np.ndarray] = {}
    step_frames, hist_rows = [], []
    score_routing: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def put(idx: np.ndarray, name: str, values) -> None:
        if name not in extra:
            extra[name] = np.full(len(items), np.nan, dtype=object if name in OBJECT_COLUMNS else float)
        extra[name][idx] = values

    ok = np.array([it.data is not None for it in items], bool)
    for (*key, variant), grp in base[ok].groupby(["model", "precision", "convention"], sort=False, dropna=False):
        key = tuple(key)
        idx = grp.index.to_numpy()
        g = golden_for(*key, variant)
        prompt = base["prompt"].to_numpy()[idx].astype(np.int64)
        ref = g.tokens[prompt].copy()
        # DDTree rows must match the golden DDTree trace's tokens (equal to greedy unless the golden
        # itself recorded a near-tie flip, metadata summary.ddtree_mismatches)
        traces: dict[int, dict[str, np.ndarray]] = {}
        for j, i in enumerate(idx):
            if items[i].rounds_ref is not None:
                traces[j] = g.trace(*items[i].rounds_ref, int(prompt[j]))
                ref[j] = traces[j]["tokens"][:g.N]
        cells: dict = {}
        cols, steps, by_pos = compare_rows(g, [items[i].data for i in idx], prompt, ref,
                                           score=(grp["kind"] == "score").to_numpy(),
                                           fingerprint_rtol=th["fingerprint_rtol"], cells=cells)
        for name, values in noise_cells(noise_models, key, grp["precision_class"].to_numpy(), prompt, cols, steps,
                                        cells, (grp["kind"] == "score").to_numpy(), rule).items():
            put(idx, name, values)
        for j, ev in by_pos.items():
            b = items[idx[j]].base
            score_routing[(b["engine"], b["model"], b["precision"], b["prompt"])] = ev
        for name, values in cols.items():
            put(idx, name, values)
        if len(steps):
            steps["i"] = idx[steps["i"].to_numpy()]
            step_frames.append(steps)
        tree_i, tree_vals, g_means, g_i = [], [], [], []
        for j, tr in traces.items():
            i = idx[j]
            b = items[i].base
            g_len = tr["accept_lengths"]
            g_i.append(i)
            g_means.append(tr["accept_mean"])
            hist_rows.append((b["model"], b["precision"], b["mode"], b["accuracy"], "golden", b["run"], b["prompt"],
                              g_len))
            rounds = items[i].data.get("rounds")
            if rounds is None:   # the engine gave no rounds: tokens are still compared, the tree is not
                continue
            if rounds == tr["rounds"]:   # the common case, one deep comparison in C
                match, rnd, node, what, e_len, e_mean = True, None, None, None, g_len, tr["accept_mean"]
            else:
                match, rnd, node, what, e_len = compare_tree(rounds, tr)
                e_mean = float(e_len.mean()) if e_len.size else np.nan
            tree_i.append(i)
            tree_vals.append((match, np.nan if rnd is None else rnd, np.nan if node is None else node, what, e_mean))
            hist_rows.append((b["model"], b["precision"], b["mode"], b["accuracy"], b["engine"], b["run"], b["prompt"],
                              e_len))
        if g_i:
            put(np.array(g_i), "accept_mean_golden", g_means)
        if tree_i:
            ti = np.array(tree_i)
            for name, values in zip(("tree_match", "first_tree_diff_round", "first_tree_diff_node", "tree_diff_what",
                                     "accept_mean_engine"), zip(*tree_vals)):
                put(ti, name, list(values))
    for name, values in extra.items():
        if name == "tree_match":
            base[name] = pd.array([None if (isinstance(v, float) and np.isnan(v)) else bool(v) for v in values],
                                  dtype="boolean")
        else:
            base[name] = values
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame(columns=STEP_COLUMNS)
    steps = steps.rename(columns={"i": "row"})
    for c in ROW_COLUMNS + ["noise_before"]:
        if c not in base:
            base[c] = np.nan
    _take_score_routing(base, score_routing, opened)
    # DDTree rows record no routing: from the first step where a correct engine may flip an expert, their
    # divergence is a router-near-tie with that golden decision as evidence (report/lossless.py)
    flippable = flippable_steps(base, noise_models, {k: g.moe_layers for k, g in opened.items()}, rule)
    tie = np.isfinite(flippable["step"]) & (base["first_step"].to_numpy(float) >= flippable["step"]) \
        & base["router_margin"].isna().to_numpy()
    if tie.any():
        for c in ("router_margin", "router_layer", "router_position"):
            base.loc[tie, c] = flippable[c][tie]
        base["router_evidence"] = base["router_evidence"].astype(object)
        base.loc[tie, "router_evidence"] = ("a golden decision a correct engine may flip "
                                            "(DDTree results record no routing)")
    # score statistics first: a run over its budget gets no tie credit in its greedy / DDTree rows either
    judged = base["status"] == "ok"
    scored = score_stats(base[judged & (base["kind"] == "score")], steps, budgets,
                         {k: nm.kl_stats() for k, nm in noise_models.items()}, rule)
    over = {(r.engine, r.model, r.precision): r.over_budget for r in scored.itertuples() if r.over_budget}
    # An engine's noise is a property of the engine on these weights, not of one prompt: one prompt's
    # errors before its divergence can be 10x smaller than the same engine's elsewhere (bfloat16 on the
    # default cases: 0.2 to 3.2). So the tie credit uses the largest error of its whole score run.
    noise = base[judged & (base["kind"] == "score")].groupby(["engine", "model", "precision"])["logit_abs_max"].max()
    keys = pd.MultiIndex.from_frame(base[["engine", "model", "precision", "prompt"]])
    base["score_noise"] = noise.reindex(keys.droplevel("prompt")).to_numpy(float) if len(noise) else np.nan
    base["run_over_budget"] = [over.get(k[:3]) for k in keys]
    # over the noise model: by the cells of every mode pooled, else by its score run's KL alone
    kl_over = {(r.engine, r.model, r.precision): r.noise_over for r in scored.itertuples() if r.noise_over}
    pooled = noise_verdicts(base, rule)
    base["noise_over"] = np.where(pd.notna(pooled), pooled, np.array([kl_over.get(k[:3]) for k in keys], object))
    base["noise_router_credit"] = router_credit(noise_models, opened, base, rule)
    n_steps = max((g.N for g in opened.values()), default=0)
    for name, values in lossless_columns(base, [it.data for it in items],
                                         tie_credit(base, noise_models, budgets, rule.margin, n_steps),
                                         n_steps, flippable["step"]).items():
        base[name] = values
    classified = classify(base, budgets, near_tie=th["near_tie"], router_near_tie=th["router_near_tie"])
    classified["class"] = _not_judged_class(base["status"], classified["class"])
    if recognise:
        _recognise_conventions(classified, runs, opened, th, budgets, checks, results, noise_models, rule, variants)
    # the int4-format reference rows are scored (score table), not judged as an engine
    rows = finish_frame(classified[~classified["reference"]].reset_index(drop=True), ROW_COLUMNS)
    kept = ~base["reference"].to_numpy()
    new_index = pd.Series(np.cumsum(kept) - 1, index=base.index)[kept]
    ref = steps[~steps["row"].isin(new_index.index)].join(base[["model", "prompt"]], on="row")
    steps = steps[steps["row"].isin(new_index.index)].assign(row=lambda s: new_index.reindex(s["row"]).to_numpy())
    return rows, _run_summary(rows, stderr), steps.reset_index(drop=True), acceptance_hist(hist_rows), scored, \
        ref[["model", "prompt", "step", "kl"]].reset_index(drop=True)


# A row's strict verdicts that a convention can explain (report/gate.py): errors or tokens off the golden's.
# failed and changed runs are not judged, against the golden or a variant.
_EXPLAINABLE = ("real", "over-budget", gate.TREE_DIFFERS)


def _recognise_conventions(rows: pd.DataFrame, runs, opened, th, budgets, checks: RunChecks, results: ResultCache,
                           noise_models, rule, variants: dict[tuple[str, str, str], Golden]) -> None:
    """An engine that declares no convention and fails the golden on a bundle, judged there against each known
    convention's variant (k2vec.model.conventions, in its order): where none of its rows fails the variant,
    its rows that fail the golden become `convention`, with the convention's name (in place, on `rows`).
    A row that fails the variant too keeps its class: the convention does not explain it."""
    judged = rows[~rows["reference"] & (rows["status"] == "ok") & rows["convention"].isna()]
    bad = judged[gate.verdicts(judged).isin(_EXPLAINABLE)]
    for (e, m, p), grp in bad.groupby(["engine", "model", "precision"], sort=True):
        sub = [r for r in runs if (r["engine"], r["model"], r["precision"]) == (e, m, p) and not r.get("reference")]
        for name in CONVENTIONS:
            if (m, p, name) not in variants:
                continue
            against = _engine_metrics_inner([{**r, "conventions": [name]} for r in sub], opened, th, budgets, checks,
                                             results, noise_models, rule, variants, recognise=False)[0]
            against = against[against["status"] == "ok"]
            if len(against) and not gate.verdicts(against).isin(_EXPLAINABLE).any():
                rows.loc[grp.index, "class"] = "convention"
                rows.loc[grp.index, "convention"] = name
                break


def _tamper_columns(items: list[_Item], loaded, checks: RunChecks) -> None:
    """tamper_proof and tamper_note of every row (report/integrity.py, RunChecks.tamper_verdict): a run
    is tamper-proof only if nothing that ran unsandboxed was judged beside it."""
    unsandboxed = sorted({it.base["engine"] for it in items if it.base.pop("ran_unsandboxed", False)})
    verdicts = {r_i: checks.tamper_verdict(spec, res, status, unsandboxed)
                for r_i, (spec, res, status) in loaded.items()}
    for it in items:
        note = verdicts.get(it.base["run"])
        it.base["tamper_proof"], it.base["tamper_note"] = note is None, note


def _take_score_routing(base: pd.DataFrame, score_routing, opened: dict[tuple[str, str], Golden]) -> None:
    """Router evidence for greedy / DDTree divergences from the same engine's score run (routing.py):
    kept where it is a nearer tie than the row's own evidence. A Python loop, but over the divergent
    rows of engines with a score run only (few; each a slice and a min)."""
    if not score_routing:
        return
    div = base.index[(base["kind"] != "score") & base["first_step"].notna()]
    for i in div:
        b = base.loc[i]
        ev = score_routing.get((b["engine"], b["model"], b["precision"], b["prompt"]))
        if ev is None:
            continue
        g = opened[(b["model"], b["precision"])]
        found = score_evidence(*ev, int(g.prompt_lengths[int(b["prompt"])] - 1 + b["first_step"]))
        if found and not found[0] >= b["router_margin"]:   # NaN own evidence: take the score run's
            base.loc[i, ["router_margin", "router_layer", "router_position"]] = found
            base.loc[i, "router_evidence"] = "engine routing differs (its score run)"


def _not_judged_class(status: pd.Series, judged) -> np.ndarray:
    """`judged` where the run is ok, else its status as the class (failed, changed)."""
    return np.where(status == "ok", judged, np.where(status == CHANGED, CHANGED, "failed"))


def _run_summary(rows: pd.DataFrame, stderr: dict[int, str | None]) -> pd.DataFrame:
    """One row per run x accuracy: class counts, worst class, first divergence, error maxima."""
    if rows.empty:
        return pd.DataFrame()
    keys = ["run", "engine", "model", "precision", "mode", "accuracy"]
    sev = rows["class"].map(SEVERITY)
    counts = pd.crosstab([rows[k].fillna(-1.0) if k == "accuracy" else rows[k] for k in keys], rows["class"])
    for c in CLASSES:
        if c not in counts:
            counts[c] = 0
    # (step, layer) of the earliest bad fingerprint among the prompts, as one sortable number
    fb = rows["first_bad_step"].astype("float") * 1e6 + rows["first_bad_layer"].astype("float")
    tree_bad = (rows["tree_match"] == False).fillna(False).astype(int)  # noqa: E712
    agg = rows.assign(sev=sev, fb=fb, tree_bad=tree_bad, accuracy=rows["accuracy"].fillna(-1.0)).groupby(
        keys, sort=False).agg(
        status=("status", "first"), precision_class=("precision_class", "first"), prompts=("prompt", "size"),
        worst=("sev", "max"),
        first_step=("first_step", "min"), logit_abs_max=("logit_abs_max", "max"), kl_max=("kl_max", "max"),
        fb=("fb", "min"), router_diff_step=("router_diff_step", "min"),
        trees=("tree_match", "count"), trees_differ=("tree_bad", "sum"),
        accept_mean_engine=("accept_mean_engine", "mean"), accept_mean_golden=("accept_mean_golden", "mean"),
        tokens_per_s=("tokens_per_s", "first"), decode_tokens_per_s=("decode_tokens_per_s", "first"),
        wall_s=("wall_s", "first"), device=("device", "first"), gpu=("gpu", "first"), reason=("reason", "first"),
        result=("result", "first"), tamper_proof=("tamper_proof", "first"), tamper_note=("tamper_note", "first"),
    )
    agg = agg.join(counts[list(CLASSES)]).reset_index()
    agg["worst"] = np.asarray(CLASSES, dtype=object)[agg["worst"].to_numpy()]
    agg["exact_rate"] = agg["exact"] / agg["prompts"]
    agg["accuracy"] = agg["accuracy"].where(agg["accuracy"] >= 0)
    agg["stderr_tail"] = agg["run"].map(stderr)
    agg["first_bad_step"], agg["first_bad_layer"] = agg["fb"] // 1e6, agg["fb"] % 1e6
    agg = agg.drop(columns="fb")
    agg["label"] = _labels(agg)
    return agg


def _labels(df: pd.DataFrame) -> pd.Series:
    acc = df["accuracy"].map(lambda a: "" if pd.isna(a) else f" p={a:g}")
    return df["engine"].astype(str) + " " + df["model"].astype(str) + "/" + df["precision"].astype(str) + " " \
        + df["mode"].astype(str) + acc
