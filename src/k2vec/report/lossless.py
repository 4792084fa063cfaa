"""DDTree is lossless: an engine's DDTree tokens must be its own greedy tokens.

Against the golden a tree bug shows at float32 at once. At a reduced precision it hides: the engine's tokens
leave the golden's wherever its rounding flips a close call, and a DDTree row's divergence from the golden
gets the same tie credit as a greedy row's. The engine's own greedy run does not move with the golden: both of
its runs decode one model with one arithmetic, so they agree up to the order of the engine's sums (a tree is
verified in one batch, a greedy step in another). Where a DDTree row first leaves its engine's greedy tokens
(same model, weights and prompt), the greedy run's own logits at that step say how far its choice led the
DDTree token: a lead beyond twice the tie credit (both logits may move by it) is a bug of the tree, not of
rounding. The tie credit is the noise model's (margin x the largest logit error a correct engine of the
precision shows at that step, or on that prompt once the row has left the golden's tokens), else the
precision's logit budget; never the engine's own errors.

A DDTree result records no routing. Where a correct engine of the row's precision may flip an expert choice (a
golden router margin within twice `margin` times the noise model's movement of it, report/noise.py) at a position
fed up to a step, its two runs may route apart there and part by far more than rounding: from that step on
(flippable_steps) neither the lossless check nor the golden comparison can tell a tree bug from such a flip, and
the row's divergence there is a router-near-tie with that decision as its evidence.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

LOSSLESS_COLUMNS = ("own_greedy_step", "own_greedy_gap", "lossless_credit", "lossless")


def _tokens(data: Mapping[str, Any] | None, n: int) -> np.ndarray:
    out = np.full(n, -1, np.int64)
    toks = np.asarray((data or {}).get("tokens") or [], np.int64)[:n]
    out[: toks.size] = toks
    return out


def lossless_columns(base: pd.DataFrame, data: Sequence[Mapping[str, Any] | None], credit: np.ndarray,
                     n_steps: int, flippable: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per row of `base` (the report's rows before classification, `data` their prompt result objects): for
    a DDTree row whose engine also ran greedy on the same model, precision and prompt, the first step where
    their tokens differ (own_greedy_step), how far the greedy run's logits there put its token ahead of the
    DDTree token (own_greedy_gap; where the DDTree token is not in the greedy top-k, the lead over the last of
    them, a lower bound), the tie credit there (`credit`, [R, N]: tie_credit) and, where the gap is beyond twice it
    before the row's first `flippable` step (flippable_steps; none: every step), why the row is not lossless
    (lossless); NaN / None elsewhere."""
    R = len(base)
    out: dict[str, np.ndarray] = {c: np.full(R, np.nan) for c in LOSSLESS_COLUMNS[:3]}
    out["lossless"] = np.full(R, None, object)
    ok = (base["status"] == "ok").to_numpy() & np.array([d is not None for d in data], bool)
    kind = base["kind"].to_numpy()
    key = ["engine", "model", "precision", "prompt"]
    greedy = base[ok & (kind == "greedy")]
    if not len(greedy):
        return out
    at = pd.Series(greedy.index.to_numpy(), index=pd.MultiIndex.from_frame(greedy[key]))
    at = at[~at.index.duplicated()]
    tree = base[ok & (kind == "ddtree")]
    g_i = at.reindex(pd.MultiIndex.from_frame(tree[key])).to_numpy(float)
    has = np.isfinite(g_i)
    rows, g_i = tree.index.to_numpy()[has], g_i[has].astype(int)
    if not rows.size:
        return out
    d_tok = np.stack([_tokens(data[i], n_steps) for i in rows])                     # [r, N]
    g_tok = np.stack([_tokens(data[i], n_steps) for i in g_i])
    differs = (d_tok != g_tok) & (d_tok >= 0) & (g_tok >= 0)
    first = np.where(differs.any(1), differs.argmax(1), -1)
    # the greedy run's top-k must reach that step (a result the runner refused may not: no verdict then)
    reach = np.array([f >= 0 and f < min(len(data[g].get("topk_ids") or ()), len(data[g].get("topk_logits") or ()))
                      for f, g in zip(first, g_i)], bool)
    part = np.flatnonzero(reach)
    if not part.size:
        return out
    step = first[part]
    # the greedy run's top-k at that step: its own token's logit against the DDTree token's
    ids = [np.asarray(data[g_i[j]]["topk_ids"][s], np.int64) for j, s in zip(part, step)]
    vals = [np.asarray(data[g_i[j]]["topk_logits"][s], float) for j, s in zip(part, step)]
    k = max(v.size for v in vals)
    ids_m = np.stack([np.pad(a, (0, k - a.size), constant_values=-1) for a in ids])
    vals_m = np.stack([np.pad(a, (0, k - a.size), constant_values=np.nan) for a in vals])
    own = g_tok[part, step]
    mine = d_tok[part, step]
    own_val = np.nanmax(np.where(ids_m == own[:, None], vals_m, np.nan), axis=1, initial=-np.inf)
    own_val = np.where(np.isfinite(own_val), own_val, np.nanmax(vals_m, axis=1))
    found = ids_m == mine[:, None]
    tree_val = np.where(found.any(1), np.nanmax(np.where(found, vals_m, -np.inf), axis=1), np.nanmin(vals_m, axis=1))
    gap = own_val - tree_val
    r = rows[part]
    cr = credit[r, step]
    out["own_greedy_step"][r] = step
    out["own_greedy_gap"][r] = gap
    out["lossless_credit"][r] = cr
    limit = np.full(R, np.inf) if flippable is None else np.nan_to_num(flippable, nan=np.inf)
    broken = np.flatnonzero((gap > 2 * cr) & (step < limit[r]))   # NaN credit: not judged
    lower = ~found.any(1)
    out["lossless"][r[broken]] = [
        f"its DDTree tokens leave its own greedy run's at step {int(step[j])} (greedy token {int(own[j])}, "
        f"DDTree token {int(mine[j])}), where the greedy logits lead by {'over ' if lower[j] else ''}"
        f"{gap[j]:.3g} > 2 x tie credit {cr[j]:.3g}: a tree bug, not rounding" for j in broken]
    return out


