"""The transformers engine: transformers' DeepseekV3ForCausalLM, built from a KDTR bundle alone.

It is the engine whose transformer math nobody here wrote: the model config is the bundle's
`hf_config`, the weights are the bundle's tensors (the per-expert matrices fused into transformers'
`gate_up_proj` / `down_proj` layout), and INT4 weights are decoded here from `.qw` / `.sc` by this
module's own code (docs/int4-format.md). Prompts run one at a time: prefill, then one token per step
through transformers' KV cache (docs/engine-contract.md: greedy and score modes).

    python -m k2vec.engines.hf --bundle B.kdtr --mode greedy|score --budget 0 --output R.json
    python -m k2vec.engines.hf --bundle B.kdtr --batch LISTING.json   (every run of the bundle)
        [--dtype float32|bfloat16] [--gpus {gpus}]

`--gpus` empty (a `gpus: 0` entry) runs on the CPU; a device list runs on `cuda:0`, the first device the
runner's CUDA_VISIBLE_DEVICES gives. bfloat16 keeps the router in float32 (weight and correction
bias), as transformers' `from_pretrained` does (`_keep_in_fp32_modules_strict`).
"""

from __future__ import annotations

import inspect
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k2vec.engines.cli import contract_parser, contract_runs, write_output
from k2vec.errors import K2VecError
from k2vec.kdtr import open_bundle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# transformers renamed forward's `past_key_values` to `cache` (5.x); pass the cache by the name it takes.
_CACHE_ARG = "cache" if "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters else "past_key_values"


