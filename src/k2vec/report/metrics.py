"""Divergence metrics: engine results (and the int4 golden) against the golden data.

One row per run x drafter accuracy x prompt. Everything per step is computed on arrays stacked over
all rows that share a golden (numpy, one [rows, steps, k] block per golden), so the cost per row is
the JSON load plus a few array conversions; only rows whose DDTree trace differs from the golden get
a per-round Python walk (to locate the first difference).

Conventions (docs/golden-format.md): step j produces generated token j and feeds the token at
position P-1+j. Up to and including the first divergent step k both sides fed the same tokens, so
logits, fingerprints and router choices are compared on steps 0..k (all steps for an exact prompt);
after k the inputs differ and the comparison would mean nothing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import warnings
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..digests import IntegrityError
from ..engines.runner import parse_mode
from ..gpus import short_uuid
from ..kdtr import KdtrError, open_bundle
from .integrity import CHANGED, RunChecks, verify_golden

# changed: the result or its inputs changed after the run (report/integrity.py); the run is not judged
CLASSES = ("exact", "near-tie", "router-near-tie", "real", "failed", "changed")
SEVERITY = {c: i for i, c in enumerate(CLASSES)}  # higher = worse
REL_EPS = 2.22e-16  # Polygraphy's guard for a zero reference value

# Columns of divergence.csv, in order (rows DataFrame).
ROW_COLUMNS = [
    "run", "engine", "model", "precision", "mode", "budget", "accuracy", "prompt", "status", "class",
    "first_step", "matched_steps", "golden_token", "engine_token", "golden_rank_in_engine",
    "engine_rank_in_golden", "margin", "router_margin", "router_layer", "router_position",
    "logit_steps", "topk_overlap", "logit_abs_max", "logit_abs_mean", "logit_abs_p99", "logit_rel_max",
    "logit_rel_mean", "logit_rel_p99", "logit_nmse", "kl_mean", "kl_max",
    "first_bad_step", "first_bad_layer", "first_bad_rel_err", "fingerprint_rel_max",
    "router_diff_step", "router_diff_layer",
    "tree_match", "first_tree_diff_round", "first_tree_diff_node", "tree_diff_what",
    "accept_mean_engine", "accept_mean_golden", "tokens_per_s", "decode_tokens_per_s", "wall_s",
    "device", "gpu", "gpu_uuid", "reason", "result",
]
_INT_COLUMNS = [
    "budget", "first_step", "matched_steps", "golden_token", "engine_token", "golden_rank_in_engine",
    "engine_rank_in_golden", "router_layer", "router_position", "logit_steps", "first_bad_step",
    "first_bad_layer", "router_diff_step", "router_diff_layer", "first_tree_diff_round",
    "first_tree_diff_node",
]


class ReportError(Exception):
    """Inputs the report cannot be built from (a missing or mismatched golden, a bad run entry)."""


# --------------------------------------------------------------------------------------------- golden


class Golden:
    """The golden tensors the report needs, stacked over prompts; fingerprints stay mmapped views."""

    def __init__(self, model: str, precision: str, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise ReportError(f"golden for model {model!r} precision {precision!r} not found: {path}")
        self.model, self.precision, self.path = model, precision, path
        try:   # nothing is judged against a golden that is not exactly what the golden stage wrote
            self.sha256 = verify_golden(model, precision, path)
        except IntegrityError as err:
            raise ReportError(str(err)) from None
        try:
            self._bundle = open_bundle(path)
        except KdtrError as err:
            raise ReportError(f"golden for model {model!r} precision {precision!r} is not readable: {err}") from None
        self._traces: dict[tuple[int, int, int], dict[str, Any]] = {}
        try:
            self._load()
        except BaseException:
            self._bundle.close()
            raise

    def _load(self) -> None:
        b, path, model, precision = self._bundle, self.path, self.model, self.precision
        md = b.metadata
        if md.get("kind") != "k2vec-golden":
            raise ReportError(f"{path} is not a golden file (metadata kind {md.get('kind')!r})")
        if (md.get("model"), md.get("precision")) != (model, precision):
            raise ReportError(f"{path} holds the golden of model {md.get('model')!r} precision "
                              f"{md.get('precision')!r}, but was given for {model!r} {precision!r}")
        self.metadata = md
        self.n_prompts, self.N, self.K = int(md["prompts"]), int(md["max_new_tokens"]), int(md["top_k"])
        self.moe_layers = np.asarray(md.get("moe_layers", []), np.int64)
        dd = md.get("ddtree") or {}
        self.accuracies = [float(a) for a in dd.get("accuracies", [])]
        self.budgets = [int(x) for x in dd.get("budgets", [])]
        P, N = self.n_prompts, self.N
        self.prompts = [np.asarray(b[f"prompt.p{i}.tokens"], np.int64) for i in range(P)]
        self.tokens = np.stack([b[f"golden.p{i}.tokens"] for i in range(P)]).astype(np.int64)        # [P, N]
        self.topk_ids = np.stack([b[f"golden.p{i}.topk_ids"] for i in range(P)]).astype(np.int64)    # [P, N, K]
        self.topk_logits = np.stack([b[f"golden.p{i}.topk_logits"] for i in range(P)]).astype(np.float64)
        self.margins = np.stack([b[f"golden.p{i}.margins"] for i in range(P)]).astype(np.float64)     # [P, N]
        self.fingerprints = [b[f"golden.p{i}.fingerprints"] for i in range(P)]                         # [N, L, H]
        # Router choices of the token fed at each step (position P_i-1+j), as sorted expert sets, and
        # the smallest routing margin over every MoE layer and every position fed so far.
        self.router_sets, self.router_min = [], np.full((P, N), np.inf)
        self.router_layer = np.full((P, N), -1, np.int64)
        self.router_pos = np.full((P, N), -1, np.int64)
        for i in range(P):
            ids, rm = b[f"golden.p{i}.router_ids"], b[f"golden.p{i}.router_margins"]
            pos = len(self.prompts[i]) - 1 + np.arange(N)
            self.router_sets.append(np.sort(ids[:, pos, :], axis=-1).transpose(1, 0, 2).astype(np.int64))
            if rm.size == 0:
                continue
            layer_min, layer_arg = rm.min(axis=0), rm.argmin(axis=0)          # over layers, per position
            run_min = np.minimum.accumulate(layer_min)
            # position of the running minimum (earliest on ties): last index where a new minimum appeared
            new = np.r_[True, layer_min[1:] < run_min[:-1]]
            run_arg = np.maximum.accumulate(np.where(new, np.arange(layer_min.size), 0))
            self.router_min[i] = run_min[pos]
            self.router_pos[i] = run_arg[pos]
            self.router_layer[i] = self.moe_layers[layer_arg[run_arg[pos]]]

    def has_trace(self, budget: int, a_index: int) -> bool:
        return f"ddtree.b{budget}.a{a_index}.p0.tokens" in self._bundle

    def trace(self, budget: int, a_index: int, prompt: int) -> dict[str, Any]:
        """The golden DDTree trace as arrays, plus `rounds`: the same rounds as the engine result's
        JSON objects (so an identical engine trace is found with one C-level `==`)."""
        key = (budget, a_index, prompt)
        if key not in self._traces:
            pre = f"ddtree.b{budget}.a{a_index}.p{prompt}."
            tr: dict[str, Any] = {k: np.asarray(self._bundle[pre + k], np.int64) for k in (
                "tokens", "round_start", "round_bonus", "node_offsets", "node_tokens", "node_parents",
                "node_depths", "accepted_offsets", "accepted")}
            no, ao = tr["node_offsets"], tr["accepted_offsets"]
            tr["rounds"] = [{"start": int(tr["round_start"][r]), "tokens": tr["node_tokens"][no[r]:no[r + 1]].tolist(),
                             "parents": tr["node_parents"][no[r]:no[r + 1]].tolist(),
                             "depths": tr["node_depths"][no[r]:no[r + 1]].tolist(),
                             "accepted": tr["accepted"][ao[r]:ao[r + 1]].tolist(), "bonus": int(tr["round_bonus"][r])}
                            for r in range(len(no) - 1)]
            tr["accept_lengths"] = np.diff(ao)
            tr["accept_mean"] = float(tr["accept_lengths"].mean()) if len(ao) > 1 else np.nan
            self._traces[key] = tr
        return self._traces[key]

    def close(self) -> None:
        self._bundle.close()


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
    format_effect: pd.DataFrame  # fp32 vs int4 golden, one row per model x prompt
    format_steps: pd.DataFrame  # fp32 vs int4 golden per step: KL, logit error, top-k overlap
    format_models: pd.DataFrame  # fp32 vs int4 golden per model: same-top-1 rate etc.
    thresholds: dict[str, float] = field(default_factory=dict)

    @property
    def has_real_divergence_or_failure(self) -> bool:
        return bool(self.rows["class"].isin(["real", "failed", CHANGED]).any())


def _load_result(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """The result JSON, or (None, reason) when it cannot be read: the report shows it as a failed run
    instead of stopping (the runner always writes one, but a report over old files may meet anything)."""
    try:
        with open(path) as fh:
            res = json.load(fh)
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


def _run_items(r_i: int, spec: Mapping[str, Any], g: Golden, checks: RunChecks) -> tuple[list[_Item], dict[str, Any]]:
    """The rows of one run entry and its run-level facts (status, throughput)."""
    kind, budget = parse_mode(spec["mode"])
    res, reason = _load_result(spec["result"])
    status = "failed" if res is None else str(res.get("status", "ok"))
    if res is not None and status != "ok":
        reason = str(res.get("reason") or f"status {status!r}")
        status = "failed"
    changed = checks.problem(spec, res)
    if changed:
        status, reason = CHANGED, changed
    base = {"run": r_i, "engine": spec["engine"], "model": spec["model"], "precision": spec["precision"],
            "mode": spec["mode"], "budget": budget if kind == "ddtree" else None,
            "result": str(spec["result"]), "device": (res or {}).get("device")}
    base["gpu"], base["gpu_uuid"] = gpu_identity(res)
    single = kind in ("greedy", "score")   # one run, drafter null
    accs: list[float | None] = [None] if single else list(g.accuracies)
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
            if single and acc is not None:
                failed(f"greedy result has a drafter run (accuracy {acc})", [acc])
            elif kind == "ddtree" and acc not in g.accuracies:
                failed(f"drafter accuracy {acc} is not in the golden's {g.accuracies}", [acc])
            elif len(prompts) != g.n_prompts:
                failed(f"{len(prompts)} prompts in the result, the golden has {g.n_prompts}", [acc])
            else:
                ref = None
                if kind == "ddtree" and g.has_trace(budget, g.accuracies.index(acc)):
                    ref = (budget, g.accuracies.index(acc))
                for p, pd_ in enumerate(prompts):
                    if kind == "score" and pd_.get("router_experts") is not None:
                        # judged per step like greedy: keep the rows of the positions greedy's steps feed
                        pd_ = {**pd_, "router_experts": pd_["router_experts"][len(g.prompts[p]) - 1:]}
                    items.append(_Item({**base, "accuracy": acc, "prompt": p, "status": "ok", "reason": None},
                                       pd_, ref))
        seen = {it.base["accuracy"] for it in items}
        missing = [a for a in accs if a not in seen]
        if missing:   # the runner checks this; a result from elsewhere may still lack a run
            failed("no run in the result" + ("" if single else " for this drafter accuracy"), missing)
    tokens = sum(len(it.data.get("tokens", ())) for it in items if it.data is not None)
    wall = (res or {}).get("wall_s")
    decode = ((res or {}).get("timing") or {}).get("decode_s")
    facts = {
        "tokens_per_s": tokens / wall if wall and tokens else np.nan,
        "decode_tokens_per_s": tokens / decode if decode and tokens else np.nan,
        "wall_s": np.nan if wall is None else float(wall), "stderr_tail": (res or {}).get("stderr_tail"),
    }
    for it in items:
        it.base.update({k: v for k, v in facts.items() if k != "stderr_tail"})
    return items, facts


# ------------------------------------------------------------------------------------ per-golden metrics


def _stack(values: list, shape_tail: tuple[int, ...], n: int, fill, dtype) -> np.ndarray:
    """Rows of possibly ragged nested lists -> one [rows, n, *tail] array (padded with `fill`).
    The common case (every row complete and same-shaped) is a single np.asarray."""
    out = None
    try:
        arr = np.asarray(values, dtype=dtype)
        if arr.ndim == 2 + len(shape_tail) and arr.shape[1:] == (n, *shape_tail):
            out = arr
    except (ValueError, TypeError):
        pass
    if out is None:
        out = np.full((len(values), n, *shape_tail), fill, dtype=dtype)
        for i, v in enumerate(values):
            a = np.asarray(v, dtype=dtype)
            if a.ndim != 1 + len(shape_tail) or a.size == 0:
                continue
            sl = tuple(slice(0, min(s, t)) for s, t in zip(a.shape, (n, *shape_tail)))
            out[(i, *sl)] = a[sl]
    return out


def _first_2d(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For [R, A, B] bool: (any, first a, first b) in row-major (a, then b) order."""
    flat = mask.reshape(mask.shape[0], -1)
    anyv = flat.any(axis=1)
    idx = flat.argmax(axis=1)
    return anyv, idx // mask.shape[2], idx % mask.shape[2]


