"""A perfect engine result built straight from the golden data (for tests and the report bench).

Faults are injected by editing the returned dict: it follows result.schema.json exactly, with
`status: ok` and the runner's extra keys (engine, mode, budget, wall_s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from k2vec.digests import sha256_bytes, write_record
from k2vec.engines.contract.modes import parse_mode
from k2vec.kdtr import open_bundle


def write_result(path: str | Path, result: dict[str, Any]) -> str:
    """Leave `result` at `path` as the engine runner does: the JSON and its sha256 record, which the
    report checks (a result without one is shown as changed, not judged)."""
    text = json.dumps(result)
    Path(path).write_text(text)
    write_record(path, sha256_bytes(text.encode("utf-8")))
    return str(path)


def case_goldens(case: dict[str, Any], root: str | Path) -> dict[tuple[str, str], Path]:
    """The fp32 and int4 goldens of one resolved case, built under `root` without Snakemake
    (weights, quantization, golden): {(model, precision): golden path}."""
    from k2vec.stages.golden import make_golden, open_weights, reference_model, write_golden
    from k2vec.stages.quantize import quantize_checkpoint
    from k2vec.stages.prompts import draw_prompts
    from k2vec.stages.weights import write_checkpoint

    root = Path(root)
    write_checkpoint(case["model"], root / "fp32")
    quantize_checkpoint(root / "fp32", root / "int4", case["quantization"])
    weights = {p: open_weights(p, root / "fp32", root / "int4") for p in ("fp32", "int4")}
    # as the prompts stage draws them: fp32 first, int4 from the fp32 choice on
    prompts = {"fp32": draw_prompts(case["prompts"], case["model"],
                                    {"fp32": reference_model(case["model"], weights["fp32"])})}
    prompts["int4"] = draw_prompts(case["prompts"], case["model"],
                                   {"int4": reference_model(case["model"], weights["int4"])},
                                   prompts["fp32"])
    out = {}
    for precision in ("fp32", "int4"):
        tensors, metadata = make_golden({**case, "prompts": prompts[precision]}, weights[precision], precision)
        write_golden(root / f"{precision}.kdtr", tensors, metadata)
        out[(case["model"]["name"], precision)] = root / f"{precision}.kdtr"
    return out


def perfect_result(golden: str | Path, mode: str, *, engine: str = "perfect", topk: bool = True,
                   fingerprints: bool = True, router: bool = True, rounds: bool = True,
                   wall_s: float = 1.0) -> dict[str, Any]:
    """The result an engine that reproduces `golden` exactly would write for `mode` (greedy, ddtree-b<n>
    or score: the golden tokens fed back, router choices at every fed position, prompt included)."""
    kind, budget = ("score", 0) if mode == "score" else parse_mode(mode)
    with open_bundle(golden) as b:
        md = b.metadata
        n = int(md["max_new_tokens"])

        def prompt(i: int, tokens: np.ndarray) -> dict[str, Any]:
            p: dict[str, Any] = {"tokens": tokens.tolist()}
            if topk:
                p["topk_ids"] = b[f"golden.p{i}.topk_ids"].tolist()
                p["topk_logits"] = b[f"golden.p{i}.topk_logits"].tolist()
            if fingerprints:
                p["fingerprints"] = b[f"golden.p{i}.fingerprints"].tolist()
            if router and kind == "score":
                p["router_experts"] = b[f"golden.p{i}.router_ids"].transpose(1, 0, 2).tolist()
            elif router:
                start = len(b[f"prompt.p{i}.tokens"]) - 1
                ids = b[f"golden.p{i}.router_ids"]
                p["router_experts"] = ids[:, start:start + n, :].transpose(1, 0, 2).tolist()
            return p

        if kind in ("greedy", "score"):
            runs = [{"drafter": None, "prompts": [prompt(i, b[f"golden.p{i}.tokens"]) for i in range(md["prompts"])]}]
        else:
            runs = []
            for a_i, acc in enumerate(md["ddtree"]["accuracies"]):
                prompts = []
                for i in range(md["prompts"]):
                    pre = f"ddtree.b{budget}.a{a_i}.p{i}."
                    p = prompt(i, b[pre + "tokens"])
                    if rounds:
                        no, ao = b[pre + "node_offsets"], b[pre + "accepted_offsets"]
                        p["rounds"] = [{
                            "start": int(b[pre + "round_start"][r]),
                            "tokens": b[pre + "node_tokens"][no[r]:no[r + 1]].tolist(),
                            "parents": b[pre + "node_parents"][no[r]:no[r + 1]].tolist(),
                            "depths": b[pre + "node_depths"][no[r]:no[r + 1]].tolist(),
                            "accepted": b[pre + "accepted"][ao[r]:ao[r + 1]].tolist(),
                            "bonus": int(b[pre + "round_bonus"][r]),
                        } for r in range(len(no) - 1)]
                    prompts.append(p)
                runs.append({"drafter": {"accuracy": acc}, "prompts": prompts})
    return {"format": "k2vec-engine-result", "version": 1, "engine": engine, "mode": mode, "budget": budget,
            "status": "ok", "reason": None, "wall_s": wall_s, "device": "cpu", "runs": runs}
