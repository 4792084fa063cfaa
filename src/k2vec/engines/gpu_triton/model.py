"""The Kimi-K2 / DeepSeek-V3 decoder in PyTorch, every quantized linear through the Triton kernels.

Read top to bottom: the config and RoPE tables, the weights as they come off the bundle, the KV cache,
the building blocks (RMSNorm, interleaved RoPE, MLA attention, SwiGLU, the router, the MoE), and the
whole forward over a batch of segments (one block of new tokens per sequence, each with its own cache,
positions and mask: a prefill, a decode step or a DDTree verification tree).

Precisions (`dtype`): float32 everywhere (must reproduce the float64 golden), or bfloat16 activations
and unquantized weights, as a bf16 serving engine runs. In bfloat16 the parts that engines keep in
float32 stay in float32: the RMSNorm statistics (HF upcasts), the router (transformers runs the gate in
float32 and so do vLLM / SGLang), the attention scores and softmax (as flash attention does), and the
MoE combine (fused_moe accumulates in float32). RoPE tables are computed in float64 and then cast.

Config parsing and the YaRN frequency formula are the reference's (`k2vec.reference.model.Dims`,
`rope_tables`): reading `hf_config` has one implementation; all the tensor math here is this engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from k2vec.engines.gpu_triton.kernels import (
    PackedExperts,
    PackedInt4,
    fused_moe,
    pack_experts,
    pack_for_gpu,
    w4a16_linear,
)
from k2vec.engines.gpu_triton.kernels.configs import moe_names_cuda
from k2vec.errors import K2VecError
from k2vec.kdtr import bf16_to_f32
from k2vec.reference.model import Dims, rope_tables


class GpuEngineError(K2VecError):
    pass


# ---------------------------------------------------------------------------------------------
# Config and rotary tables
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelArgs:
    dims: Dims                  # every dimension, parsed and checked from hf_config
    inv_freq: np.ndarray        # float64 [rope/2], YaRN-blended
    attention_factor: float     # YaRN scale of cos/sin
    softmax_scale: float        # qk_head_dim^-0.5 * mscale^2
    latent_norm_eps: float      # eps of q_a_layernorm / kv_a_layernorm (the bundle says which)

    @classmethod
    def from_bundle_metadata(cls, meta: Mapping) -> "ModelArgs":
        d = Dims.from_config(meta["hf_config"])
        inv_freq, attention_factor, softmax_mult = rope_tables(meta["hf_config"], d.rope)
        eps = meta["golden"]["reference"]["latent_norm_eps"]
        return cls(d, inv_freq, attention_factor, (d.nope + d.rope) ** -0.5 * softmax_mult,
                   d.eps if eps is None else float(eps))


def rope_cache(args: ModelArgs, max_positions: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """cos, sin [max_positions, rope/2]: angles and their cos/sin in float64, scaled, then cast once."""
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * args.inv_freq[None, :]
    cos, sin = np.cos(angles) * args.attention_factor, np.sin(angles) * args.attention_factor
    return (torch.from_numpy(cos).to(device=device, dtype=dtype),
            torch.from_numpy(sin).to(device=device, dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

Weight = Tensor | PackedInt4  # a linear's weight: dense [N, K] in the compute dtype, or packed INT4


def linear(x: Tensor, w: Weight) -> Tensor:
    """y = x @ W^T: the W4A16 kernel for packed weights, a plain matmul otherwise."""
    return w4a16_linear(x, w) if isinstance(w, PackedInt4) else x @ w.T


@dataclass
class MLP:
    gate_up: list[Weight]       # one weight [2I, K] (gate rows, then up rows) when both have the same kind
    down: Weight
    intermediate: int


@dataclass
class RoutedExperts:
    packed: PackedExperts | None = None   # all experts quantized: the fused MoE kernel
    gate_up: Tensor | None = None         # none quantized: stacked [E, 2I, H] and [E, H, I] in the compute dtype
    down: Tensor | None = None


@dataclass
class Layer:
    attn: dict[str, Weight]               # projections and latent norms of MLA
    input_norm: Tensor
    post_norm: Tensor
    mlp: MLP | None = None                # dense layers
    router: Tensor | None = None          # MoE layers: gate [E, H] float32
    router_bias: Tensor | None = None     # e_score_correction_bias [E] float32
    experts: RoutedExperts | None = None
    shared: MLP | None = None


class BundleLoader:
    """Reads the bundle's tensors onto the device: dense ones in the compute dtype, `.qw`/`.sc` pairs
    through the kernels' `pack_for_gpu` (its load-time layout transform, if any)."""

    def __init__(self, bundle, meta: Mapping, dtype: torch.dtype, device):
        self.bundle, self.dtype, self.device = bundle, dtype, device
        q = meta["quantization"]
        self.quantized = set(q["tensors"]) if q else set()
        self.group_size = q["group_size"] if q else None
        self.scale_dtype = q["scale_dtype"] if q else None

    def dense(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        if name in self.quantized:
            raise GpuEngineError(f"tensor {name} is quantized in the bundle; this engine reads it only "
                                 "as a linear weight")
        try:
            arr = self.bundle[name]
        except KeyError:
            raise GpuEngineError(f"tensor {name} is missing from the bundle") from None
        arr = bf16_to_f32(arr) if arr.dtype == np.uint16 else np.array(arr, np.float32)  # a writable copy
        return torch.from_numpy(arr).to(device=self.device, dtype=dtype or self.dtype)

    def _packed_parts(self, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        qw = np.concatenate([np.asarray(self.bundle[n + ".qw"]) for n in names])
        sc = np.concatenate([np.asarray(self.bundle[n + ".sc"]) for n in names])
        return qw, sc

    def linear(self, *names: str) -> Weight:
        """The weight of one linear, or of several stacked along N (their outputs concatenated)."""
        kinds = {n in self.quantized for n in names}
        if len(kinds) != 1:
            raise GpuEngineError(f"cannot stack {names}: some quantized, some not")
        if kinds.pop():
            qw, sc = self._packed_parts(list(names))
            # the MMA-order copy serves the bf16/fp16 tensor-core tiles only (float32 has its own tiles), the CUDA
            # kernel's copy bf16 only
            return pack_for_gpu(qw, sc, self.group_size, self.scale_dtype, self.device,
                                mma_order=self.dtype != torch.float32, cuda_order=self.dtype == torch.bfloat16)
        return torch.cat([self.dense(n) for n in names])

    def mlp(self, prefix: str, intermediate: int) -> MLP:
        gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
        fused = (gate in self.quantized) == (up in self.quantized)
        gate_up = [self.linear(gate, up)] if fused else [self.linear(gate), self.linear(up)]
        return MLP(gate_up, self.linear(prefix + "down_proj.weight"), intermediate)

    def routed_experts(self, prefix: str, n_experts: int) -> RoutedExperts:
        names = {p: [f"{prefix}experts.{e}.{p}_proj.weight" for e in range(n_experts)]
                 for p in ("gate", "up", "down")}
        flags = {n in self.quantized for group in names.values() for n in group}
        if flags == {True}:
            parts = {p: [(np.array(self.bundle[n + ".qw"]), np.array(self.bundle[n + ".sc"])) for n in group]
                     for p, group in names.items()}
            return RoutedExperts(packed=pack_experts(parts["gate"], parts["up"], parts["down"],
                                                     group_size=self.group_size, scale_dtype=self.scale_dtype,
                                                     device=self.device,
                                                     cuda_order=self.dtype == torch.bfloat16 and moe_names_cuda()))
        if flags == {False}:
            gate_up = torch.stack([torch.cat([self.dense(g), self.dense(u)])
                                   for g, u in zip(names["gate"], names["up"])])
            return RoutedExperts(gate_up=gate_up, down=torch.stack([self.dense(n) for n in names["down"]]))
        raise GpuEngineError(f"{prefix}experts: some routed experts are quantized and some are not; "
                             "the engine needs one kind per layer")


def load_layers(loader: BundleLoader, d: Dims) -> list[Layer]:
    layers = []
    for i in range(d.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {"kv_a": loader.linear(a + "kv_a_proj_with_mqa.weight"),
                "kv_a_norm": loader.dense(a + "kv_a_layernorm.weight"),
                "kv_b": loader.linear(a + "kv_b_proj.weight"),
                "o": loader.linear(a + "o_proj.weight")}
        if d.q_lora_rank is None:
            attn["q"] = loader.linear(a + "q_proj.weight")
        else:
            attn.update(q_a=loader.linear(a + "q_a_proj.weight"), q_a_norm=loader.dense(a + "q_a_layernorm.weight"),
                        q_b=loader.linear(a + "q_b_proj.weight"))
        layer = Layer(attn, loader.dense(p + "input_layernorm.weight"),
                      loader.dense(p + "post_attention_layernorm.weight"))
        if i < d.first_dense:
            layer.mlp = loader.mlp(p + "mlp.", d.intermediate)
        else:
            layer.router = loader.dense(p + "mlp.gate.weight", torch.float32)
            layer.router_bias = loader.dense(p + "mlp.gate.e_score_correction_bias", torch.float32)
            layer.experts = loader.routed_experts(p + "mlp.", d.n_experts)
            if d.n_shared:
                layer.shared = loader.mlp(p + "mlp.shared_experts.", d.n_shared * d.moe_intermediate)
        layers.append(layer)
    return layers


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

class KVCache:
    """One sequence's cache, all layers in one tensor per kind: the expanded per-head keys and values
    (k_nope [L, S, H, nope], v [L, S, H, v]) and the shared roped key k_pe [L, S, rope], as the reference
    caches them. Rows are in insertion order; a block's rows are written by every layer and count once
    `commit` is called."""

    def __init__(self, d: Dims, capacity: int, dtype: torch.dtype, device):
        self.k_nope = torch.empty(d.layers, capacity, d.heads, d.nope, dtype=dtype, device=device)
        self.v = torch.empty(d.layers, capacity, d.heads, d.v, dtype=dtype, device=device)
        self.k_pe = torch.empty(d.layers, capacity, d.rope, dtype=dtype, device=device)
        self.length = 0

    def write(self, layer: int, k_nope: Tensor, k_pe: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store a block's rows after the committed ones; return every row of the layer up to them."""
        n, t = self.length, k_pe.shape[0]
        if n + t > self.k_pe.shape[1]:
            raise GpuEngineError(f"KV cache full: {n} + {t} rows > capacity {self.k_pe.shape[1]}")
        self.k_nope[layer, n:n + t], self.k_pe[layer, n:n + t], self.v[layer, n:n + t] = k_nope, k_pe, v
        return self.k_nope[layer, :n + t], self.k_pe[layer, :n + t], self.v[layer, :n + t]

    def commit(self, t: int) -> None:
        self.length += t

    def keep(self, rows: Tensor) -> None:
        """Keep only `rows` (old row of each new row, docs/ddtree.md §4), in that order, in every layer.
        The gather copies before the write, so overlapping moves are safe."""
        m = rows.numel()
        for buf in (self.k_nope, self.v, self.k_pe):
            buf[:, :m] = buf[:, rows]
        self.length = m


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Statistics in float32 whatever x's dtype (HF's DeepseekV3RMSNorm), then the weight in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[..., 2i], x[..., 2i+1]) by angle i. x [T, ..., rope], cos/sin [T, rope/2]."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def swiglu(x: Tensor, mlp: MLP) -> Tensor:
    gate_up = torch.cat([linear(x, w) for w in mlp.gate_up], dim=-1)
    gate, up = gate_up.split(mlp.intermediate, dim=-1)
    return linear(F.silu(gate) * up, mlp.down)


def route(x: Tensor, layer: Layer, d: Dims) -> tuple[Tensor, Tensor]:
    """noaux_tc routing in float32: (expert ids [T, k] by descending biased score, ties to the lower id;
    mixing weights [T, k] float32, routed_scaling_factor folded in)."""
    scores = torch.sigmoid(x.float() @ layer.router.T)
    choice = scores + layer.router_bias  # the bias steers selection only
    t, e = choice.shape
    if d.n_group > 1:
        grouped = choice.view(t, d.n_group, e // d.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # sum of each group's top-2
        kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :d.topk_group]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // d.n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :d.top_k]
    weights = scores.gather(1, ids)
    if d.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * d.routed_scaling_factor


def routed_experts_dense(x: Tensor, ex: RoutedExperts, ids: Tensor, weights: Tensor) -> Tensor:
    """fused_moe's math for unquantized experts: gather each (token, expert) pair's weights, batched
    matmuls, SiLU*mul in x's dtype, float32 combine. Memory grows as tokens x k x 3 x I x H: fine for the
    pipeline's models (quantized experts of real sizes go through the kernel)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(k, dim=0)[:, :, None]
    gate, up = torch.bmm(ex.gate_up[flat], rows)[..., 0].chunk(2, dim=-1)
    y = torch.bmm(ex.down[flat], (F.silu(gate) * up)[:, :, None])[..., 0]
    return (weights[..., None] * y.float().view(t, k, -1)).sum(1).to(x.dtype)


def moe(x: Tensor, layer: Layer, d: Dims) -> tuple[Tensor, Tensor]:
    ids, weights = route(x, layer, d)
    ex = layer.experts
    if ex.packed is not None:
        y = fused_moe(x, ex.packed, ids, weights)
    else:
        y = routed_experts_dense(x, ex, ids, weights)
    if layer.shared is not None:
        y = y + swiglu(x, layer.shared)
    return y, ids


@dataclass
class Segment:
    """A block of new tokens of one sequence: tokens [T] and positions [T] (int64, on the device), its
    cache, and the mask over (cached rows, then the block) as bool [T, cache.length + T] (True = may
    attend); None = every cached row and the block causally."""
    tokens: Tensor
    positions: Tensor
    cache: KVCache
    mask: Tensor | None = None


def attention(x: Tensor, layer: Layer, i: int, args: ModelArgs, cos: Tensor, sin: Tensor,
              segs: list[tuple[slice, Segment]]) -> Tensor:
    """MLA: projections over all rows at once; scores and softmax in float32, per sequence against its cache."""
    d, w = args.dims, layer.attn
    r = x.shape[0]
    if d.q_lora_rank is None:
        q = linear(x, w["q"])
    else:
        q = linear(rms_norm(linear(x, w["q_a"]), w["q_a_norm"], args.latent_norm_eps), w["q_b"])
    q = q.view(r, d.heads, d.nope + d.rope)
    q_nope, q_pe = q[..., :d.nope], apply_rope(q[..., d.nope:], cos, sin)
    kv_a = linear(x, w["kv_a"])  # the kv latent and the single-head rope key in one projection
    latent = rms_norm(kv_a[:, :d.kv_lora_rank], w["kv_a_norm"], args.latent_norm_eps)
    k_pe = apply_rope(kv_a[:, d.kv_lora_rank:], cos, sin)
    kv = linear(latent, w["kv_b"]).view(r, d.heads, d.nope + d.v)
    k_nope, v = kv[..., :d.nope], kv[..., d.nope:]

    out = torch.empty(r, d.heads, d.v, dtype=x.dtype, device=x.device)
    for rows, seg in segs:
        t = rows.stop - rows.start
        k_all, kpe_all, v_all = seg.cache.write(i, k_nope[rows], k_pe[rows], v[rows])
        scores = (torch.einsum("thd,shd->hts", q_nope[rows].float(), k_all.float())
                  + torch.einsum("thd,sd->hts", q_pe[rows].float(), kpe_all.float())) * args.softmax_scale
        if seg.mask is not None:
            scores = scores.masked_fill(~seg.mask, float("-inf"))
        elif t > 1:  # causal over the block
            n = seg.cache.length
            causal = torch.ones(t, n + t, dtype=torch.bool, device=x.device).tril(n)
            scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out[rows] = torch.einsum("hts,shd->thd", probs, v_all)
    return linear(out.view(r, d.heads * d.v), w["o"])


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

@dataclass
class ForwardOutput:
    logits: Tensor                                    # [rows, vocab] float32 (rows: all, or each segment's last)
    hidden: Tensor | None = None                      # [layers, segments, hidden]: each segment's last row (record)
    router_ids: list[Tensor] = field(default_factory=list)  # per MoE layer [segments, k] (record)
    router_rows: list[Tensor] = field(default_factory=list)  # per MoE layer [rows, k]: every fed row (record)


class Transformer:
    def __init__(self, bundle, meta: Mapping, dtype: torch.dtype, device, max_positions: int):
        self.args = args = ModelArgs.from_bundle_metadata(meta)
        self.dtype, self.device = dtype, torch.device(device)
        loader = BundleLoader(bundle, meta, dtype, self.device)
        d = args.dims
        self.embed = loader.dense("model.embed_tokens.weight")
        self.layers = load_layers(loader, d)
        self.norm = loader.dense("model.norm.weight")
        self.lm_head = loader.linear("lm_head.weight")
        self.cos, self.sin = rope_cache(args, max_positions, dtype, self.device)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.args.dims, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, segments: list[Segment], last_only: bool = False, record: bool = False) -> ForwardOutput:
        """One pass over the weights for every segment's new tokens; attention per sequence."""
        d = self.args.dims
        sizes = [s.tokens.numel() for s in segments]
        ends = np.cumsum(sizes)
        segs = [(slice(int(e - n), int(e)), s) for e, n, s in zip(ends, sizes, segments)]
        positions = torch.cat([s.positions for s in segments])
        cos, sin = self.cos[positions], self.sin[positions]
        last = torch.as_tensor(ends - 1, device=self.device)
        x = self.embed[torch.cat([s.tokens for s in segments])]
        hidden, routed = [], []
        for i, layer in enumerate(self.layers):
            x = x + attention(rms_norm(x, layer.input_norm, d.eps), layer, i, self.args, cos, sin, segs)
            h = rms_norm(x, layer.post_norm, d.eps)
            if layer.mlp is not None:
                x = x + swiglu(h, layer.mlp)
            else:
                y, ids = moe(h, layer, d)
                x = x + y
                if record:
                    routed.append(ids)
            if record:
                hidden.append(x[last])
        for s, n in zip(segments, sizes):
            s.cache.commit(n)
        rows = x[last] if last_only else x
        logits = linear(rms_norm(rows, self.norm, d.eps), self.lm_head).float()
        return ForwardOutput(logits, torch.stack(hidden) if record else None, [r[last] for r in routed], routed)