def compare_rows(g: Golden, datas: Sequence[Mapping[str, Any]], prompt: np.ndarray, ref_tokens: np.ndarray,
                 *, near_tie: float, router_near_tie: float, fingerprint_rtol: float
                 ) -> tuple[dict[str, np.ndarray], pd.DataFrame]:
    """Token, logit, fingerprint and router comparison of R engine rows against golden `g`.

    datas[r]: the engine's prompt object ({"tokens", optional "topk_ids", "topk_logits",
    "fingerprints", "router_experts"}); prompt[r]: golden prompt index; ref_tokens: [R, N] the golden
    tokens to match (greedy, or the DDTree trace). Returns column arrays and the per-step frame."""
    R, N, K = len(datas), g.N, g.K
    cols: dict[str, np.ndarray] = {}
    nan = np.full(R, np.nan)

    # missing tokens are -1, never equal to a golden token
    E = _stack([[] if d.get("tokens") is None else d["tokens"] for d in datas], (), N, -1, np.int64)
    diff = E != ref_tokens
    has_div = diff.any(axis=1)
    fs = np.where(has_div, diff.argmax(axis=1), N)          # N = never diverged
    fs_c = np.minimum(fs, N - 1)
    upto = np.arange(N)[None, :] <= fs[:, None]              # the steps both sides fed the same tokens
    rr = np.arange(R)
    g_tok, e_tok = ref_tokens[rr, fs_c], E[rr, fs_c]
    cols["first_step"] = np.where(has_div, fs, np.nan)
    cols["matched_steps"] = fs.astype(float)
    cols["golden_token"] = np.where(has_div, g_tok, np.nan)
    cols["engine_token"] = np.where(has_div & (e_tok >= 0), e_tok, np.nan)
    margin = g.margins[prompt, fs_c]
    rmin, rlay, rpos = (a[prompt, fs_c] for a in (g.router_min, g.router_layer, g.router_pos))
    cols["margin"] = np.where(has_div, margin, np.nan)
    is_near = has_div & (margin < near_tie)
    is_router = has_div & ~is_near & (rmin < router_near_tie)
    cols["router_margin"] = np.where(is_router, rmin, np.nan)
    cols["router_layer"] = np.where(is_router, rlay, np.nan)
    cols["router_position"] = np.where(is_router, rpos, np.nan)
    cols["class"] = np.select([~has_div, is_near, is_router], ["exact", "near-tie", "router-near-tie"], "real")

    # engine token's rank in the golden top-k at the divergent step (None: not in it)
    hit = g.topk_ids[prompt, fs_c] == e_tok[:, None]
    cols["engine_rank_in_golden"] = np.where(has_div & hit.any(1), hit.argmax(1), np.nan)

    # ----- logits on the shared top-k, compared by token id
    for c in ("golden_rank_in_engine", "logit_steps", "topk_overlap", "logit_abs_max", "logit_abs_mean",
              "logit_abs_p99", "logit_rel_max", "logit_rel_mean", "logit_rel_p99", "logit_nmse", "kl_mean", "kl_max"):
        cols[c] = nan.copy()
    steps = pd.DataFrame(columns=["i", "step", "abs_max", "kl", "overlap"])
    t_idx = np.array([r for r, d in enumerate(datas) if d.get("topk_ids") is not None and d.get("topk_logits") is not None],
                     np.int64)
    if t_idx.size:
        ke = max((len(datas[r]["topk_ids"][0]) for r in t_idx if len(datas[r]["topk_ids"])), default=1)
        Eids = _stack([datas[r]["topk_ids"] for r in t_idx], (ke,), N, -1, np.int64)
        Elog = _stack([datas[r]["topk_logits"] for r in t_idx], (ke,), N, np.nan, np.float64)
        Gids, Glog = g.topk_ids[prompt[t_idx]], g.topk_logits[prompt[t_idx]]       # [T, N, K]
        match = Gids[..., :, None] == Eids[..., None, :]                            # [T, N, K, ke]
        e_at = np.take_along_axis(Elog, match.argmax(-1), axis=2)                   # engine logit per golden id
        valid = match.any(-1) & upto[t_idx][:, :, None] & np.isfinite(e_at)
        err = np.where(valid, np.abs(e_at - Glog), np.nan)
        rel = err / np.maximum(np.abs(Glog), REL_EPS)
        n_valid = valid.sum(axis=(1, 2))
        some = n_valid > 0
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            flat_err, flat_rel = err.reshape(len(t_idx), -1), rel.reshape(len(t_idx), -1)
            for name, a in (("abs", flat_err), ("rel", flat_rel)):
                cols[f"logit_{name}_max"][t_idx] = np.where(some, np.nanmax(a, axis=1), np.nan)
                cols[f"logit_{name}_mean"][t_idx] = np.where(some, np.nansum(a, axis=1) / np.maximum(n_valid, 1), np.nan)
                cols[f"logit_{name}_p99"][t_idx] = _nan_percentile_rows(a, 99.0)
            # llama.cpp's NMSE: sum (a-b)^2 / sum b^2 over the compared values
            g2 = np.where(valid, Glog, 0.0) ** 2
            cols["logit_nmse"][t_idx] = np.where(some, np.nansum(err ** 2, axis=(1, 2)) / np.maximum(g2.sum((1, 2)), REL_EPS), np.nan)
            # KL(P_golden || Q_engine) of the softmax over the shared ids, per step
            gm, em = np.where(valid, Glog, -np.inf), np.where(valid, e_at, -np.inf)
            lp_g = gm - _logsumexp(gm)
            lp_e = em - _logsumexp(em)
            step_valid = valid.any(-1)                                               # [T, N]
            kl = np.where(valid, np.exp(lp_g) * (lp_g - lp_e), 0.0).sum(-1)
            kl = np.where(step_valid, np.maximum(kl, 0.0), np.nan)
            cols["kl_mean"][t_idx] = np.where(some, np.nanmean(kl, axis=1), np.nan)
            cols["kl_max"][t_idx] = np.where(some, np.nanmax(kl, axis=1), np.nan)
            overlap = np.where(upto[t_idx], match.any(-1).sum(-1) / K, np.nan)
            cols["topk_overlap"][t_idx] = np.nanmean(overlap, axis=1)
            step_abs = np.nanmax(np.where(step_valid[..., None], err, -np.inf), axis=-1)
        cols["logit_steps"][t_idx] = step_valid.sum(1)
        # golden token's rank in the engine's top-k at the divergent step
        fst = fs_c[t_idx]
        ghit = Eids[np.arange(len(t_idx)), fst] == g_tok[t_idx, None]
        cols["golden_rank_in_engine"][t_idx] = np.where(has_div[t_idx] & ghit.any(1), ghit.argmax(1), np.nan)
        ti, sj = np.nonzero(upto[t_idx])
        steps = pd.DataFrame({"i": t_idx[ti], "step": sj, "abs_max": np.where(step_valid[ti, sj], step_abs[ti, sj], np.nan),
                              "kl": kl[ti, sj], "overlap": overlap[ti, sj]})

    # ----- fingerprints: relative L2 error per step and layer, first above the threshold
    for c in ("first_bad_step", "first_bad_layer", "first_bad_rel_err", "fingerprint_rel_max"):
        cols[c] = nan.copy()
    for r, d in enumerate(datas):
        fp = d.get("fingerprints")
        if fp is None:
            continue
        a = np.asarray(fp, np.float32)
        if a.size == 0:
            continue
        gf = g.fingerprints[prompt[r]]
        n = min(len(a), int(fs[r]) + 1, gf.shape[0])
        if a.ndim != 3 or a.shape[1:] != gf.shape[1:]:   # wrong shape: bad from the first layer on
            cols["first_bad_step"][r], cols["first_bad_layer"][r], cols["first_bad_rel_err"][r] = 0, 0, np.inf
            continue
        gref = gf[:n].astype(np.float64)
        rel_l2 = np.linalg.norm(a[:n] - gref, axis=-1) / np.maximum(np.linalg.norm(gref, axis=-1), REL_EPS)  # [n, L]
        rel_l2 = np.where(np.isfinite(rel_l2), rel_l2, np.inf)   # NaN from the engine counts as bad
        cols["fingerprint_rel_max"][r] = rel_l2.max()
        bad = rel_l2 > fingerprint_rtol
        if bad.any():
            s, layer = divmod(int(bad.argmax()), bad.shape[1])
            cols["first_bad_step"][r], cols["first_bad_layer"][r] = s, layer
            cols["first_bad_rel_err"][r] = rel_l2[s, layer]

    # ----- router: first (step, MoE layer) whose expert set differs
    cols["router_diff_step"], cols["router_diff_layer"] = nan.copy(), nan.copy()
    r_idx = np.array([r for r, d in enumerate(datas) if d.get("router_experts") is not None], np.int64)
    if r_idx.size and g.moe_layers.size:
        M, k = g.router_sets[0].shape[1:]
        Er = np.sort(_stack([datas[r]["router_experts"] for r in r_idx], (M, k), N, -1, np.int64), axis=-1)
        Gr = np.stack([g.router_sets[p] for p in prompt[r_idx]])                   # [T, N, M, k]
        given = np.array([len(datas[r]["router_experts"]) for r in r_idx])
        steps_ok = upto[r_idx] & (np.arange(N)[None, :] < given[:, None])
        differ = (Er != Gr).any(-1) & steps_ok[:, :, None]
        anyd, s, m = _first_2d(differ)
        cols["router_diff_step"][r_idx] = np.where(anyd, s, np.nan)
        cols["router_diff_layer"][r_idx] = np.where(anyd, g.moe_layers[m], np.nan)
    return cols, steps


