"""Golden data: what the numpy reference model produces on exactly the weights an engine sees.

For precision `fp32` those are the fp32 checkpoint's tensors; for `int4`, every quantized weight is
replaced by its dequantized `.qw`/`.sc` value (code x stored scale, in float32) and every other tensor
is the fp32 one. The golden file is a KDTR file (docs/kdtr-format.md) rather than an npz: the same
config gives the same bytes (npz embeds zip timestamps), it is mmapped, checksummed and readable from
C, and the bundle stage copies its tensors verbatim. Tensor names are listed in docs/golden-format.md.
Beside it, `<golden>.sha256` records its hash; the bundle stage and the report check both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from k2vec import __version__
from k2vec.ddtree import RecordedDrafts, record_drafts
from k2vec.digests import write_record
from k2vec.kdtr import write_bundle
from k2vec.model.checkpoint import Checkpoint
from k2vec.model.conventions import variant_settings
from k2vec.model.limits import WEIGHT_CACHE_BYTES
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import HF_LATENT_NORM_EPS, ReferenceModel
from k2vec.reference.speculative import DDTreeJob, ddtree_generate

log = logging.getLogger("k2vec.stages.golden")

DDTREE_TIE = 1e-5     # DDTree must reproduce greedy exactly except after a step with a gap below this
GOLDEN_ALIGNMENT = 64  # many small tensors: page alignment would mostly be padding


class DequantizedWeights(Mapping[str, np.ndarray]):
    """The fp32 checkpoint with every quantized weight replaced by its dequantized INT4 value."""

    def __init__(self, fp32: Checkpoint, int4_dir: str | Path):
        # Imported here: the fp32 side never runs the quantizer (its stages do not declare it,
        # k2vec.pipeline.code_digest).
        from k2vec.model.int4_checkpoint import open_int4

        self.fp32, self.int4 = fp32, open_int4(int4_dir)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.int4.index["tensors"]:
            return self.int4[name].dequantize()
        return self.fp32[name]

    def shape_of(self, name: str) -> list[int]:
        if name in self.int4.index["tensors"]:
            return list(self.int4.index["tensors"][name]["shape"])
        return self.fp32.shape_of(name)

    def block(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0:r1 of `self[name]`; an INT4 weight is dequantized for those rows only."""
        if name in self.int4.index["tensors"]:
            return self.int4[name].dequantize_rows(r0, r1)
        return self.fp32[name][r0:r1]

    def __iter__(self) -> Iterator[str]:
        return iter(self.fp32)

    def __len__(self) -> int:
        return len(self.fp32)


def open_weights(precision: str, fp32_dir: str | Path, int4_dir: str | Path | None = None) -> Mapping[str, np.ndarray]:
    fp32 = Checkpoint(fp32_dir)
    if precision == "fp32":
        return fp32
    if precision == "int4":
        if int4_dir is None:
            raise ValueError("precision int4 needs the int4 directory")
        return DequantizedWeights(fp32, int4_dir)
    raise ValueError(f"unknown precision {precision!r}: expected fp32 or int4")


def reference_model(model_spec: dict[str, Any], weights: Mapping[str, np.ndarray],
                    conventions: Sequence[str] = ()) -> ReferenceModel:
    """The golden's reference model; with `conventions` (k2vec.model.conventions), that variant of it."""
    settings = {"latent_norm_eps": HF_LATENT_NORM_EPS, **variant_settings(conventions, model_spec)}
    return ReferenceModel(model_spec, weights, dtype=np.float64, weight_cache_bytes=WEIGHT_CACHE_BYTES, **settings)