def decode_int4(packed: np.ndarray, scales: np.ndarray, group_size: int, bf16_scales: bool, name: str) -> torch.Tensor:
    """`.qw` u8 [N, K/2] (element 2j in the low nibble, 2j+1 in the high, stored as q + 8) and `.sc`
    [N, K/group] (float32, or bf16 bits as u16) -> float32 [N, K] = q * scale."""
    if packed.dtype != np.uint8 or packed.ndim != 2:
        raise ValueError(f"bundle tensor {name}.qw: expected a 2-D u8 array, found {packed.dtype} {packed.shape}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if scales.shape != (n, k // group_size) or k % group_size:
        raise ValueError(f"bundle tensor {name}.sc: shape {scales.shape} does not fit {name}.qw {packed.shape} "
                         f"with group size {group_size} (expected {(n, k // group_size)})")
    p = torch.from_numpy(np.array(packed)).to(torch.int16)  # a copy: bundle arrays are read-only maps
    codes = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(n, k) - 8
    if bf16_scales:  # bf16 bits are the high half of a float32
        sc = (torch.from_numpy(np.asarray(scales, dtype=np.uint16).astype(np.int32)) << 16).view(torch.float32)
    else:
        sc = torch.from_numpy(np.array(scales, dtype=np.float32))
    return (codes.reshape(n, k // group_size, group_size).float() * sc[:, :, None]).reshape(n, k)


def bundle_state_dict(bundle, meta: dict, model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state dict from the bundle: DeepSeek-V3 per-expert names fused into transformers'
    `experts.gate_up_proj` [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I]."""
    q = meta["quantization"]
    quantized = set(q["tensors"]) if q else set()

    def weight(name: str) -> torch.Tensor:
        if name in quantized:
            return decode_int4(bundle[name + ".qw"], bundle[name + ".sc"], q["group_size"],
                               q["scale_dtype"] == "bfloat16", name)
        if name not in bundle:
            raise KeyError(f"bundle has no tensor {name!r}, which transformers' DeepseekV3 needs")
        return torch.from_numpy(np.array(bundle[name], dtype=np.float32))

    n_experts = meta["hf_config"]["n_routed_experts"]
    state = {}
    for key in model.state_dict():
        prefix, _, leaf = key.rpartition(".experts.")
        if leaf == "gate_up_proj":
            state[key] = torch.stack([torch.cat([weight(f"{prefix}.experts.{e}.gate_proj.weight"),
                                                 weight(f"{prefix}.experts.{e}.up_proj.weight")])
                                      for e in range(n_experts)])
        elif leaf == "down_proj":
            state[key] = torch.stack([weight(f"{prefix}.experts.{e}.down_proj.weight") for e in range(n_experts)])
        else:
            state[key] = weight(key)
    return state


def load_model(bundle, meta: dict, dtype: torch.dtype, device: torch.device) -> DeepseekV3ForCausalLM:
    config = DeepseekV3Config.from_dict(meta["hf_config"])
    config.num_mtp_layers = 0
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.load_state_dict(bundle_state_dict(bundle, meta, model), strict=True, assign=True)
    # Buffers not in the state dict (RoPE inverse frequencies) were built on the meta device: rebuild them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    # q_a_layernorm / kv_a_layernorm epsilon as the bundle states it, not transformers' default.
    eps = meta["golden"]["reference"]["latent_norm_eps"]
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = eps
    model.set_attn_implementation("eager")
    model = model.to(device=device, dtype=dtype).eval()
    for layer in model.model.layers:  # the router stays float32 (its scores are computed in float32)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    return model


class Recorder:
    """Forward hooks: the hidden state after each decoder layer and the experts each MoE router picks."""

    def __init__(self, model: DeepseekV3ForCausalLM):
        self.hidden: list[torch.Tensor] = []
        self.routed: list[torch.Tensor] = []
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_hook(
                lambda mod, inp, out: self.hidden.append((out[0] if isinstance(out, tuple) else out)[0])))
            if hasattr(layer.mlp, "gate"):
                self.handles.append(layer.mlp.gate.register_forward_hook(
                    lambda mod, inp, out: self.routed.append(out[2])))

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [T, L, H], router ids [T, M, k] or None) of the last forward; clears the record."""
        hidden = torch.stack(self.hidden, dim=1)
        routed = torch.stack(self.routed, dim=1) if self.routed else None
        self.hidden, self.routed = [], []
        return hidden, routed


@torch.no_grad()
def decode_prompt(model: DeepseekV3ForCausalLM, recorder: Recorder, prompt: np.ndarray, n_new: int, top_k: int,
                  next_token: Callable[[int, torch.Tensor], torch.Tensor]) -> tuple[dict, np.ndarray | None]:
    """Prefill `prompt`, then `n_new` steps, each feeding `next_token(step, argmax)` through the KV cache.
    Returns what the contract records per step, and the router choices of every fed position
    ([P + N - 1, MoE layers, k], None without MoE layers)."""
    dev = model.device
    cache = transformers.DynamicCache(config=model.config)
    feed = torch.as_tensor(prompt, dtype=torch.long, device=dev)[None]
    ids, vals, hidden, routed = [], [], [], []
    for step in range(n_new):
        logits = model(input_ids=feed, use_cache=True, logits_to_keep=1, **{_CACHE_ARG: cache}).logits[0, -1]
        v, i = torch.sort(logits.float(), descending=True, stable=True)  # ties: lower id first
        ids.append(i[:top_k])
        vals.append(v[:top_k])
        h, r = recorder.take()
        hidden.append(h[-1].float())
        if r is not None:
            routed.append(r)
        if step + 1 < n_new:
            feed = next_token(step, i[:1]).reshape(1, 1)
    ids, vals = torch.stack(ids).cpu().numpy(), torch.stack(vals).double().cpu().numpy()
    out = {"tokens": ids[:, 0].tolist(), "topk_ids": ids.tolist(), "topk_logits": vals.tolist(),
           "fingerprints": torch.stack(hidden).cpu().numpy().tolist()}
    return out, (torch.cat(routed).cpu().numpy() if routed else None)


def greedy(model, recorder, prompt: np.ndarray, n_new: int, top_k: int) -> dict:
    out, routed = decode_prompt(model, recorder, prompt, n_new, top_k, lambda step, argmax: argmax)
    if routed is not None:  # the token fed at step j: the last prompt token, then generated tokens
        out["router_experts"] = routed[prompt.size - 1:].tolist()
    return out


def score(model, recorder, prompt: np.ndarray, golden: np.ndarray, n_new: int, top_k: int) -> dict:
    fed = torch.as_tensor(golden, dtype=torch.long, device=model.device)
    out, routed = decode_prompt(model, recorder, prompt, n_new, top_k, lambda step, argmax: fed[step])
    if routed is not None:  # every fed position: the prompt, then golden tokens 0..N-2
        out["router_experts"] = routed.tolist()
    return out


@dataclass
class Loaded:
    """A bundle's transformers model, for any number of runs on it."""

    meta: dict
    bundle: object
    prompts: list[np.ndarray]
    model: DeepseekV3ForCausalLM
    recorder: Recorder
    device: torch.device
    started_at: float
    load_s: float


def load(bundle_path: str, dtype: str, device: str) -> Loaded:
    started_at = time.time()
    t0 = time.perf_counter()
    torch.set_float32_matmul_precision("highest")  # no TF32 on GPUs: float32 must mean float32
    dev = torch.device(device)
    bundle = open_bundle(bundle_path)
    meta = bundle.metadata
    prompts = [np.asarray(bundle[f"prompt.p{i}.tokens"], dtype=np.int64) for i in range(meta["golden"]["prompts"])]
    model = load_model(bundle, meta, DTYPES[dtype], dev)
    return Loaded(meta, bundle, prompts, model, Recorder(model), dev, started_at, time.perf_counter() - t0)


def decode(loaded: Loaded, mode: str, dtype: str, first: bool = True) -> dict:
    """One run on a loaded bundle; `first`: the process's first run, which reports the load (later ones: 0 s)."""
    started_at = loaded.started_at if first else time.time()
    t_load = time.perf_counter()
    meta, bundle, prompts, model, recorder, dev = (loaded.meta, loaded.bundle, loaded.prompts, loaded.model,
                                                   loaded.recorder, loaded.device)
    n_new, top_k = meta["decoding"]["max_new_tokens"], meta["decoding"]["top_k"]
    if mode == "greedy":
        results = [greedy(model, recorder, p, n_new, top_k) for p in prompts]
    elif mode == "score":  # golden.p{i}.tokens: the only golden tensor an engine may read, in score mode only
        results = [score(model, recorder, p, np.asarray(bundle[f"golden.p{i}.tokens"]), n_new, top_k)
                   for i, p in enumerate(prompts)]
    else:
        raise K2VecError(f"k2vec.engines.hf: mode {mode!r} is not supported (greedy, score)")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_end = time.perf_counter()
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})"
    return {"format": "k2vec-engine-result", "version": 1,
            "device": f"{where}, transformers {transformers.__version__}, torch {torch.__version__}, {dtype}",
            "timing": {"load_s": loaded.load_s if first else 0.0, "decode_s": t_end - t_load,
                       "started_at": started_at, "ended_at": time.time()},
            "runs": [{"drafter": None, "prompts": results}]}


def main(argv: list[str] | None = None) -> int:
    modes = ("greedy", "score")   # no DDTree mode
    ap = contract_parser(__doc__.splitlines()[0], modes=modes)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--gpus", default="", help="the runner's {gpus}: empty runs on the CPU, else on cuda:0")
    args = ap.parse_args(argv)
    runs = contract_runs(ap, args, modes)
    loaded = load(args.bundle, args.dtype, "cuda:0" if args.gpus.strip() else "cpu")   # once for every run
    for i, r in enumerate(runs):
        write_output(r.output, decode(loaded, r.mode, args.dtype, first=i == 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
