"""A numpy reference implementation of the DeepSeek-V3 / Kimi-K2 decoder (the golden-token oracle).

Read top to bottom: config parsing and RoPE/YaRN tables, the weight store, the KV cache, then the
building blocks (RMSNorm, MLA attention, SwiGLU MLP, the MoE router and experts) and finally
`ReferenceModel.forward`, which runs a block of new tokens at explicit positions against a cache
(`forward_many`: blocks of several sequences in one pass over the weights).

It follows transformers' DeepseekV3 op for op (tests/test_reference_vs_hf.py); docs/reference-model.md
lists each convention where implementations differ and which one this follows. It computes in float64
by default: the golden data is an oracle, so an engine should differ from it by its own rounding only.
With a `Rounder` (k2vec.model.precision) it emulates a reduced-precision engine instead: values are
rounded to the format at the op boundaries the rounder's schedule names (the noise model's runs).
The KV cache holds the expanded per-head keys and values, not the latent (docs/reference-model.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from k2vec.errors import ConfigError, K2VecError
from k2vec.model.limits import STREAM_BYTES
from k2vec.model.precision import EXACT, Rounder

HF_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm default, used by HF for q_a_layernorm and kv_a_layernorm


class ReferenceModelError(K2VecError):
    pass




# ---------------------------------------------------------------------------------------------
# Configuration and rotary tables
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    intermediate: int
    moe_intermediate: int
    layers: int
    heads: int
    n_experts: int
    n_shared: int
    top_k: int
    n_group: int
    topk_group: int
    first_dense: int
    q_lora_rank: int | None
    kv_lora_rank: int
    nope: int
    rope: int
    v: int
    eps: float
    routed_scaling_factor: float
    norm_topk_prob: bool

    @classmethod
    def from_config(cls, c: Mapping) -> "Dims":
        def need(key):
            if c.get(key) is None:
                raise ConfigError(key, "missing (required by the reference model)")
            return c[key]

        d = cls(
            vocab=int(need("vocab_size")), hidden=int(need("hidden_size")),
            intermediate=int(need("intermediate_size")), moe_intermediate=int(need("moe_intermediate_size")),
            layers=int(need("num_hidden_layers")), heads=int(need("num_attention_heads")),
            n_experts=int(c.get("n_routed_experts") or 0), n_shared=int(c.get("n_shared_experts") or 0),
            top_k=int(c.get("num_experts_per_tok") or 0), n_group=int(c.get("n_group") or 1),
            topk_group=int(c.get("topk_group") or 1), first_dense=int(c.get("first_k_dense_replace") or 0),
            q_lora_rank=None if c.get("q_lora_rank") is None else int(c["q_lora_rank"]),
            kv_lora_rank=int(need("kv_lora_rank")), nope=int(need("qk_nope_head_dim")),
            rope=int(need("qk_rope_head_dim")), v=int(need("v_head_dim")), eps=float(need("rms_norm_eps")),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        )
        if c.get("num_key_value_heads") not in (None, d.heads):
            raise ConfigError("num_key_value_heads",
                              "MLA has one kv head per query head; must equal num_attention_heads")
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError("hidden_act", f"only silu is implemented, got {c['hidden_act']!r}")
        if c.get("attention_bias"):
            raise ConfigError("attention_bias", "attention projections with bias are not implemented")
        if d.rope % 2:
            raise ConfigError("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        if d.first_dense < d.layers:  # there are MoE layers
            if d.n_experts <= 0 or d.top_k <= 0:
                raise ConfigError("n_routed_experts", "MoE layers need n_routed_experts and num_experts_per_tok > 0")
            if d.n_experts % d.n_group or d.n_experts // d.n_group < 2:
                raise ConfigError("n_group", "must divide n_routed_experts with at least 2 experts per group "
                                             "(the group score sums the top-2)")
            if not 1 <= d.topk_group <= d.n_group:
                raise ConfigError("topk_group", "must be in [1, n_group]")
            if d.top_k > d.topk_group * (d.n_experts // d.n_group):
                raise ConfigError("num_experts_per_tok", "more than the experts in the kept groups")
        return d


def rope_parameters(c: Mapping) -> dict:
    """The RoPE settings as one dict {rope_type, rope_theta, ...yarn keys}, from either the legacy
    (`rope_theta` + `rope_scaling`, as in DeepSeek/Kimi config.json) or the HF v5 (`rope_parameters`)
    spelling."""
    if c.get("rope_parameters"):
        p = dict(c["rope_parameters"])
    else:
        p = dict(c.get("rope_scaling") or {})
        p.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    p["rope_type"] = p.get("rope_type") or p.get("type") or "default"
    if p["rope_type"] not in ("default", "yarn"):
        raise ConfigError("rope_scaling.type", f"only default and yarn RoPE are implemented, got {p['rope_type']!r}")
    return p


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(c: Mapping, rope_dim: int) -> tuple[np.ndarray, float, float]:
    """(inv_freq [rope_dim/2] float64, attention_factor for cos/sin, softmax-scale multiplier)."""
    p = rope_parameters(c)
    theta = float(p["rope_theta"])
    pair = np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim
    inv_freq = 1.0 / theta ** pair
    if p["rope_type"] == "default":
        return inv_freq, 1.0, 1.0

    factor = p.get("factor")
    orig = float(p["original_max_position_embeddings"])
    if factor is None:  # HF: DeepSeek-style configs may leave factor implicit
        factor = float(c["max_position_embeddings"]) / orig
    factor = float(factor)
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32.0  # `or`: HF treats 0/None as "use the default"
    beta_slow = p.get("beta_slow") or 1.0

    # Pair index whose wavelength makes `rotations` turns over the original context.
    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp (HF and DeepSeek do the same)
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0 (high-frequency pairs): keep the original frequency; ramp 1: interpolate by `factor`.
    inv_freq = inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    softmax_mult = yarn_get_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return inv_freq, float(attention_factor), softmax_mult


# ---------------------------------------------------------------------------------------------
# Weights: fetched lazily by name, converted once to the compute dtype, kept in a bounded cache
# ---------------------------------------------------------------------------------------------

def to_float(arr: np.ndarray, dtype) -> np.ndarray:
    """Convert a stored tensor to `dtype`. A uint16 array is BF16 bits (that is how
    `k2vec.model.checkpoint.Checkpoint` exposes BF16, numpy having no bfloat16)."""
    arr = np.asarray(arr)
    if arr.dtype == np.uint16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(arr, dtype=dtype)


STREAM_BLOCK_BYTES = 32 << 20  # compute-dtype bytes of one block of rows


class WeightStore:
    """name -> weight in the compute dtype. Only what a forward touches is ever read (e.g. only the
    routed experts that some token picked); converted tensors are cached up to `cache_bytes`
    (None = no limit), least recently used evicted first. Weights over `stream_bytes` are streamed by
    `mm` and never cached.

    Optional methods of the source mapping, used when present: `shape_of(name)` (shape without reading
    data), `block(name, r0, r1)` (rows r0:r1 only, e.g. dequantized from INT4 without the rest) and
    `release(name)` (drop the pages of a tensor that has been used, e.g. of a whole-file mmap)."""

    def __init__(self, weights: Mapping[str, np.ndarray], dtype, cache_bytes: int | None = None,
                 stream_bytes: int = STREAM_BYTES, round_weights=None):
        self.source, self.dtype, self.cache_bytes = weights, np.dtype(dtype), cache_bytes
        self.stream_bytes = stream_bytes
        self._round = round_weights   # a reduced-precision engine's weights in its format (None: as stored)
        self._cache: dict[str, np.ndarray] = {}
        self._bytes = 0

    def _convert(self, arr: np.ndarray) -> np.ndarray:
        out = to_float(arr, self.dtype)
        return out if self._round is None else self._round(out).astype(self.dtype, copy=False)

    def _get(self, name: str) -> np.ndarray:
        try:
            return self.source[name]
        except KeyError:
            raise ReferenceModelError(f"weight {name} is missing from the checkpoint") from None

    def _release(self, name: str) -> None:
        release = getattr(self.source, "release", None)
        if release is not None:
            release(name)

    def __call__(self, name: str) -> np.ndarray:
        hit = self._cache.pop(name, None)
        if hit is None:
            hit = self._convert(self._get(name))
            self._release(name)
            self._bytes += hit.nbytes
            while self.cache_bytes is not None and self._cache and self._bytes > self.cache_bytes:
                self._bytes -= self._cache.pop(next(iter(self._cache))).nbytes
        self._cache[name] = hit  # (re)insert at the end: most recently used
        return hit

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._cache:
            return self._cache[name].shape
        shape_of = getattr(self.source, "shape_of", None)
        return tuple(shape_of(name) if shape_of is not None else np.shape(self._get(name)))

    def mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W.T for the weight `name` [N, K]; over `stream_bytes`, a block of rows of W at a time (each
        block read, converted, multiplied and dropped), so memory holds one block, not W."""
        shape = self.shape(name)
        n, k = shape
        if n * k * self.dtype.itemsize <= self.stream_bytes:
            return x @ self(name).T
        block = getattr(self.source, "block", None)
        rows = max(1, STREAM_BLOCK_BYTES // (k * self.dtype.itemsize))
        out = np.empty((x.shape[0], n), self.dtype)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            w = block(name, r0, r1) if block is not None else np.asarray(self._get(name))[r0:r1]
            out[:, r0:r1] = x @ self._convert(w).T
            del w
        self._release(name)
        return out

    def rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Selected rows of a tensor without converting all of it (embedding lookup)."""
        out = self._convert(np.asarray(self._get(name))[index])
        self._release(name)
        return out


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

class KVCache:
    """Per layer: k_nope [H, S, nope], v [H, S, v] (per head, after kv_b_proj) and the shared roped
    k_pe [S, rope]; plus the position of every row. Rows are stored in insertion order; buffers grow
    by doubling so appending a token is amortised O(1)."""

    def __init__(self, dims: Dims, dtype, capacity: int = 64):
        self.dims, self.dtype = dims, np.dtype(dtype)
        self.length = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int):
        d = self.dims
        self.capacity = capacity
        self.k_nope = [np.empty((d.heads, capacity, d.nope), self.dtype) for _ in range(d.layers)]
        self.v = [np.empty((d.heads, capacity, d.v), self.dtype) for _ in range(d.layers)]
        self.k_pe = [np.empty((capacity, d.rope), self.dtype) for _ in range(d.layers)]
        self._positions = np.empty(capacity, np.int64)

    def _reserve(self, total: int):
        if total <= self.capacity:
            return
        old = (self.k_nope, self.v, self.k_pe, self._positions)
        n = self.length
        self._alloc(max(total, 2 * self.capacity))
        for i in range(self.dims.layers):
            self.k_nope[i][:, :n] = old[0][i][:, :n]
            self.v[i][:, :n] = old[1][i][:, :n]
            self.k_pe[i][:n] = old[2][i][:n]
        self._positions[:n] = old[3][:n]

    @property
    def positions(self) -> np.ndarray:
        return self._positions[: self.length]

    def write(self, layer: int, k_nope: np.ndarray, k_pe: np.ndarray, v: np.ndarray):
        """Put a block's rows at [length, length + T) of one layer; `commit` makes them count."""
        n, t = self.length, k_pe.shape[0]
        self._reserve(n + t)
        self.k_nope[layer][:, n : n + t] = k_nope
        self.v[layer][:, n : n + t] = v
        self.k_pe[layer][n : n + t] = k_pe

    def view(self, layer: int, upto: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.k_nope[layer][:, :upto], self.k_pe[layer][:upto], self.v[layer][:, :upto]

    def commit(self, positions: np.ndarray):
        t = len(positions)
        self._reserve(self.length + t)
        self._positions[self.length : self.length + t] = positions
        self.length += t

    def _rows(self, indices, what: str) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.length):
            raise ReferenceModelError(f"cache.{what}: index out of range [0, {self.length})")
        if np.unique(idx).size != idx.size:
            raise ReferenceModelError(f"cache.{what}: indices must be unique")
        return idx

    def keep(self, indices) -> None:
        """Keep only rows `indices` (unique, any order; the new row i is old row indices[i]).
        A tree verifier uses this to drop rejected branches after a masked forward."""
        idx = self._rows(indices, "keep")
        m = idx.size
        for i in range(self.dims.layers):  # fancy indexing copies first, so overlapping moves are safe
            self.k_nope[i][:, :m] = self.k_nope[i][:, idx]
            self.v[i][:, :m] = self.v[i][:, idx]
            self.k_pe[i][:m] = self.k_pe[i][idx]
        self._positions[:m] = self._positions[idx]
        self.length = m

    def gathered(self, indices, spare: int = 0) -> "KVCache":
        """A new cache holding rows `indices` of this one (unique, any order; its row i is row indices[i]),
        with room for `spare` more rows before it grows. Where several continuations branch off one cache
        (a verified tree whose paths several sequences accept), each gets its own without copying the
        source first; `spare` sizes it for its next block."""
        idx = self._rows(indices, "gathered")
        m = idx.size
        new = KVCache(self.dims, self.dtype, capacity=max(m + int(spare), 1))
        for i in range(self.dims.layers):
            new.k_nope[i][:, :m] = self.k_nope[i][:, idx]
            new.v[i][:, :m] = self.v[i][:, idx]
            new.k_pe[i][:m] = self.k_pe[i][idx]
        new._positions[:m], new.length = self._positions[idx], m
        return new

    def copy(self) -> "KVCache":
        """An independent cache with the same rows (e.g. to try one branch, then another)."""
        return self.gathered(np.arange(self.length))


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 + 0.5 * np.tanh(0.5 * x)  # = 1 / (1 + exp(-x)), without overflow for large |x|


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs (x[..., 2i], x[..., 2i+1]) by the angle of pair i.
    x: [T, ..., rope]; cos/sin: [T, rope/2], broadcast over the middle axes."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def causal_mask(n_cached: int, t: int) -> np.ndarray:
    """Boolean [t, n_cached + t]: every new token sees the whole cache and the new tokens up to itself."""
    return np.concatenate([np.ones((t, n_cached), bool), np.tri(t, dtype=bool)], axis=1)


def group_scores(grouped: np.ndarray) -> np.ndarray:
    """noaux_tc's group score: the sum of each group's two best biased scores
    ([T, groups, per group] -> [T, groups])."""
    return np.sum(np.sort(grouped, axis=-1)[..., -2:], axis=-1)


def route(logits: np.ndarray, bias: np.ndarray, d: Dims) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek-V3 noaux_tc routing for router logits [T, E].

    Returns (ids [T, k] in selection order: descending biased score, ties to the lower id;
    weights [T, k]; margin [T] = how near the selection is to changing: the k-th minus the (k+1)-th
    biased score after group masking (+inf when fewer than k+1 experts survive the group mask), or, where
    smaller, the last kept group's score minus the first dropped group's: a near-tie of groups swaps
    whole groups of experts while the experts inside the kept groups are far apart)."""
    t, e = logits.shape
    scores = sigmoid(logits)
    choice = scores + bias  # the bias steers selection only
    group_margin = np.full(t, np.inf)
    if d.n_group > 1:
        grouped = choice.reshape(t, d.n_group, e // d.n_group)
        group_score = group_scores(grouped)
        ranked = np.argsort(-group_score, axis=-1, kind="stable")
        keep = np.zeros((t, d.n_group), bool)
        np.put_along_axis(keep, ranked[:, : d.topk_group], True, axis=-1)
        choice = np.where(np.repeat(keep, e // d.n_group, axis=-1), choice, -np.inf)
        if d.topk_group < d.n_group:
            at = np.take_along_axis(group_score, ranked[:, d.topk_group - 1: d.topk_group + 1], axis=-1)
            group_margin = at[:, 0] - at[:, 1]
    order = np.argsort(-choice, axis=-1, kind="stable")
    ids = order[:, : d.top_k]
    kth = np.take_along_axis(choice, ids[:, -1:], axis=-1)[:, 0]
    if d.top_k < e:
        nxt = np.take_along_axis(choice, order[:, d.top_k : d.top_k + 1], axis=-1)[:, 0]
        margin = np.minimum(kth - nxt, group_margin)  # kth - nxt = +inf when the (k+1)-th is group-masked
    else:
        margin = group_margin
    weights = np.take_along_axis(scores, ids, axis=-1)  # unbiased scores mix the outputs
    if d.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * d.routed_scaling_factor, margin


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

@dataclass
class ForwardOutput:
    """What one forward over a block of T new tokens of one sequence observed."""
    logits: np.ndarray                     # [T, vocab] (or [1, vocab] with last_only)
    hidden: np.ndarray | None = None       # [layers, T, hidden]: residual stream after each layer (if record)
    router_ids: dict[int, np.ndarray] = field(default_factory=dict)      # MoE layer -> [T, k], selection order
    router_margins: dict[int, np.ndarray] = field(default_factory=dict)  # MoE layer -> [T]


@dataclass
class Segment:
    """A block of new tokens of one sequence, for `forward_many`. See `ReferenceModel.forward`."""
    tokens: np.ndarray
    cache: KVCache
    positions: np.ndarray | None = None
    mask: np.ndarray | None = None


class ReferenceModel:
    """DeepSeek-V3 forward in numpy. `weights` is any Mapping from DeepSeek-V3 tensor names to arrays
    (an mmap `Checkpoint`, a dict, a dequantizing loader); tensors are read on first use."""

    def __init__(self, config: Mapping, weights: Mapping[str, np.ndarray], dtype=np.float64,
                 latent_norm_eps: float | None = HF_LATENT_NORM_EPS, weight_cache_bytes: int | None = None,
                 rounding: Rounder = EXACT):
        self.config = dict(config)
        self.dims = d = Dims.from_config(self.config)
        self.dtype = np.dtype(dtype)
        self.latent_norm_eps = d.eps if latent_norm_eps is None else float(latent_norm_eps)
        self.r = rounding
        self.w = WeightStore(weights, self.dtype, weight_cache_bytes,
                             round_weights=None if rounding.exact else rounding.weights)
        self.inv_freq, self.attention_factor, softmax_mult = rope_tables(self.config, d.rope)
        self.softmax_scale = (d.nope + d.rope) ** -0.5 * softmax_mult
        self.moe_layers = [i for i in range(d.layers) if i >= d.first_dense]

    def new_cache(self, capacity: int = 64) -> KVCache:
        return KVCache(self.dims, self.dtype, capacity)

    # --- attention ---------------------------------------------------------------------------
    def _attention(self, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, segs: list[tuple]) -> np.ndarray:
        """MLA over rows x [R, hidden] that belong to the sequences `segs` = [(row slice, cache, additive mask)]:
        projections run on all rows at once, the softmax attention per sequence against its own cache."""
        d, w, mm, rnd, p = self.dims, self.w, self._mm, self.r, f"model.layers.{i}.self_attn."
        r = x.shape[0]
        if d.q_lora_rank is None:
            q = mm(x, p + "q_proj.weight")
        else:
            q_latent = rnd.norm(rms_norm(mm(x, p + "q_a_proj.weight"), w(p + "q_a_layernorm.weight"),
                                         self.latent_norm_eps))
            q = mm(q_latent, p + "q_b_proj.weight")
        q = q.reshape(r, d.heads, d.nope + d.rope)
        q_nope, q_pe = q[..., : d.nope], rnd.elementwise(apply_rope(q[..., d.nope :], cos, sin))

        # One shared projection gives the kv latent and the single-head rope key.
        kv_a = mm(x, p + "kv_a_proj_with_mqa.weight")
        latent = rnd.norm(rms_norm(kv_a[:, : d.kv_lora_rank], w(p + "kv_a_layernorm.weight"), self.latent_norm_eps))
        k_pe = rnd.cache(apply_rope(kv_a[:, d.kv_lora_rank :], cos, sin))
        kv = rnd.cache(mm(latent, p + "kv_b_proj.weight")).reshape(r, d.heads, d.nope + d.v)
        k_nope, v = kv[..., : d.nope].transpose(1, 0, 2), kv[..., d.nope :].transpose(1, 0, 2)  # [H, R, .]

        out = np.empty((d.heads, r, d.v), self.dtype)
        for rows, cache, mask in segs:
            t = rows.stop - rows.start
            cache.write(i, k_nope[:, rows], k_pe[rows], v[:, rows])
            k_nope_all, k_pe_all, v_all = cache.view(i, cache.length + t)
            # score[h, t, s] = q·k over [nope | rope]; the rope key is shared by all heads.
            scores = np.matmul(q_nope[rows].transpose(1, 0, 2), k_nope_all.transpose(0, 2, 1))
            scores += (q_pe[rows].reshape(t * d.heads, d.rope) @ k_pe_all.T).reshape(t, d.heads, -1).transpose(1, 0, 2)
            scores = rnd.scores(scores) * self.softmax_scale
            scores += mask  # additive, [t, S], broadcast over heads
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, rows] = np.matmul(rnd.softmax(probs), v_all)
        return mm(rnd.linear(out.transpose(1, 0, 2).reshape(r, d.heads * d.v)), p + "o_proj.weight")

    def _mm(self, x: np.ndarray, name: str) -> np.ndarray:
        """A projection: `WeightStore.mm`, its output in the engine's format where the schedule rounds there."""
        return self.r.linear(self.w.mm(x, name))

    # --- feed-forward ------------------------------------------------------------------------
    def _dense_mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        return self._swiglu(x, f"model.layers.{i}.mlp.")

    def _swiglu(self, x: np.ndarray, prefix: str) -> np.ndarray:
        """`swiglu` with the weights under `prefix`, each multiplied through `WeightStore.mm`."""
        mm, act = self._mm, self.r.elementwise
        return mm(act(act(silu(mm(x, prefix + "gate_proj.weight"))) * mm(x, prefix + "up_proj.weight")),
                  prefix + "down_proj.weight")

    def _moe(self, i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output, router ids, router margins) for rows x."""
        d, w, rnd, p = self.dims, self.w, self.r, f"model.layers.{i}.mlp."
        # the router's logits skip the projection rounding: engines route from float32 logits unless told
        ids, weights, margin = route(rnd.router(w.mm(x, p + "gate.weight")), w(p + "gate.e_score_correction_bias"), d)
        y = np.zeros_like(x)
        for e in np.unique(ids):  # each expert once, over all tokens routed to it
            rows, slot = np.nonzero(ids == e)  # a token picks an expert at most once: rows are unique
            h = self._swiglu(x[rows], f"{p}experts.{e}.")  # read (dequantized) only now: a token routed here
            y[rows] = rnd.combine(y[rows] + rnd.combine(weights[rows, slot, None] * h))
        if d.n_shared:  # shared experts: one SwiGLU of width n_shared * moe_intermediate, unweighted
            y = rnd.combine(y + self._swiglu(x, p + "shared_experts."))
        return y, ids, margin

    # --- whole forward -----------------------------------------------------------------------
    def forward(self, tokens, positions=None, cache: KVCache | None = None, mask=None,
                record: bool = False, last_only: bool = False) -> ForwardOutput:
        """Run T new tokens of one sequence through the model, appending their keys/values to `cache`.

        tokens:    int [T].
        positions: int [T] RoPE positions; default cache.length + arange(T).
        cache:     KVCache to read and extend (a fresh one if None). Rows are appended in token order.
        mask:      [T, cache.length + T] over (cached rows, then new tokens): bool (True = may attend)
                   or additive float (0 / -inf). Default causal: all cached rows plus earlier new tokens.
        record:    also return hidden states after every layer and the MoE router choices.
        last_only: logits of the last token only (skips the LM head for the others).
        """
        cache = self.new_cache() if cache is None else cache
        return self.forward_many([Segment(tokens, cache, positions, mask)], record, last_only)[0]

    def _prepare(self, seg: Segment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated (tokens, positions, additive mask) of a segment."""
        tokens = np.asarray(seg.tokens, dtype=np.int64).reshape(-1)
        t, n = tokens.size, seg.cache.length
        if t == 0:
            raise ReferenceModelError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= self.dims.vocab:
            raise ReferenceModelError(f"token id out of range [0, {self.dims.vocab})")
        positions = n + np.arange(t) if seg.positions is None else np.asarray(seg.positions, np.int64).reshape(-1)
        if positions.size != t:
            raise ReferenceModelError(f"{positions.size} positions for {t} tokens")
        if seg.mask is None:
            return tokens, positions, np.where(causal_mask(n, t), 0.0, -np.inf).astype(self.dtype)
        mask = np.asarray(seg.mask)
        if mask.shape != (t, n + t):
            raise ReferenceModelError(f"mask shape {mask.shape}, expected {(t, n + t)} (new tokens x cached+new)")
        additive = np.where(mask, 0.0, -np.inf).astype(self.dtype) if mask.dtype == bool else mask.astype(self.dtype)
        if np.isneginf(additive).all(axis=-1).any():
            raise ReferenceModelError("mask: a token that attends to nothing")
        return tokens, positions, additive

    def forward_many(self, segments: list[Segment], record: bool = False,
                     last_only: bool = False) -> list[ForwardOutput]:
        """`forward` for blocks of several sequences (each with its own cache) in one pass: every
        row-wise op (projections, MoE, LM head) runs once over all rows, so decoding a batch of prompts
        reads each weight once per step. Only attention is per sequence. Results equal separate
        `forward` calls up to BLAS blocking (~1e-16 relative in float64)."""
        if not segments:
            return []
        if len({id(s.cache) for s in segments}) != len(segments):
            raise ReferenceModelError("forward_many: each segment needs its own cache")
        d = self.dims
        prepared = [self._prepare(s) for s in segments]
        ends = np.cumsum([tok.size for tok, _, _ in prepared])
        slices = [slice(int(e - tok.size), int(e)) for e, (tok, _, _) in zip(ends, prepared)]
        segs = [(sl, s.cache, mask) for sl, s, (_, _, mask) in zip(slices, segments, prepared)]
        positions = np.concatenate([pos for _, pos, _ in prepared])
        angles = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = self.r.elementwise((np.cos(angles) * self.attention_factor).astype(self.dtype))
        sin = self.r.elementwise((np.sin(angles) * self.attention_factor).astype(self.dtype))

        hidden = np.empty((d.layers, int(ends[-1]), d.hidden), self.dtype) if record else None
        routed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rnd = self.r
        x = self.w.rows("model.embed_tokens.weight", np.concatenate([tok for tok, _, _ in prepared]))
        for i in range(d.layers):
            p = f"model.layers.{i}."
            h = rnd.norm(rms_norm(x, self.w(p + "input_layernorm.weight"), d.eps))
            x = rnd.residual(x + self._attention(i, h, cos, sin, segs))
            h = rnd.norm(rms_norm(x, self.w(p + "post_attention_layernorm.weight"), d.eps))
            if i < d.first_dense:
                x = rnd.residual(x + self._dense_mlp(i, h))
            else:
                y, ids, margin = self._moe(i, h)
                x = rnd.residual(x + y)
                routed[i] = (ids, margin)
            if record:
                hidden[i] = x
        for (_, pos, _), s in zip(prepared, segments):
            s.cache.commit(pos)

        rows = x[ends - 1] if last_only else x
        logits = rnd.logits(self.w.mm(rnd.norm(rms_norm(rows, self.w("model.norm.weight"), d.eps)), "lm_head.weight"))
        outs = []
        for j, sl in enumerate(slices):
            out = ForwardOutput(logits=logits[j : j + 1] if last_only else logits[sl])
            if record:
                out.hidden = hidden[:, sl]
                out.router_ids = {i: ids[sl] for i, (ids, _) in routed.items()}
                out.router_margins = {i: m[sl] for i, (_, m) in routed.items()}
            outs.append(out)
        return outs
