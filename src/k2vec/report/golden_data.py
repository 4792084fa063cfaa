"""The golden data the report judges against: verified, opened, stacked over prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from k2vec.digests import IntegrityError
from k2vec.errors import K2VecError
from k2vec.kdtr import KdtrError, open_bundle
from k2vec.model.conventions import variant_key
from k2vec.report.integrity import verify_golden


class ReportError(K2VecError):
    """Inputs the report cannot be built from (a missing or mismatched golden, a bad run entry)."""


class Golden:
    """The golden tensors the report needs, stacked over prompts; fingerprints stay mmapped views.

    `path`: a golden file, or an engine's bundle, which carries the golden's tensors and metadata verbatim
    (stages/bundle.py); read from a bundle, `sha256` is that of the golden it was built from, recorded in
    it, so the checks against it (report/integrity.py, the noise model's) are the same either way.
    `variant`: the file is the golden of that convention variant (k2vec.stages.convention), not the golden."""

    def __init__(self, model: str, precision: str, path: str | Path, variant: str | None = None):
        path = Path(path)
        what = "golden" if variant is None else f"convention variant {variant!r}"
        if not path.exists():
            raise ReportError(f"{what} for model {model!r} precision {precision!r} not found: {path}")
        self.model, self.precision, self.path, self.variant = model, precision, path, variant
        try:   # nothing is judged against a golden that is not exactly what its stage wrote
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
        if md.get("kind") == "k2vec-bundle":
            self.sha256, md = md.get("golden_sha256"), md.get("golden") or {}
        if md.get("kind") != "k2vec-golden":
            raise ReportError(f"{path} is not a golden file nor a bundle holding one "
                              f"(metadata kind {md.get('kind')!r})")
        if (md.get("model"), md.get("precision")) != (model, precision):
            raise ReportError(f"{path} holds the golden of model {md.get('model')!r} precision "
                              f"{md.get('precision')!r}, but was given for {model!r} {precision!r}")
        variant = variant_key((md.get("reference") or {}).get("conventions") or ()) or None
        if variant != self.variant:
            raise ReportError(f"{path} holds the golden of "
                              f"{'convention variant ' + repr(variant) if variant else 'the reference'}"
                              ", but was given as "
                              f"{'convention variant ' + repr(self.variant) if self.variant else 'the golden'}")
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
        # Router choices and margins at every fed position (prompt positions included), padded to the
        # longest prompt: sets sorted (compared as sets), [P, positions, M, k] and [P, positions, M];
        # padding is id -1 / margin inf. Position P_i-1+j is the token fed at step j.
        self.prompt_lengths = np.array([len(t) for t in self.prompts], np.int64)
        n_pos = int(self.prompt_lengths.max()) + N - 1 if P else 0
        M = self.moe_layers.size
        k = int(b["golden.p0.router_ids"].shape[-1]) if P and M else 0
        self.router_ids = np.full((P, n_pos, M, k), -1, np.int64)
        self.router_margins = np.full((P, n_pos, M), np.inf)
        for i in range(P):
            ids, rm = b[f"golden.p{i}.router_ids"], b[f"golden.p{i}.router_margins"]
            if ids.size:
                self.router_ids[i, :ids.shape[1]] = np.sort(ids, axis=-1).transpose(1, 0, 2)
            if rm.size:
                self.router_margins[i, :rm.shape[1]] = rm.T

    def fed_positions(self, prompt: np.ndarray) -> np.ndarray:
        """[R, N]: the position of the token fed at each step, per row's golden prompt."""
        return self.prompt_lengths[prompt][:, None] - 1 + np.arange(self.N)[None, :]

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




def golden_strength(goldens: dict[tuple[str, str], Golden], near_tie: float, router_near_tie: float
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How much each golden exercises, from its tensors: (per golden: near-tie fractions, experts and
    groups routed to per MoE layer; per golden and prompt: prompt length, distinct generated tokens,
    the smallest router margin over the prompt positions, the step-0 logit gap, and `blind` where
    either is under its threshold: every divergence of that row would be excused as a near-tie)."""
    per_golden, per_prompt = [], []
    for (model, precision), g in sorted(goldens.items()):
        md = g.metadata.get("summary", {})
        E, G = md.get("n_routed_experts"), md.get("n_group")
        real = g.router_ids[..., 0] >= 0                                               # [P, pos, M]
        experts = [np.unique(g.router_ids[:, :, m][real[:, :, m]]) for m in range(g.moe_layers.size)]
        finite = np.isfinite(g.router_margins)
        per_golden.append({
            "model": model, "precision": precision, "steps": int(g.margins.size),
            "token_near_tie": float((g.margins < near_tie).mean()),
            "router_near_tie": float((g.router_margins[finite] < router_near_tie).mean()) if finite.any() else 0.0,
            "experts_routed": [int(u.size) for u in experts], "n_routed_experts": E,
            "groups_routed": [int(np.unique(u // (E // G)).size) for u in experts] if E and G else None,
            "n_group": G})
        pos = np.arange(g.router_margins.shape[1])
        at_prompt = np.where(pos[None, :, None] < g.prompt_lengths[:, None, None], g.router_margins, np.inf)
        router = at_prompt.min(axis=(1, 2)) if g.moe_layers.size else np.full(g.n_prompts, np.inf)
        for i in range(g.n_prompts):
            per_prompt.append({
                "model": model, "precision": precision, "prompt": i, "prompt_length": int(g.prompt_lengths[i]),
                "distinct_tokens": int(np.unique(g.tokens[i]).size), "prompt_router_margin": float(router[i]),
                "step0_margin": float(g.margins[i, 0]),
                "blind": bool(router[i] < router_near_tie or g.margins[i, 0] < near_tie)})
    return pd.DataFrame(per_golden), pd.DataFrame(per_prompt)