def _nan_percentile_rows(a: np.ndarray, q: float) -> np.ndarray:
    """np.nanpercentile(a, q, axis=1) (linear interpolation) in a few whole-array passes; numpy's
    version loops over rows in Python when there are NaNs."""
    s = np.sort(a, axis=1)                       # NaNs sort last
    n = (~np.isnan(a)).sum(axis=1)
    pos = q / 100.0 * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
    r = np.arange(a.shape[0])
    v = s[r, lo] + (s[r, hi] - s[r, lo]) * (pos - lo)
    return np.where(n > 0, v, np.nan)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


# -------------------------------------------------------------------------------------------- DDTree


def _flat_rounds(rounds: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray | None]:
    def cat(key):
        return np.fromiter(chain.from_iterable(r[key] for r in rounds), np.int64)

    return {
        "sizes": np.fromiter((len(r["tokens"]) for r in rounds), np.int64, len(rounds)),
        "tokens": cat("tokens"), "parents": cat("parents"),
        "depths": cat("depths") if all("depths" in r for r in rounds) else None,
        "acc_sizes": np.fromiter((len(r["accepted"]) for r in rounds), np.int64, len(rounds)),
        "accepted": cat("accepted"),
        "start": np.fromiter((r["start"] for r in rounds), np.int64, len(rounds)),
        "bonus": np.fromiter((r["bonus"] for r in rounds), np.int64, len(rounds)),
    }