def tie_credit(base: pd.DataFrame, noise_models: Mapping[tuple[str, str, str], Any], budgets: Mapping[str, Mapping],
               margin: float, n_steps: int) -> np.ndarray:
    """[R, N]: per row and step, how far a correct engine of its precision may move one logit there: `margin` x
    the noise model's logit envelope at that step while the row still follows the golden's tokens (up to its
    first divergence from them, where the envelope was measured) and the step routes as the golden; elsewhere
    `margin` x its largest such envelope on the prompt; without a noise model, the precision's logit_abs
    budget; NaN where neither exists."""
    limit = {c: (np.nan if b.get("logit_abs") is None else float(b["logit_abs"])) for c, b in budgets.items()}
    out = np.repeat(base["precision_class"].map(limit).to_numpy(float)[:, None], n_steps, axis=1)
    prompt = base["prompt"].to_numpy()
    first = base["first_step"].to_numpy(float) if "first_step" in base else np.full(len(base), np.nan)
    for (m, p, c), nm in noise_models.items():
        rows = np.flatnonzero(((base["model"] == m) & (base["precision"] == p) & (base["precision_class"] == c))
                              .to_numpy())
        if not rows.size:
            continue
        pr = prompt[rows].astype(int)
        env, judged = nm.env_logit[pr][:, :n_steps], nm.judged[pr][:, :n_steps]              # [r, N]
        widest = np.where(judged.any(1), np.where(judged, env, -np.inf).max(1), env.max(1))  # [r]
        on_golden = np.arange(env.shape[1])[None, :] <= np.nan_to_num(first[rows], nan=np.inf)[:, None]
        out[rows, : env.shape[1]] = margin * np.where(on_golden & judged, env, widest[:, None])
    return out


def flippable_steps(base: pd.DataFrame, noise_models: Mapping[tuple[str, str, str], Any],
                    moe_layers: Mapping[tuple[str, str], np.ndarray], rule: Any) -> dict[str, np.ndarray]:
    """Per DDTree row with a noise model: the first step whose fed positions include a golden router decision
    that a correct engine of its precision may flip (its margin within NoiseModel.router_tie_bound),
    and that decision (router margin, layer, position); step inf where the prompt has none, NaN for other rows."""
    R = len(base)
    out = {k: np.full(R, np.nan) for k in ("step", "router_margin", "router_layer", "router_position")}
    prompt = base["prompt"].to_numpy()
    tree = (base["kind"] == "ddtree").to_numpy()
    for (m, p, c), nm in noise_models.items():
        rows = np.flatnonzero(tree & ((base["model"] == m) & (base["precision"] == p)
                                      & (base["precision_class"] == c)).to_numpy())
        if not rows.size or not nm.env_router.shape[-1]:
            continue
        g_margin = nm.golden_router_margins                                             # [P, positions, M]
        with np.errstate(invalid="ignore"):
            flip = np.isfinite(g_margin) & (g_margin <= nm.router_tie_bound(rule))
        any_pos = flip.any(-1)                                                          # [P, positions]
        has = any_pos.any(-1)
        pos = np.where(has, any_pos.argmax(-1), np.iinfo(np.int64).max)               # first such position
        fed = nm.fed                                                                    # [P, N]
        reach = fed >= pos[:, None]
        step = np.where(has & reach.any(-1), reach.argmax(-1), np.inf)
        pi = np.arange(len(pos))
        at = np.where(has, pos, 0)
        layer_margins = np.where(flip[pi, at], g_margin[pi, at], np.inf)               # [P, M]
        li = layer_margins.argmin(-1)
        pr = prompt[rows].astype(int)
        out["step"][rows] = step[pr]
        ok = rows[np.isfinite(step[pr])]
        po = prompt[ok].astype(int)
        out["router_margin"][ok] = layer_margins[po, li[po]]
        out["router_layer"][ok] = np.asarray(moe_layers[(m, p)])[li[po]]
        out["router_position"][ok] = pos[po]
    return out
