"""The noise model: what correct engines of a reduced precision show on one golden, measured by none of them.

The reference model runs the golden's own prompts, fed the golden's tokens (score mode, so every step sees
the inputs a correct engine sees before any divergence), once per rounding schedule of
k2vec.model.precision: each an emulated engine of the precision that rounds at other op boundaries. Per
schedule and prompt it keeps what an engine result carries, reduced to what the report compares:

    noise.{schedule}.p{i}.tokens       int32 [N]          the schedule's argmax per step
    noise.{schedule}.p{i}.topk_ids     int32 [N, K]       its top-K (K = the golden's) ...
    noise.{schedule}.p{i}.topk_logits  float64 [N, K]     ... and their logits
    noise.{schedule}.p{i}.hidden_rel   float32 [N, L]     relative L2 error of its residual stream after
                                                          each layer against the golden's fingerprint
    noise.{schedule}.p{i}.router_ids   int32 [M, P+N-1, k] its routed experts per fed position
    noise.{schedule}.p{i}.router_margins float64 [M, P+N-1] its router margins (k2vec.reference.model.route)

The report (k2vec.report.noise) turns these into envelopes and judges engines of that precision
against them, the same comparison code as for engines (docs/report.md "Noise model").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from k2vec import __version__
from k2vec.digests import verify_kdtr, write_record
from k2vec.kdtr import open_bundle, write_bundle
from k2vec.model.limits import WEIGHT_CACHE_BYTES
from k2vec.model.precision import SCHEDULES, get_format, rounder
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import ReferenceModel

log = logging.getLogger("k2vec.stages.noise")

NOISE_ALIGNMENT = 64


def golden_inputs(golden_path: str | Path) -> dict[str, Any]:
    """The golden's prompts, tokens, fingerprints and settings a noise model needs, read only after every
    check of the file and its sha256 record pass."""
    sha256 = verify_kdtr(golden_path)
    g = open_bundle(golden_path)
    meta = g.metadata
    n = meta["prompts"]
    return {
        "meta": meta,
        "sha256": sha256,
        "prompts": [np.asarray(g[f"prompt.p{i}.tokens"], np.int64) for i in range(n)],
        "tokens": [np.asarray(g[f"golden.p{i}.tokens"], np.int64) for i in range(n)],
        "fingerprints": [np.asarray(g[f"golden.p{i}.fingerprints"]) for i in range(n)],
    }


def make_noise(model_spec: Mapping[str, Any], weights: Mapping[str, np.ndarray], golden: Mapping[str, Any],
               precision_class: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """All noise-model tensors (module docstring) and metadata for one golden and one precision class."""
    get_format(precision_class)   # an unknown class is named before any work
    meta = golden["meta"]
    ref = meta["reference"]
    tensors: dict[str, np.ndarray] = {}
    per_schedule: dict[str, dict[str, float]] = {}
    for name in SCHEDULES:
        model = ReferenceModel(model_spec, weights, dtype=np.float64, latent_norm_eps=ref["latent_norm_eps"],
                               weight_cache_bytes=WEIGHT_CACHE_BYTES, rounding=rounder(precision_class, name))
        results = greedy_generate(model, golden["prompts"], meta["max_new_tokens"], top_k=meta["top_k"],
                                  forced=golden["tokens"])
        same, rel_all = [], []
        for i, (r, g_tok, g_fp) in enumerate(zip(results, golden["tokens"], golden["fingerprints"])):
            gf = np.asarray(g_fp, np.float64)
            rel = np.linalg.norm(r.hidden - gf, axis=-1) / np.maximum(np.linalg.norm(gf, axis=-1), 1e-30)
            p = f"noise.{name}.p{i}."
            tensors[p + "tokens"] = r.tokens.astype(np.int32)
            tensors[p + "topk_ids"] = r.topk_ids.astype(np.int32)
            tensors[p + "topk_logits"] = r.topk_logits.astype(np.float64)
            tensors[p + "hidden_rel"] = rel.astype(np.float32)
            tensors[p + "router_ids"] = r.router_ids.astype(np.int32)
            tensors[p + "router_margins"] = r.router_margins.astype(np.float64)
            same.append(r.tokens == g_tok)
            rel_all.append(rel)
        per_schedule[name] = {"same_top1": float(np.concatenate(same).mean()),
                              "hidden_rel_median": float(np.median(np.concatenate([x.ravel() for x in rel_all])))}
        log.info("%s/%s %s schedule %s: same top-1 %.3f, median hidden rel. error %.4f", meta["model"],
                 meta["precision"], precision_class, name, per_schedule[name]["same_top1"],
                 per_schedule[name]["hidden_rel_median"])
    metadata = {
        "kind": "k2vec-noise",
        "generator": {"package": "k2vec", "version": __version__},
        "model": meta["model"],
        "precision": meta["precision"],
        "precision_class": precision_class,
        "golden_sha256": golden["sha256"],
        "prompts": len(golden["prompts"]),
        "schedules": {name: vars(SCHEDULES[name]) for name in SCHEDULES},
        "summary": per_schedule,
    }
    return tensors, metadata


def write_noise(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, Any]) -> None:
    """The noise-model file and its sha256 record (`<path>.sha256`), which the report checks."""
    write_bundle(path, tensors, metadata, alignment=NOISE_ALIGNMENT)
    write_record(path)
