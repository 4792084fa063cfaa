"""The format-effect run: the int4 golden model forced on the fp32 golden sequence (score mode).

It is written in the engine result format (docs/engine-contract.md, score mode) and judged by the
report against the fp32 golden as if it were an engine named `int4-format` on precision `fp32`: a
user sees an engine's score statistics next to what INT4 itself costs. The model is the one the int4
golden runs (fp32 checkpoint with every quantized weight replaced by its dequantized INT4 value,
float64 reference); the fed tokens are the fp32 golden's greedy tokens. Up to and including the first
step where the two goldens' greedy tokens differ, both saw the same tokens, so those steps equal the
int4 golden's own (the figures of the greedy format-effect table); after it, forcing keeps them
comparable.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from k2vec.digests import verify_kdtr
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.expectations import Expectations
from k2vec.engines.contract.files import write_result
from k2vec.engines.contract.serialize import score_prompt
from k2vec.kdtr import open_bundle
from k2vec.reference.generate import greedy_generate
from k2vec.stages.golden import reference_model

ENGINE_NAME = "int4-format"


def format_effect_result(model_spec: dict[str, Any], int4_weights: Mapping[str, np.ndarray],
                         fp32_golden: str | Path) -> dict[str, Any]:
    """The score-mode result of the int4 golden model on the fp32 golden's prompts and tokens.
    The fp32 golden is verified (KDTR checksums and its sha256 record) before anything is read."""
    golden_sha256 = verify_kdtr(fp32_golden)
    with open_bundle(fp32_golden) as g:
        md = g.metadata
        if (md.get("kind"), md.get("model"), md.get("precision")) != ("k2vec-golden", model_spec["name"], "fp32"):
            raise ValueError(f"{fp32_golden} is not the fp32 golden of model {model_spec['name']!r} (metadata kind "
                             f"{md.get('kind')!r}, model {md.get('model')!r}, precision {md.get('precision')!r})")
        n = int(md["prompts"])
        prompts = [np.asarray(g[f"prompt.p{i}.tokens"], np.int64) for i in range(n)]
        forced = [np.asarray(g[f"golden.p{i}.tokens"], np.int64) for i in range(n)]
        n_new, top_k = int(md["max_new_tokens"]), int(md["top_k"])
    model = reference_model(model_spec, int4_weights)
    results = greedy_generate(model, prompts, n_new, top_k=top_k, forced=forced)
    # no timing: the same inputs give the same bytes (the rule's benchmark file has the time)
    result = {"format": "k2vec-engine-result", "version": 1,
            "engine": ENGINE_NAME, "model": model_spec["name"], "precision": "fp32", "mode": "score",
            "device": f"cpu ({platform.machine()}, numpy {np.__version__}, float64): the int4 golden model",
            "inputs": {"forced_golden": {"path": str(fp32_golden), "sha256": golden_sha256}},
            "status": "ok", "reason": None,
            "runs": [{"drafter": None, "prompts": [score_prompt(r) for r in results]}]}
    # held to the contract any engine's score result is held to
    m = model_spec
    check_result(result, "score", Expectations(
        n_prompts=n, max_new_tokens=n_new, vocab_size=m["vocab_size"], prompt_lengths=tuple(p.size for p in prompts),
        layers=m["num_hidden_layers"], moe_layers=m["num_hidden_layers"] - m["first_k_dense_replace"],
        experts=m["n_routed_experts"], experts_per_token=m["num_experts_per_tok"]))
    return result


def write_format_effect(path: str | Path, result: Mapping[str, Any]) -> None:
    """The result and its sha256 record, as the engine runner writes a run's (the report checks it)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(path), json.dumps(result, indent=1, sort_keys=True, allow_nan=False) + "\n")

