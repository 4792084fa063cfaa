"""Verdicts of reduced-precision engines against the noise model (k2vec.stages.noise).

The noise model of a golden and a precision holds S emulated correct engines (rounding schedules), fed the
golden tokens. From them, per prompt and step (and layer): the envelope, the largest error any schedule
shows there, of the residual stream after each layer (relative L2 against the golden fingerprint) and of
the logits (largest |error| over the golden's top-K ids) and of their distribution (KL(golden || schedule),
as the report takes an engine's). A step is judged only where every schedule routes
as the golden at the fed position: where a correct engine may flip an expert, the error is a routing
effect, not rounding.

The rule (docs/report.md "Noise model"). An engine's cells, on the steps up to its first divergence
(inclusive: that step was fed the golden's tokens too): each (step, layer) of its residual stream and each
step of its logits (their largest error, and their KL), on judged steps before its first flipped expert (from
there its state follows another routing, through the flipped layer and the KV cache); and each router
decision. A hidden or logit cell is *beyond* the noise model when its error exceeds `margin` times the
envelope there, a KL cell at `margin` squared (Rule.kl_margin); a router cell when the
engine flips a decision that no schedule flips, with a golden margin over twice `margin` times the largest
movement of that margin under the schedules. The engine on one bundle (all its rows there, every mode
pooled: its rounding is a property of the engine, not of one prompt or mode) is *over the noise model* when
more than `fraction` of at least `min_cells` cells of one kind are beyond. A correct engine of the
precision is one more draw of the same rounding: each of its cells exceeds the largest of S draws with
probability 1/(S+1) at most, and `margin` on top of that, so a fifth of cells beyond is far out of its
reach; `calibration` measures exactly this for each schedule held out against the envelope of the others,
and the report prints it next to the verdicts.

The tie credit of a divergence is the envelope's logit error at the divergent step, times `margin`: both
logits of the swapped pair may move by it, so a golden gap up to twice that is a precision-tie. It never
depends on the engine's own errors, which a bug inflates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from k2vec.digests import IntegrityError, verify_kdtr
from k2vec.kdtr import open_bundle
from k2vec.report.golden_data import Golden, ReportError
from k2vec.report.logits import lookup, topk_kl

# The rule's defaults (config.yaml report.noise, docs/report.md "Noise model").
NOISE_RULE = {"margin": 2.0, "fraction": 0.2, "min_cells": 6}
ENVELOPE_FLOOR = 1e-12   # an envelope of exactly 0 (a layer no schedule rounds): any error is beyond it


@dataclass(frozen=True)
class Rule:
    margin: float
    fraction: float
    min_cells: int

    @classmethod
    def from_config(cls, cfg: Mapping | None) -> "Rule":
        merged = {**NOISE_RULE, **(cfg or {})}
        unknown = set(merged) - set(NOISE_RULE)
        if unknown:
            raise ReportError(f"report.noise.{sorted(unknown)[0]}: unknown setting; known: {', '.join(NOISE_RULE)}")
        try:
            rule = cls(float(merged["margin"]), float(merged["fraction"]), int(merged["min_cells"]))
        except (TypeError, ValueError) as err:
            raise ReportError(f"report.noise: {err}") from None
        if rule.margin < 1 or not 0 < rule.fraction < 1 or rule.min_cells < 1:
            raise ReportError("report.noise: margin must be >= 1, fraction in (0, 1), min_cells >= 1")
        return rule

    @property
    def kl_margin(self) -> float:
        """The margin of a KL cell: KL is second order in the logit error (half its square, weighted by the
        distribution), so the logits' `margin` is its square on KL. With `margin` itself, a held-out correct
        schedule puts about twice as many of its KL cells beyond as of its logit cells."""
        return self.margin ** 2

    def margin_of(self, kind: str) -> float:
        """The margin of a cell kind (CELL_KINDS' stem)."""
        return self.kl_margin if kind == "kl" else self.margin


class NoiseModel:
    """One noise-model file, verified and checked against the golden it was made from, as envelopes."""

    def __init__(self, path: str | Path, g: Golden, precision_class: str):
        path = Path(path)
        who = f"noise model of {g.model}/{g.precision} at {precision_class}"
        try:
            verify_kdtr(path)
        except IntegrityError as err:
            raise ReportError(f"{who} is not readable as the noise stage wrote it: {err}. Rebuild it: delete "
                              f"{path} and rerun Snakemake") from None
        with open_bundle(path) as b:
            md = b.metadata
            if md.get("kind") != "k2vec-noise" or (md.get("model"), md.get("precision"), md.get("precision_class")) \
                    != (g.model, g.precision, precision_class):
                raise ReportError(f"{path} is not the {who} (metadata: kind {md.get('kind')!r}, model "
                                  f"{md.get('model')!r}, precision {md.get('precision')!r}, class "
                                  f"{md.get('precision_class')!r})")
            if md.get("golden_sha256") != g.sha256:
                raise ReportError(f"{path}: made from another golden than {g.path} (sha256 "
                                  f"{md.get('golden_sha256')} vs {g.sha256}); rerun Snakemake to rebuild it")
            self.path, self.precision_class = path, precision_class
            self.schedules = list(md["schedules"])
            P, S = g.n_prompts, len(self.schedules)

            def stack(name: str) -> np.ndarray:
                return np.stack([np.stack([np.asarray(b[f"noise.{s}.p{i}.{name}"]) for i in range(P)])
                                 for s in self.schedules])
            self.hidden_rel = stack("hidden_rel").astype(np.float64)                # [S, P, N, L]
            self.tokens = stack("tokens").astype(np.int64)                          # [S, P, N]
            ids, logits = stack("topk_ids").astype(np.int64), stack("topk_logits")  # [S, P, N, K]
            router = [[np.asarray(b[f"noise.{s}.p{i}.router_ids"]) for i in range(P)] for s in self.schedules]
            margins = [[np.asarray(b[f"noise.{s}.p{i}.router_margins"]) for i in range(P)] for s in self.schedules]
        at, found = lookup(ids, logits, np.broadcast_to(g.topk_ids, ids.shape[:1] + g.topk_ids.shape))
        with np.errstate(invalid="ignore"):
            err = np.where(found, np.abs(at - g.topk_logits[None]), np.nan)
        # a golden id the schedule did not list is at most its K-th logit away
        err = np.where(found, err, np.abs(logits[..., -1:] - g.topk_logits[None]))
        self.logit_abs = err.max(-1)                                                # [S, P, N]
        # KL(golden || schedule) per position, taken as an engine's is (logits.topk_kl)
        self.kl = topk_kl(np.broadcast_to(g.topk_ids, ids.shape[:1] + g.topk_ids.shape),
                          np.broadcast_to(g.topk_logits, ids.shape[:1] + g.topk_logits.shape), ids, logits)
        # every schedule routes as the golden at the fed position of step j (sets, every MoE layer)
        fed = g.fed_positions(np.arange(P))                                         # [P, N]
        same = np.ones((S, P, g.N), bool)
        # per router decision (prompt, position, MoE layer): how far a correct engine's router margin moves
        # from the golden's, inf where one of them chooses other experts there (a correct engine flips it)
        self.env_router = np.zeros(g.router_margins.shape)
        if g.moe_layers.size:
            for s in range(S):
                for i in range(P):
                    r = np.sort(router[s][i], axis=-1).transpose(1, 0, 2)           # [positions, M, k]
                    n_pos = r.shape[0]
                    flip = (r != g.router_ids[i, :n_pos]).any(-1)                   # [positions, M]
                    same[s, i] = ~flip[fed[i]].any(-1)
                    moved = np.abs(margins[s][i].T - g.router_margins[i, :n_pos])
                    self.env_router[i, :n_pos] = np.fmax(self.env_router[i, :n_pos], np.where(flip, np.inf, moved))
        self.routes_as_golden = same
        self.fed = fed
        self.golden_router_margins = g.router_margins                               # [P, positions, M]
        self.judged = same.all(0)                                                   # [P, N]
        self.env_hidden = np.maximum(self.hidden_rel.max(0), ENVELOPE_FLOOR)        # [P, N, L]
        self.env_logit = np.maximum(self.logit_abs.max(0), ENVELOPE_FLOOR)          # [P, N]
        self.env_kl = np.maximum(np.nan_to_num(self.kl).max(0), ENVELOPE_FLOOR)     # [P, N]
        self.same_top1 = (self.tokens == g.tokens[None]).mean(axis=(1, 2))          # [S]

    def calibration(self, rule: Rule) -> list[dict]:
        """Each schedule held out and judged by the rule against the envelope of the others: the fraction
        of its cells beyond (hidden states, logits, KL). A correct engine's fractions look like these."""
        out = []
        for s, name in enumerate(self.schedules):
            rest = [t for t in range(len(self.schedules)) if t != s]
            judged = self.routes_as_golden[rest].all(0) & self.routes_as_golden[s]
            rec = {"schedule": name}
            for kind, err in (("hidden", self.hidden_rel), ("logit", self.logit_abs), ("kl", self.kl)):
                env = np.maximum(np.nan_to_num(err[rest]).max(0), ENVELOPE_FLOOR)
                beyond = (err[s] > rule.margin_of(kind) * env)[judged]
                rec[f"{kind}_cells"] = int(beyond.size)
                rec[f"{kind}_beyond"] = float(beyond.mean()) if beyond.size else np.nan
            out.append(rec)
        return out

    def router_tie_bound(self, rule: Rule) -> np.ndarray:
        """[P, positions, M]: the golden router margin up to which a flipped decision is a correct engine's
        rounding: twice `margin` times the schedules' movement of it (inf where one of them flips it)."""
        return 2 * rule.margin * self.env_router

    def kl_stats(self) -> tuple[float, float]:
        """(mean, p99) of KL(golden || schedule) over every position, the largest of the schedules: what a
        correct engine's score run shows, beside an engine's (the score table)."""
        kl = self.kl.reshape(len(self.schedules), -1)
        return float(np.nanmax(np.nanmean(kl, axis=1))), float(np.nanmax(np.nanpercentile(kl, 99, axis=1)))

    def resolution(self, rule: Rule) -> dict:
        """The smallest error of each kind that the rule calls over this noise model, were an engine off by
        that much at every judged cell: `margin` times the envelope's order statistic just past `fraction`
        of the cells (more than `fraction` of them beyond is the verdict). hidden_rel: the residual stream's
        relative L2 error over all layers' cells, hidden_rel_layers: per layer; logit_abs: the largest
        top-K logit error of a step; kl: KL(golden || engine) of a step. NaN with fewer than `min_cells`
        cells (not judged)."""
        def threshold(env: np.ndarray, margin: float = rule.margin) -> float:
            env = env.ravel()
            if env.size < rule.min_cells:
                return np.nan
            k = int(np.floor(rule.fraction * env.size))
            return float(margin * np.partition(env, k)[k])
        hidden = self.env_hidden[self.judged]                                       # [cells, L]
        return {"hidden_rel": threshold(hidden), "hidden_rel_layers": [threshold(h) for h in hidden.T],
                "logit_abs": threshold(self.env_logit[self.judged]),
                "kl": threshold(self.env_kl[self.judged], rule.kl_margin),
                "hidden_cells": int(hidden.size), "step_cells": int(self.judged.sum())}


# the cell kinds: (name in the report's words, column stem)
CELL_KINDS = (("hidden-state error", "hidden"), ("logit error", "logit"), ("KL", "kl"), ("routing error", "router"))
_KIND_WORDS = {k: words for words, k in CELL_KINDS}
_COUNTS = tuple(f"noise_{k}_{what}" for _, k in CELL_KINDS for what in ("cells", "beyond"))
NOISE_COLUMNS = (*_COUNTS, "noise_credit")


def noise_cells(models: Mapping[tuple[str, str, str], NoiseModel], key: tuple[str, str], precision_class: np.ndarray,
                prompt: np.ndarray, cols: Mapping[str, np.ndarray], steps, cells: Mapping, score: np.ndarray,
                rule: Rule) -> dict[str, np.ndarray]:
    """Per row of one golden (compare_rows' output): its cells and how many are beyond the noise model, of
    hidden states, logits and routing; the tie credit at its divergent step; NaN for rows without a model."""
    R = len(prompt)
    out = {c: np.full(R, np.nan) for c in NOISE_COLUMNS}
    have = np.array([(key[0], key[1], c) in models for c in precision_class], bool)
    if not have.any():
        return out
    any_model = next(m for k, m in models.items() if k[:2] == key)
    N = any_model.env_logit.shape[1]
    fs = cols["first_step"]
    has_div = np.isfinite(fs) & ~score
    # cells: steps up to the first divergence (all compared steps without one), where the engine routed as the
    # golden. The divergent step is one: both sides fed the same tokens, so its residual stream and its logits
    # are a correct engine's up to rounding (its flipped token is what the credit then judges).
    limit = np.where(has_div, np.nan_to_num(fs) + 1, N)
    before = np.arange(N)[None, :] < limit[:, None]
    differs = np.asarray(cells.get("route_differs", np.zeros((R, N, 0), bool)))         # [R, N, M]
    first_flip = np.asarray(cells.get("first_flip_position", np.full(R, np.inf)))
    # hidden and logit cells stop at the engine's first flipped expert: from there its state follows another
    # routing (through the flipped layer and the KV cache), which its router cells judge instead
    g_fed = any_model.fed[prompt]                                                          # [R, N]
    own_route = g_fed < first_flip[:, None]
    step_abs, step_kl = np.full((R, N), np.nan), np.full((R, N), np.nan)
    if len(steps):
        at = steps["i"].to_numpy(int), steps["step"].to_numpy(int)
        step_abs[at], step_kl[at] = steps["abs_max"].to_numpy(float), steps["kl"].to_numpy(float)
    hidden = cells.get("hidden_rel") or [None] * R
    for c in np.unique(precision_class[have]):
        nm = models[(key[0], key[1], c)]
        rows = np.flatnonzero(have & (precision_class == c))
        p = prompt[rows]
        ok = before[rows] & own_route[rows] & nm.judged[p]                        # [r, N]
        lg = ok & np.isfinite(step_abs[rows])
        beyond = lg & (step_abs[rows] > rule.margin * nm.env_logit[p])
        out["noise_logit_cells"][rows], out["noise_logit_beyond"][rows] = lg.sum(1), beyond.sum(1)
        # KL cells: the same steps, the step's KL(golden || engine) against the schedules' largest there, at the
        # margin's square (Rule.kl_margin)
        kl = ok & np.isfinite(step_kl[rows])
        out["noise_kl_cells"][rows] = kl.sum(1)
        out["noise_kl_beyond"][rows] = (kl & (step_kl[rows] > rule.kl_margin * nm.env_kl[p])).sum(1)
        # router cells: each decision up to the divergence; beyond where the engine flips one that no
        # schedule flips and whose golden margin is over twice margin x the noise model's movement of it
        if differs.shape[-1]:
            g_pos = np.clip(nm.fed[p], 0, nm.env_router.shape[1] - 1)                 # [r, N]
            g_margin = np.take_along_axis(nm.golden_router_margins[p], g_pos[:, :, None], axis=1)
            bound = np.take_along_axis(nm.router_tie_bound(rule)[p], g_pos[:, :, None], axis=1)
            decided = before[rows][:, :, None] & np.isfinite(g_margin)
            flips = decided & differs[rows] & (g_margin > bound)
            out["noise_router_cells"][rows], out["noise_router_beyond"][rows] = decided.sum((1, 2)), flips.sum((1, 2))
        else:
            out["noise_router_cells"][rows] = out["noise_router_beyond"][rows] = 0
        fs_c = np.clip(np.nan_to_num(fs[rows]).astype(int), 0, N - 1)
        out["noise_credit"][rows] = np.where(has_div[rows], rule.margin * nm.env_logit[p, fs_c], np.nan)
        # hidden cells: each row's [n, L] errors against its prompt's envelope (rows differ in length)
        for i, r in enumerate(rows):
            rel = hidden[r]
            if rel is None:
                out["noise_hidden_cells"][r] = out["noise_hidden_beyond"][r] = 0
                continue
            n = rel.shape[0]
            m = ok[i, :n, None] & np.ones(rel.shape, bool)
            out["noise_hidden_cells"][r] = m.sum()
            out["noise_hidden_beyond"][r] = (m & (rel > rule.margin * nm.env_hidden[p[i], :n])).sum()
    return out


def noise_verdicts(rows, rule: Rule) -> np.ndarray:
    """Per row: why its engine, on its bundle (every mode pooled), is over the noise model, or None."""
    why = np.full(len(rows), None, object)
    if "noise_hidden_cells" not in rows or not rows["noise_hidden_cells"].notna().any():
        return why
    keyed = rows[rows["noise_hidden_cells"].notna()]
    sums = keyed.groupby(["engine", "model", "precision"])[list(_COUNTS)].sum()
    reasons = {}
    for key, s in sums.iterrows():
        parts = [over_rule(k, s[f"noise_{k}_cells"], s[f"noise_{k}_beyond"], rule) for _, k in CELL_KINDS]
        if any(parts):
            reasons[key] = "; ".join(p for p in parts if p)
    for j, k in enumerate(zip(rows["engine"], rows["model"], rows["precision"])):
        if pd.notna(rows["noise_hidden_cells"].iloc[j]):
            why[j] = reasons.get(k)
    return why


def over_rule(kind: str, cells: float, beyond: float, rule: Rule, unit: str = "cells") -> str | None:
    """Why `beyond` of `cells` cells of one kind (CELL_KINDS' stem) are over the noise model by the rule, or None."""
    if cells >= rule.min_cells and beyond > rule.fraction * cells:
        return (f"{_KIND_WORDS[kind]} beyond {rule.margin_of(kind):g}x the noise model at {int(beyond)} of "
                f"{int(cells)} {unit} ({beyond / cells:.0%} > {rule.fraction:.0%})")
    return None


def router_credit(models: Mapping[tuple[str, str, str], NoiseModel], goldens: Mapping[tuple[str, str], Golden],
                  rows, rule: Rule) -> np.ndarray:
    """Per row with router evidence (routing.py) and a noise model: the golden router margin up to which a
    flip of that decision is a correct engine's rounding, twice `margin` times the noise model's movement
    of that margin (inf where a schedule flips it too); NaN elsewhere."""
    out = np.full(len(rows), np.nan)
    pos = rows["router_position"].to_numpy(float)
    for (m, p, c), nm in models.items():
        sel = np.flatnonzero((rows["model"] == m).to_numpy() & (rows["precision"] == p).to_numpy()
                             & (rows["precision_class"] == c).to_numpy() & np.isfinite(pos))
        if not sel.size:
            continue
        layer_index = {int(layer): j for j, layer in enumerate(goldens[(m, p)].moe_layers)}
        li = np.array([layer_index.get(int(x), -1) for x in rows["router_layer"].to_numpy(float)[sel]])
        ok = li >= 0
        sel, li = sel[ok], li[ok]
        pr, ps = rows["prompt"].to_numpy(int)[sel], pos[sel].astype(int)
        inside = ps < nm.env_router.shape[1]
        out[sel[inside]] = nm.router_tie_bound(rule)[pr[inside], ps[inside], li[inside]]
    return out


NOISE_TABLE_COLUMNS = ["engine", "model", "precision", "precision_class",
                       *(c.removeprefix("noise_") for c in _COUNTS), "held_out_worst", "verdict"]


def noise_table(rows, calibration, rule: Rule) -> pd.DataFrame:
    """One row per reduced-precision engine and bundle judged against a noise model: its cells and how many
    are beyond (every mode pooled), the worst fraction a held-out correct schedule shows on the same noise
    model (`calibration`, NoiseModel.calibration), and the verdict: `over the noise model: ...`, `within`, or
    `too few cells` where no kind has `rule.min_cells` (the engine diverged or flipped an expert at once)."""
    if "noise_hidden_cells" not in rows or not rows["noise_hidden_cells"].notna().any():
        return pd.DataFrame(columns=NOISE_TABLE_COLUMNS)
    keyed = rows[rows["noise_hidden_cells"].notna()]
    keys = ["engine", "model", "precision", "precision_class"]
    t = keyed.groupby(keys, sort=True)[list(_COUNTS)].sum().reset_index()
    t.columns = keys + [c.removeprefix("noise_") for c in _COUNTS]
    worst = (calibration.assign(worst=calibration[["hidden_beyond", "logit_beyond", "kl_beyond"]].max(axis=1))
             .groupby(["model", "precision", "precision_class"])["worst"].max()) if len(calibration) else None
    t["held_out_worst"] = [np.nan if worst is None else worst.get((m, p, c), np.nan)
                           for m, p, c in zip(t["model"], t["precision"], t["precision_class"])]
    why = keyed.groupby(["engine", "model", "precision"])["noise_over"].first()
    few = (t[[f"{k}_cells" for _, k in CELL_KINDS]] < rule.min_cells).all(axis=1)
    t["verdict"] = [("over the noise model: " + why[(e, m, p)]) if pd.notna(why.get((e, m, p))) else
                    f"too few cells (fewer than {rule.min_cells} of each kind): not judged" if f else "within"
                    for e, m, p, f in zip(t["engine"], t["model"], t["precision"], few)]
    return t[NOISE_TABLE_COLUMNS]