def make_golden(case: dict[str, Any], weights: Mapping[str, np.ndarray], precision: str,
                conventions: Sequence[str] = (), drafts: Mapping[tuple[int, int], RecordedDrafts] | None = None,
                ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """All golden tensors (by name) and the golden metadata for one case and precision. `conventions`: the
    golden of that variant of the reference (k2vec.stages.convention), which decodes DDTree with the
    golden's `drafts` ({(accuracy index, prompt): drafts}, what the bundle gives an engine) instead of
    recording its own."""
    model_spec, decoding = case["model"], case["decoding"]
    if "tokens" not in case["prompts"]:
        raise ValueError("the case's prompts section holds settings only: draw the prompts first "
                         "(k2vec.stages.prompts.draw_prompts, the prompts stage: "
                         "results/prompts/{model}-{precision}.json)")
    prompts = case["prompts"]["tokens"]
    n_new, top_k = decoding["max_new_tokens"], decoding["top_k"]
    dd = decoding["ddtree"]
    model = reference_model(model_spec, weights, conventions)
    tensors: dict[str, np.ndarray] = {}

    greedy = greedy_generate(model, prompts, n_new, top_k=top_k)
    for i, (prompt, g) in enumerate(zip(prompts, greedy)):
        p = f"golden.p{i}."
        tensors[f"prompt.p{i}.tokens"] = np.asarray(prompt, np.int32)
        tensors[p + "tokens"] = g.tokens.astype(np.int32)
        tensors[p + "topk_ids"] = g.topk_ids.astype(np.int32)
        tensors[p + "topk_logits"] = g.topk_logits.astype(np.float64)
        tensors[p + "margins"] = g.margins.astype(np.float64)
        tensors[p + "fingerprints"] = g.hidden.astype(np.float32)
        tensors[p + "router_ids"] = g.router_ids.astype(np.int32)
        tensors[p + "router_margins"] = g.router_margins.astype(np.float64)

    summary = strength(greedy, model_spec, case["prompts"])
    log.info("%s/%s greedy: %d steps, %d near-ties (margin < %g, %.2f%%), min margin %.3g",
             model_spec["name"], precision, summary["steps"], summary["near_tie_steps"],
             summary["near_tie_threshold"], 100 * summary["near_tie_fraction"], summary["min_margin"])

    jobs, keys = [], []
    for a_i, accuracy in enumerate(dd["accuracies"]):
        for i, (prompt, g) in enumerate(zip(prompts, greedy)):
            if drafts is None:
                d = record_drafts(g.tokens, prompt_len=len(prompt), vocab_size=model_spec["vocab_size"],
                                  accuracy=accuracy, prompt_key=i, seed=case["prompts"]["seed"],
                                  block_size=dd["block_size"],
                                  k_stored=min(max(dd["budgets"]), model_spec["vocab_size"]), n_starts=n_new)
            else:
                d = drafts[(a_i, i)]
            tensors[f"drafts.a{a_i}.p{i}.ids"] = d.ids.astype(np.int32)
            tensors[f"drafts.a{a_i}.p{i}.logprobs"] = d.logprobs.astype(np.float32)
            for budget in dd["budgets"]:
                jobs.append(DDTreeJob(np.asarray(prompt), d, budget))
                keys.append((budget, a_i, accuracy, i))
    results = ddtree_generate(model, jobs, n_new)
    lengths: dict[tuple[int, float], list[np.ndarray]] = {}
    mismatches: list[dict[str, Any]] = []
    for (budget, a_i, accuracy, i), res in zip(keys, results):
        tensors.update(_rounds_tensors(f"ddtree.b{budget}.a{a_i}.p{i}.", res))
        lengths.setdefault((budget, accuracy), []).append(res.acceptance_lengths)
        mismatches.extend(_lossless_check(res.tokens, greedy[i], budget, accuracy, i))
    acceptance = {str(b): {str(a): float(np.concatenate(lengths[b, a]).mean()) for a in dd["accuracies"]}
                  for b in dd["budgets"]}
    summary["ddtree_mean_acceptance"] = acceptance
    summary["ddtree_mismatches"] = mismatches
    for budget, row in acceptance.items():
        log.info("%s/%s DDTree budget %4s: mean acceptance length %s", model_spec["name"], precision, budget,
                 "  ".join(f"p={a}: {v:.2f}" for a, v in row.items()))
    if mismatches:
        log.warning("DDTree differs from greedy at %d place(s): %s", len(mismatches), mismatches)

    metadata = {
        "kind": "k2vec-golden",
        "generator": {"package": "k2vec", "version": __version__},
        "model": model_spec["name"],
        "precision": precision,
        "reference": {"dtype": "float64", "latent_norm_eps": model.latent_norm_eps,
                      "argmax_ties": "lower token id",
                      **({"conventions": sorted(conventions)} if conventions else {})},
        "prompts": len(prompts),
        "max_new_tokens": n_new,
        "top_k": top_k,
        "moe_layers": [int(x) for x in greedy[0].moe_layers],
        "fingerprint": {"kind": "full", "dtype": "f32",
                        "rows": "step j: the hidden state after each layer for the token fed at step j "
                                "(the last prompt token, then generated tokens 0..N-2)"},
        "ddtree": {"block_size": dd["block_size"], "budgets": list(dd["budgets"]),
                   "accuracies": list(dd["accuracies"]), "drafter": "oracle-with-noise",
                   "drafter_seed": case["prompts"]["seed"]},
        "summary": summary,
    }
    return tensors, metadata


def strength(greedy, model_spec: dict[str, Any], prompts: dict[str, Any]) -> dict[str, Any]:
    """How much of the model the golden exercises, so that a degenerate golden shows at a glance:
    near-tie fractions (token steps; router decisions at every fed position and MoE layer), distinct
    generated tokens per prompt, experts and expert groups routed to per MoE layer, and per prompt the
    smallest router margin over its prompt positions and its step-0 logit gap (a prompt with either
    under its threshold is blind: every divergence of its row would be excused as a near-tie)."""
    t_thr, r_thr = prompts["near_tie"], prompts["router_near_tie"]
    margins = np.concatenate([g.margins for g in greedy])
    router = np.concatenate([g.router_margins.ravel() for g in greedy])
    E, G = model_spec["n_routed_experts"], model_spec["n_group"]
    per_layer = [np.unique(np.concatenate([g.router_ids[m].ravel() for g in greedy])) for m in
                 range(greedy[0].router_ids.shape[0])]
    prompt_router = [float(g.router_margins[:, :g.prompt.size].min()) if g.router_margins.size else float("inf")
                     for g in greedy]
    prompt_token = [float(g.margins[0]) for g in greedy]
    return {
        "steps": int(margins.size),
        "near_tie_threshold": t_thr,
        "near_tie_steps": int((margins < t_thr).sum()),
        "near_tie_fraction": float((margins < t_thr).mean()),
        "min_margin": float(margins.min()),
        "router_near_tie_threshold": r_thr,
        "router_decisions": int(router.size),
        "router_near_tie_fraction": float((router < r_thr).mean()) if router.size else 0.0,
        "min_router_margin": float(router.min()) if router.size else float("inf"),
        "distinct_tokens": [int(np.unique(g.tokens).size) for g in greedy],
        "experts_routed": [int(u.size) for u in per_layer],
        "groups_routed": [int(np.unique(u // (E // G)).size) for u in per_layer],
        "n_routed_experts": E,
        "n_group": G,
        "prompt_router_margin": prompt_router,
        "prompt_token_margin": prompt_token,
        "blind_prompts": [i for i, (r, t) in enumerate(zip(prompt_router, prompt_token)) if r < r_thr or t < t_thr],
        "prompt_attempts": list(prompts.get("attempts", [])),
    }


def _rounds_tensors(prefix: str, res) -> dict[str, np.ndarray]:
    """A DDTree trace as flat arrays with offsets (rounds have different tree sizes)."""
    sizes = [len(r.node_tokens) for r in res.rounds]
    accepted = [len(r.accepted) for r in res.rounds]
    return {
        prefix + "tokens": res.tokens.astype(np.int32),
        prefix + "round_start": np.array([r.start for r in res.rounds], np.int32),
        prefix + "round_bonus": np.array([r.bonus for r in res.rounds], np.int32),
        prefix + "node_offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32),
        prefix + "node_tokens": np.concatenate([r.node_tokens for r in res.rounds]).astype(np.int32),
        prefix + "node_parents": np.concatenate([r.parents for r in res.rounds]).astype(np.int32),
        prefix + "node_depths": np.concatenate([r.depths for r in res.rounds]).astype(np.int32),
        prefix + "accepted_offsets": np.concatenate([[0], np.cumsum(accepted)]).astype(np.int32),
        prefix + "accepted": np.concatenate([r.accepted for r in res.rounds]).astype(np.int32),
    }


def _lossless_check(ddtree_tokens: np.ndarray, greedy, budget: int, accuracy: float, prompt: int) -> list[dict]:
    """DDTree at temperature 0 must emit the greedy tokens; a difference is acceptable only right
    after a step whose greedy margin is below DDTREE_TIE (the tree forward may round differently)."""
    diff = np.flatnonzero(ddtree_tokens != greedy.tokens)
    if diff.size == 0:
        return []
    step = int(diff[0])
    return [{"prompt": prompt, "budget": budget, "accuracy": accuracy, "step": step,
             "greedy_margin": float(greedy.margins[step]),
             "near_tie": bool(greedy.margins[step] < DDTREE_TIE)}]


def write_golden(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, Any]) -> None:
    """The golden file and its sha256 record (`<path>.sha256`), which every reader checks."""
    write_bundle(path, tensors, metadata, alignment=GOLDEN_ALIGNMENT)
    write_record(path)
