"""Rule `convention`: the golden of a convention variant of the reference (k2vec.model.conventions).

The golden stage's data (docs/golden-format.md), made by the reference model with a named convention's
settings, e.g. the latent norms' epsilon equal to `rms_norm_eps` as vLLM, SGLang and llama.cpp compute it: its
own greedy tokens, top-k logits, fingerprints, router choices and DDTree traces, on the golden's prompts and
with the golden's recorded drafts (those an engine reads from its bundle). The report judges an engine against
it where the engine declares that convention, and where the engine fails the golden (docs/report.md
"Conventions"). Metadata `reference.conventions` names the variant; `golden_sha256` the golden it follows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from k2vec.ddtree import RecordedDrafts
from k2vec.digests import verify_kdtr
from k2vec.kdtr import open_bundle
from k2vec.model.conventions import ConventionError
from k2vec.stages.golden import make_golden

log = logging.getLogger("k2vec.stages.convention")


def make_variant(case: dict[str, Any], weights: Mapping[str, np.ndarray], precision: str, golden_path: str | Path,
                 conventions: Sequence[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The variant golden's tensors and metadata: `case` (model, prompts, decoding) as the golden stage reads
    it, the golden at `golden_path` (read after its checks pass) for its drafts."""
    if not conventions:
        raise ConventionError("a convention variant needs at least one convention; without, it is the golden")
    sha256 = verify_kdtr(golden_path)
    with open_bundle(golden_path) as g:
        md = g.metadata
        prompts = case["prompts"]["tokens"]
        stored = [np.asarray(g[f"prompt.p{i}.tokens"]) for i in range(md["prompts"])]
        if len(stored) != len(prompts) or any(not np.array_equal(a, b) for a, b in zip(stored, prompts)):
            raise ConventionError(f"{golden_path} was made from other prompts than the case's: rebuild it")
        drafts = {(a, i): RecordedDrafts(np.array(g[f"drafts.a{a}.p{i}.ids"]),
                                         np.array(g[f"drafts.a{a}.p{i}.logprobs"]),
                                         np.full(g[f"drafts.a{a}.p{i}.ids"].shape[:2], -1, np.int32), len(prompts[i]))
                  for a in range(len(md["ddtree"]["accuracies"])) for i in range(len(prompts))}
    tensors, metadata = make_golden(case, weights, precision, conventions, drafts)
    metadata["golden_sha256"] = sha256
    log.info("%s/%s variant %s: reference %s", metadata["model"], precision, "+".join(sorted(conventions)),
             metadata["reference"])
    return tensors, metadata