def compare_tree(rounds: Sequence[Mapping[str, Any]], tr: Mapping[str, np.ndarray]
                 ) -> tuple[bool, int | None, int | None, str | None, np.ndarray]:
    """(identical, first differing round, node index in it, what differs, engine acceptance lengths).

    The node is the first index within the round whose token, parent or depth differs, or the
    smaller tree size when one tree is a prefix of the other; a round whose nodes agree but whose
    accepted path, bonus or start differ has node None."""
    e = _flat_rounds(rounds)
    g_sizes, g_acc_sizes = np.diff(tr["node_offsets"]), np.diff(tr["accepted_offsets"])
    same = (np.array_equal(e["sizes"], g_sizes) and np.array_equal(e["tokens"], tr["node_tokens"])
            and np.array_equal(e["parents"], tr["node_parents"])
            and (e["depths"] is None or np.array_equal(e["depths"], tr["node_depths"]))
            and np.array_equal(e["acc_sizes"], g_acc_sizes) and np.array_equal(e["accepted"], tr["accepted"])
            and np.array_equal(e["start"], tr["round_start"]) and np.array_equal(e["bonus"], tr["round_bonus"]))
    if same:
        return True, None, None, None, e["acc_sizes"]
    e_off = np.r_[0, np.cumsum(e["sizes"])]
    e_aoff = np.r_[0, np.cumsum(e["acc_sizes"])]
    for r in range(min(len(e["sizes"]), len(g_sizes))):
        es, gs = slice(e_off[r], e_off[r + 1]), slice(tr["node_offsets"][r], tr["node_offsets"][r + 1])
        n = min(e["sizes"][r], g_sizes[r])
        parts = [("token", e["tokens"][es], tr["node_tokens"][gs]), ("parent", e["parents"][es], tr["node_parents"][gs])]
        if e["depths"] is not None:
            parts.append(("depth", e["depths"][es], tr["node_depths"][gs]))
        bad = np.zeros(n, bool)
        for _, a, b in parts:
            bad |= a[:n] != b[:n]
        if bad.any():
            node = int(bad.argmax())
            what = next(f"{name} (engine {a[node]}, golden {b[node]})" for name, a, b in parts if a[node] != b[node])
            return False, r, node, what, e["acc_sizes"]
        if e["sizes"][r] != g_sizes[r]:
            return False, r, int(n), f"size (engine {e['sizes'][r]} nodes, golden {g_sizes[r]})", e["acc_sizes"]
        ea = e["accepted"][e_aoff[r]:e_aoff[r + 1]]
        ga = tr["accepted"][tr["accepted_offsets"][r]:tr["accepted_offsets"][r + 1]]
        if not np.array_equal(ea, ga):
            return False, r, None, f"accepted (engine {ea.tolist()}, golden {ga.tolist()})", e["acc_sizes"]
        if e["bonus"][r] != tr["round_bonus"][r]:
            return False, r, None, f"bonus (engine {e['bonus'][r]}, golden {tr['round_bonus'][r]})", e["acc_sizes"]
        if e["start"][r] != tr["round_start"][r]:
            return False, r, None, f"start (engine {e['start'][r]}, golden {tr['round_start'][r]})", e["acc_sizes"]
    r = min(len(e["sizes"]), len(g_sizes))
    return False, r, None, f"round count (engine {len(e['sizes'])}, golden {len(g_sizes)})", e["acc_sizes"]


