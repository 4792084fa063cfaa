"""The GPU engine under the engine contract: PyTorch, every quantized linear through Triton W4A16 kernels.

    python -m k2vec.engines.gpu_triton --bundle B.kdtr --mode greedy|ddtree|score --budget N --output R.json
        [--dtype float32|bfloat16] [--device cuda:0]
    python -m k2vec.engines.gpu_triton --bundle B.kdtr --batch LISTING.json [...]   (every run of the bundle)

Reads only the bundle, onto one device (`cuda:0`: the runner's CUDA_VISIBLE_DEVICES picks the GPU;
`cpu` runs the same code under TRITON_INTERPRET=1 for tests). docs/gpu-engine.md describes it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import triton

from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.engines.cli import contract_parser, contract_runs, write_output
from k2vec.engines.gpu_triton.ddtree import ddtree_decode
from k2vec.engines.gpu_triton.model import Segment, Transformer
from k2vec.kdtr import open_bundle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def greedy_decode(model: Transformer, prompts: list[np.ndarray], max_new_tokens: int, top_k: int,
                  forced: list[np.ndarray] | None = None) -> list[dict]:
    """All prompts in lockstep, one forward per step; results stay on the device until the end (no sync
    per step). Each step records what the golden records for the token it fed (docs/golden-format.md).

    `forced` (score mode): per prompt, the golden tokens fed instead of the argmax, through the same
    decode path; `router_experts` then covers every fed position, the prompt's included (P + N - 1 rows)."""
    dev = model.device
    if forced is not None:
        forced_dev = torch.as_tensor(np.stack(forced), device=dev)  # [prompts, N]
        fed_routes = [[] for _ in prompts]  # per prompt, per step: [rows fed, M, k]
    caches = [model.new_cache(p.size + max_new_tokens) for p in prompts]
    feed = [torch.as_tensor(p, device=dev) for p in prompts]
    ids, vals, hidden, routed = [], [], [], []
    for _ in range(max_new_tokens):
        segs = [Segment(t, torch.arange(c.length, c.length + t.numel(), device=dev), c) for t, c in zip(feed, caches)]
        out = model.forward(segs, last_only=True, record=True)
        v, i = torch.sort(out.logits, dim=-1, descending=True, stable=True)  # ties: lower id first
        ids.append(i[:, :top_k])
        vals.append(v[:, :top_k])
        hidden.append(out.hidden.float())
        routed.append(torch.stack(out.router_ids, dim=1) if out.router_ids else None)
        if forced is not None and out.router_rows:
            rows = torch.stack(out.router_rows, dim=1)  # [all fed rows, M, k], segments back to back
            for p, part in enumerate(torch.split(rows, [t.numel() for t in feed])):
                fed_routes[p].append(part)
        feed = list(i[:, :1]) if forced is None else list(forced_dev[:, len(ids) - 1: len(ids)])
    ids, vals = torch.stack(ids, 1).cpu().numpy(), torch.stack(vals, 1).cpu().numpy()  # [P, N, k]
    hidden = torch.stack(hidden).permute(2, 0, 1, 3).cpu().numpy()  # [P, N, L, H]
    routed = torch.stack(routed, 1).cpu().numpy() if routed[0] is not None else None  # [P, N, M, k]
    if forced is not None and routed is not None:
        routed = [torch.cat(r).cpu().numpy() for r in fed_routes]  # per prompt [P + N - 1, M, k]
    return [{"tokens": ids[p, :, 0].tolist(), "topk_ids": ids[p].tolist(), "topk_logits": vals[p].tolist(),
             "fingerprints": hidden[p].tolist(),
             **({"router_experts": routed[p].tolist()} if routed is not None else {})}
            for p in range(len(prompts))]


def device_description(device: torch.device, dtype: str) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} (torch {torch.__version__}, Triton {triton.__version__}, activations {dtype})"
    return f"cpu (torch {torch.__version__}, Triton {triton.__version__} interpreter, activations {dtype})"


def gpu_identity(device: torch.device) -> dict | None:
    """The physical GPU as the driver names it (the runner records the same from nvidia-smi when it can)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "uuid": f"GPU-{props.uuid}"}


@dataclass
class Loaded:
    """A bundle's model on the device, for any number of runs on it."""

    meta: dict
    bundle: object
    prompts: list[np.ndarray]
    model: Transformer
    device: torch.device
    started_at: float
    load_s: float


def load(bundle_path: str, dtype: str, device: str) -> Loaded:
    started_at = time.time()
    t0 = time.perf_counter()
    torch.set_float32_matmul_precision("highest")  # no TF32: the float32 mode must match the golden
    dev = torch.device(device)
    bundle = open_bundle(bundle_path)
    meta = bundle.metadata
    decoding = meta["decoding"]
    prompts = [np.asarray(bundle[f"prompt.p{i}.tokens"], dtype=np.int64) for i in range(meta["golden"]["prompts"])]
    longest = max(p.size for p in prompts) + decoding["max_new_tokens"] + decoding["ddtree"]["block_size"] + 1
    model = Transformer(bundle, meta, DTYPES[dtype], dev, longest)
    _sync(dev)
    return Loaded(meta, bundle, prompts, model, dev, started_at, time.perf_counter() - t0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode(loaded: Loaded, mode: str, budget: int, dtype: str, first: bool = True) -> dict:
    """One run on a loaded bundle; `first`: the process's first run, which reports the load (later ones: 0 s)."""
    started_at = loaded.started_at if first else time.time()
    t_load = time.perf_counter()
    meta, bundle, prompts, model, dev = loaded.meta, loaded.bundle, loaded.prompts, loaded.model, loaded.device
    decoding = meta["decoding"]
    n_new = decoding["max_new_tokens"]
    if mode == "greedy":
        runs = [{"drafter": None, "prompts": greedy_decode(model, prompts, n_new, decoding["top_k"])}]
    elif mode == "score":
        # the only golden tensor an engine may read, and only in this mode (docs/engine-contract.md §3)
        golden = [np.asarray(bundle[f"golden.p{i}.tokens"], dtype=np.int64) for i in range(len(prompts))]
        runs = [{"drafter": None, "prompts": greedy_decode(model, prompts, n_new, decoding["top_k"], golden)}]
    else:
        runs = []
        for a_i, accuracy in enumerate(meta["golden"]["ddtree"]["accuracies"]):
            drafts = []
            for i, p in enumerate(prompts):
                ids = np.asarray(bundle[f"drafts.a{a_i}.p{i}.ids"])
                drafts.append(RecordedDrafts(ids, np.asarray(bundle[f"drafts.a{a_i}.p{i}.logprobs"]),
                                             np.full(ids.shape[:2], -1, np.int32), p.size))
            out = ddtree_decode(model, prompts, drafts, budget, n_new)
            runs.append({"drafter": {"accuracy": accuracy},
                         "prompts": [{"tokens": t, "rounds": [r.to_json() for r in rounds]} for t, rounds in out]})
    _sync(dev)
    t_end = time.perf_counter()
    return {"format": "k2vec-engine-result", "version": 1, "device": device_description(dev, dtype),
            "gpu": gpu_identity(dev),
            "timing": {"load_s": loaded.load_s if first else 0.0, "decode_s": t_end - t_load,
                       "started_at": started_at, "ended_at": time.time()},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = contract_parser(__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda:0", help="cuda:0 (default) or cpu (with TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    runs = contract_runs(ap, args)
    loaded = load(args.bundle, args.dtype, args.device)   # once: every run of a batch shares the model
    for i, r in enumerate(runs):
        write_output(r.output, decode(loaded, r.mode, r.budget, args.dtype, first=i == 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