# ---------------------------------------------------------------------------------------------- driver


def _check_golden(goldens: Mapping[tuple[str, str], Any], key: tuple[str, str], who: str) -> None:
    if key not in goldens:
        have = ", ".join(f"{m}/{p}" for m, p in sorted(goldens)) or "none"
        raise ReportError(f"no golden for model {key[0]!r} precision {key[1]!r} (needed by {who}); "
                          f"goldens given: {have}")


def _finish_frame(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    for c in columns:
        if c not in df:
            df[c] = np.nan
    df = df[list(columns) + [c for c in df.columns if c not in columns]]
    for c in _INT_COLUMNS:
        if c in df:
            df[c] = pd.array(pd.to_numeric(df[c], errors="coerce").round(), dtype="Int64")
    return df


def compute_metrics(runs: Sequence[Mapping[str, Any]], goldens: Mapping[tuple[str, str], str | Path], *,
                    near_tie: float = 1e-3, router_near_tie: float = 1e-3,
                    fingerprint_rtol: float = 1e-3) -> Metrics:
    """All report data for `runs` ({"engine","model","precision","mode","result"} each) against
    `goldens` ({(model, precision): golden KDTR path})."""
    opened: dict[tuple[str, str], Golden] = {}
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
            key = (spec["model"], spec["precision"])
            _check_golden(goldens, key, f"engine {spec['engine']!r} {spec['mode']} ({spec['result']})")
            needed.add(key)
        models = {m for m, _ in goldens}
        for m in sorted(models):   # the format comparison needs both goldens of a model
            if (m, "fp32") in goldens and (m, "int4") in goldens:
                needed |= {(m, "fp32"), (m, "int4")}
        for key in sorted(needed):
            opened[key] = Golden(key[0], key[1], goldens[key])
        th = {"near_tie": near_tie, "router_near_tie": router_near_tie, "fingerprint_rtol": fingerprint_rtol}
        rows, runs_df, steps, acceptance = _engine_metrics(runs, opened, th, RunChecks({k: g.sha256 for k, g in opened.items()}))
        fe, fe_steps, fe_models = _format_effect(opened, th)
        return Metrics(rows, runs_df, steps, acceptance, fe, fe_steps, fe_models, th)
    finally:
        for g in opened.values():
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


def _engine_metrics(runs, opened: dict[tuple[str, str], Golden], th: dict[str, float], checks: RunChecks):
    with _no_gc():
        return _engine_metrics_inner(runs, opened, th, checks)


def _engine_metrics_inner(runs, opened: dict[tuple[str, str], Golden], th: dict[str, float], checks: RunChecks):
    items: list[_Item] = []
    stderr: dict[int, str | None] = {}
    for r_i, spec in enumerate(runs):
        its, facts = _run_items(r_i, spec, opened[(spec["model"], spec["precision"])], checks)
        items.extend(its)
        stderr[r_i] = facts["stderr_tail"]
    if not items:   # no engine runs: the report still shows the format effect
        empty = _finish_frame(pd.DataFrame(columns=ROW_COLUMNS), ROW_COLUMNS)
        return empty, pd.DataFrame(), pd.DataFrame(columns=["row", "step", "abs_max", "kl", "overlap"]), \
            _acceptance_hist([])
    base = pd.DataFrame([it.base for it in items])
    base["class"] = _not_judged_class(base["status"], "")
    extra: dict[str, np.ndarray] = {}
    step_frames, hist_rows = [], []

    def put(idx: np.ndarray, name: str, values) -> None:
        if name not in extra:
            extra[name] = np.full(len(items), np.nan, dtype=object if name in ("class", "tree_diff_what", "tree_match") else float)
        extra[name][idx] = values

    ok = np.array([it.data is not None for it in items], bool)
    for key, grp in base[ok].groupby(["model", "precision"], sort=False):
        idx = grp.index.to_numpy()
        g = opened[key]
        prompt = base["prompt"].to_numpy()[idx].astype(np.int64)
        ref = g.tokens[prompt].copy()
        # DDTree rows must match the golden DDTree trace's tokens (equal to greedy unless the golden
        # itself recorded a near-tie flip, metadata summary.ddtree_mismatches)
        traces: dict[int, dict[str, np.ndarray]] = {}
        for j, i in enumerate(idx):
            if items[i].rounds_ref is not None:
                traces[j] = g.trace(*items[i].rounds_ref, int(prompt[j]))
                ref[j] = traces[j]["tokens"][:g.N]
        cols, steps = compare_rows(g, [items[i].data for i in idx], prompt, ref, **th)
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
            hist_rows.append((b["model"], b["precision"], b["mode"], b["accuracy"], "golden", b["run"], b["prompt"], g_len))
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
            hist_rows.append((b["model"], b["precision"], b["mode"], b["accuracy"], b["engine"], b["run"], b["prompt"], e_len))
        if g_i:
            put(np.array(g_i), "accept_mean_golden", g_means)
        if tree_i:
            ti = np.array(tree_i)
            for name, values in zip(("tree_match", "first_tree_diff_round", "first_tree_diff_node", "tree_diff_what",
                                     "accept_mean_engine"), zip(*tree_vals)):
                put(ti, name, list(values))
    for name, values in extra.items():
        if name == "class":
            base["class"] = _not_judged_class(base["status"], values)
        elif name == "tree_match":
            base[name] = pd.array([None if (isinstance(v, float) and np.isnan(v)) else bool(v) for v in values],
                                  dtype="boolean")
        else:
            base[name] = values
    rows = _finish_frame(base, ROW_COLUMNS)
    steps = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame(
        columns=["i", "step", "abs_max", "kl", "overlap"])
    steps = steps.rename(columns={"i": "row"})
    return rows, _run_summary(rows, stderr), steps, _acceptance_hist(hist_rows)


def _not_judged_class(status: pd.Series, judged) -> np.ndarray:
    """`judged` where the run is ok, else its status as the class (failed, changed)."""
    return np.where(status == "ok", judged, np.where(status == CHANGED, CHANGED, "failed"))


def _acceptance_hist(hist_rows) -> pd.DataFrame:
    """Long histogram data: one row per (model, precision, mode, accuracy, source, length) with the
    count of rounds. The golden is counted once per prompt (not once per engine run)."""
    cols = ["model", "precision", "mode", "accuracy", "source", "length", "count"]
    if not hist_rows:
        return pd.DataFrame(columns=cols)
    lens = [h[7] for h in hist_rows]
    n = np.array([len(x) for x in lens])
    df = pd.DataFrame({
        "model": np.repeat([h[0] for h in hist_rows], n), "precision": np.repeat([h[1] for h in hist_rows], n),
        "mode": np.repeat([h[2] for h in hist_rows], n), "accuracy": np.repeat([h[3] for h in hist_rows], n),
        "source": np.repeat([h[4] for h in hist_rows], n), "run": np.repeat([h[5] for h in hist_rows], n),
        "prompt": np.repeat([h[6] for h in hist_rows], n), "length": np.concatenate(lens) if lens else [],
    })
    gold = df["source"] == "golden"
    df = pd.concat([df[~gold], _dedupe_golden(df[gold])])
    return (df.groupby(["model", "precision", "mode", "accuracy", "source", "length"], dropna=False)
              .size().rename("count").reset_index())


def _dedupe_golden(g: pd.DataFrame) -> pd.DataFrame:
    """Golden rounds appear once per engine run that used the trace; keep one run's per prompt."""
    if g.empty:
        return g
    keys = ["model", "precision", "mode", "accuracy", "prompt"]
    return g[g["run"] == g.groupby(keys, dropna=False)["run"].transform("min")]


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
        status=("status", "first"), prompts=("prompt", "size"), worst=("sev", "max"),
        first_step=("first_step", "min"), logit_abs_max=("logit_abs_max", "max"), kl_max=("kl_max", "max"),
        fb=("fb", "min"), router_diff_step=("router_diff_step", "min"),
        trees=("tree_match", "count"), trees_differ=("tree_bad", "sum"),
        accept_mean_engine=("accept_mean_engine", "mean"), accept_mean_golden=("accept_mean_golden", "mean"),
        tokens_per_s=("tokens_per_s", "first"), decode_tokens_per_s=("decode_tokens_per_s", "first"),
        wall_s=("wall_s", "first"), device=("device", "first"), gpu=("gpu", "first"), reason=("reason", "first"), result=("result", "first"),
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


# ------------------------------------------------------------------------------ fp32 vs int4 golden


def _format_effect(opened: dict[tuple[str, str], Golden], th: dict[str, float]):
    """How far quantization moves the model: the int4 golden compared to the fp32 golden as if it
    were an engine. Both decode their own tokens, so steps are compared up to the first divergence."""
    frames, step_frames, model_rows = [], [], []
    for model in sorted({m for m, _ in opened}):
        if (model, "fp32") not in opened or (model, "int4") not in opened:
            continue
        fp, q = opened[(model, "fp32")], opened[(model, "int4")]
        if fp.n_prompts != q.n_prompts or fp.N != q.N or any(
                not np.array_equal(a, b) for a, b in zip(fp.prompts, q.prompts)):
            raise ReportError(f"the fp32 and int4 goldens of model {model!r} were made from different prompts "
                              f"or decoding settings ({fp.path}, {q.path})")
        datas = [{"tokens": q.tokens[i], "topk_ids": q.topk_ids[i], "topk_logits": q.topk_logits[i],
                  "fingerprints": q.fingerprints[i], "router_experts": q.router_sets[i]} for i in range(q.n_prompts)]
        prompt = np.arange(q.n_prompts)
        cols, steps = compare_rows(fp, datas, prompt, fp.tokens, **th)
        df = pd.DataFrame({"model": model, "prompt": prompt, **cols})
        # steps compared = matched + the divergent one; same top-1 on all but the divergent one
        compared = np.minimum(df["matched_steps"] + 1, fp.N)
        df["same_top1"] = df["matched_steps"] / compared
        df["int4_margin"] = np.where(df["first_step"].notna(), q.margins[prompt, np.minimum(df["matched_steps"].astype(int), fp.N - 1)], np.nan)
        frames.append(df)
        steps = steps.assign(model=model, prompt=prompt[steps["i"].to_numpy()]).drop(columns="i")
        step_frames.append(steps)
        # pooled over prompts: the fraction of compared steps with the same top-1 (the censored
        # geometric estimate of the per-step agreement probability)
        model_rows.append({"model": model, "prompts": len(df), "max_new_tokens": fp.N,
                           "diverged": int(df["first_step"].notna().sum()),
                           "same_top1_rate": df["matched_steps"].sum() / compared.sum(),
                           "mean_first_step": df["first_step"].mean(), "kl_mean": steps["kl"].mean(),
                           "kl_max": steps["kl"].max(), "topk_overlap": steps["overlap"].mean(),
                           "logit_abs_max": df["logit_abs_max"].max(),
                           "fp32": str(fp.path), "int4": str(q.path)})
    fe_cols = ["model", "prompt", "class", "first_step", "matched_steps", "golden_token", "engine_token",
               "golden_rank_in_engine", "engine_rank_in_golden", "margin", "int4_margin", "same_top1",
               "kl_mean", "kl_max", "topk_overlap", "logit_abs_max", "logit_rel_max", "logit_nmse",
               "first_bad_step", "first_bad_layer", "first_bad_rel_err", "router_diff_step", "router_diff_layer"]
    fe = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=fe_cols)
    fe = _finish_frame(fe, fe_cols)[fe_cols].rename(columns={
        "golden_token": "fp32_token", "engine_token": "int4_token", "golden_rank_in_engine": "fp32_rank_in_int4",
        "engine_rank_in_golden": "int4_rank_in_fp32", "margin": "fp32_margin"})
    fs = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame(
        columns=["model", "prompt", "step", "abs_max", "kl", "overlap"])
    return fe, fs[["model", "prompt", "step", "abs_max", "kl", "overlap"]], pd.DataFrame(model_rows)
