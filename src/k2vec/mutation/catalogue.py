"""The mutant catalogue: the numpy engine with one deliberate, realistic fault, selected by name.

Each mutant is a bug that native W4A16 / MLA / MoE / DDTree engines ship or could easily ship (docs/mutants.md
says which, one line each). The mutation run (workflow/rules/mutation.smk, `snakemake mutation_report`) runs
every mutant through the same engine runs as the numpy engine, `--mutant NAME` on its command line, and the
report's mutation score (k2vec.mutation.score) says which of them the vectors catch, where and how often.

How a fault is injected: `injected(name)` is a context manager yielding `install(model)`, which the numpy
engine calls on its freshly built `ReferenceModel`. `install` swaps exactly one thing (an attribute of the
model or of its bundle weights, a function of k2vec.reference.model or k2vec.reference.speculative, a method
of KVCache) and the context restores all of it on exit. Nothing is patched outside an engine process
started with `--mutant` (or a test's `with injected(...)`), and the unmutated engine never imports this module.

`exercised(model, quantization, precision, kind, budget)` says whether a run executes the mutated code at all
(an INT4 decoding bug in a run on fp32 weights does not; a tree-mask bug in a one-node tree does not): the
mutation run schedules a mutant only on those runs, and its catch rate counts only their rows.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from k2vec.errors import K2VecError
from k2vec.model.conventions import CONVENTIONS
from k2vec.model.int4 import round_to_bf16
from k2vec.reference import model as ref
from k2vec.reference import speculative
from k2vec.reference.model import (HF_LATENT_NORM_EPS, KVCache, ReferenceModel, rope_parameters, rope_tables,
                                   yarn_get_mscale)

AREAS = ("int4", "rope", "mla", "router", "experts", "head", "ddtree")


class MutantError(K2VecError):
    pass


class Patcher:
    """setattr with undo: every change is recorded and `restore` puts the old value (or absence) back."""

    def __init__(self):
        self._undo: list[tuple[Any, str, bool, Any]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        own = attr in vars(obj)  # an instance's own attribute, or one found on its class
        self._undo.append((obj, attr, own, vars(obj).get(attr)))
        setattr(obj, attr, value)

    def restore(self) -> None:
        while self._undo:
            obj, attr, own, old = self._undo.pop()
            if own:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    changes: str        # what it changes, one line
    stands_for: str     # the real-world bug, one line
    install: Callable[[Patcher, ReferenceModel], None]
    needs: Callable[[Mapping, Mapping, str, str, int], bool]  # (model, quantization, precision, kind, budget)

    def exercised(self, model: Mapping, quantization: Mapping, precision: str, kind: str, budget: int) -> bool:
        return bool(self.needs(model, quantization, precision, kind, budget))


# ------------------------------------------------------------------------------ when code paths run

def _always(m, q, precision, kind, budget) -> bool:
    return True


def _int4(m, q, precision, kind, budget) -> bool:
    return precision == "int4"


def _int4_float32_scales(m, q, precision, kind, budget) -> bool:
    return precision == "int4" and q.get("scale_dtype") == "float32"


def _yarn(m, q, precision, kind, budget) -> bool:
    return rope_parameters(m)["rope_type"] == "yarn"


def _yarn_attention_factor(m, q, precision, kind, budget) -> bool:
    # only where the plain get_mscale(factor) differs from the factor the config asks for
    return _yarn(m, q, precision, kind, budget) and \
        yarn_get_mscale(_yarn_factor(m)) != rope_tables(m, int(m["qk_rope_head_dim"]))[1]


def _mscale_softmax(m, q, precision, kind, budget) -> bool:
    return rope_tables(m, int(m["qk_rope_head_dim"]))[2] != 1.0


def _decoding(m, q, precision, kind, budget) -> bool:
    return kind in ("greedy", "score")  # DDTree passes explicit positions


def _q_lora(m, q, precision, kind, budget) -> bool:
    return m.get("q_lora_rank") is not None


def _latent_eps_differs(m, q, precision, kind, budget) -> bool:
    return CONVENTIONS["latent_norm_eps_rms"].settings(m)["latent_norm_eps"] != HF_LATENT_NORM_EPS


def _moe(m, q, precision, kind, budget) -> bool:
    return int(m["num_hidden_layers"]) > int(m.get("first_k_dense_replace") or 0)


def _grouped(m, q, precision, kind, budget) -> bool:
    return _moe(m, q, precision, kind, budget) and int(m.get("topk_group") or 1) < int(m.get("n_group") or 1)


def _renormalised(m, q, precision, kind, budget) -> bool:
    return _moe(m, q, precision, kind, budget) and bool(m.get("norm_topk_prob"))


def _scaled(m, q, precision, kind, budget) -> bool:
    return _moe(m, q, precision, kind, budget) and float(m.get("routed_scaling_factor", 1.0)) != 1.0


def _shared(m, q, precision, kind, budget) -> bool:
    return _moe(m, q, precision, kind, budget) and int(m.get("n_shared_experts") or 0) > 0


def _tree(m, q, precision, kind, budget) -> bool:
    return kind == "ddtree" and budget > 1  # a one-node tree has no branches: mask, positions, compaction agree


# ------------------------------------------------------------------------------------------ INT4

def _swap_weights(p: Patcher, model: ReferenceModel, decode: Callable[[str, Callable[[str], np.ndarray]], np.ndarray]):
    """Route every weight fetch of the model through decode(name, fetch) (a loader bug)."""
    source = model.w.source

    class Remapped(Mapping):
        def __getitem__(self, name):
            return decode(name, source.__getitem__)

        def __iter__(self):
            return iter(source)

        def __len__(self):
            return len(source)

    p.set(model.w, "source", Remapped())


def _bundle_weights(model: ReferenceModel):
    return model.w.source  # the numpy engine's BundleWeights


def _nibble_order(p, model):
    def unpack(packed):
        first = (packed >> 4).astype(np.int8) - 8   # element 2j read from the high nibble, 2j+1 from the low
        second = (packed & 0x0F).astype(np.int8) - 8
        return np.stack([first, second], axis=-1).reshape(packed.shape[0], -1)
    p.set(_bundle_weights(model), "unpack", unpack)


def _zero_point_7(p, model):
    def unpack(packed):
        low = (packed & 0x0F).astype(np.int8) - 7
        high = (packed >> 4).astype(np.int8) - 7
        return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)
    p.set(_bundle_weights(model), "unpack", unpack)


def _twos_complement(p, model):
    def unpack(packed):
        nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
        return np.where(nib >= 8, nib - 16, nib).astype(np.int8).reshape(packed.shape[0], -1)  # signed int4
    p.set(_bundle_weights(model), "unpack", unpack)


def _scale_group_off_by_one(p, model):
    def dequantize(codes, scales, group):
        n, k = codes.shape
        # element k takes the scale of group (k + 1) // group: each group's last element the next one's
        idx = np.minimum((np.arange(k) + 1) // group, k // group - 1)
        return codes.astype(np.float32) * scales.astype(np.float32)[:, idx]
    p.set(_bundle_weights(model), "dequantize", dequantize)


def _scale_transposed(p, model):
    bw = _bundle_weights(model)
    stored = bw.scales

    def scales(name):
        s = np.asarray(stored(name))
        return s.reshape(s.shape[1], s.shape[0]).T  # the [N, K/G] bytes read as a [K/G, N] matrix
    p.set(bw, "scales", scales)


def _scale_bf16(p, model):
    bw = _bundle_weights(model)
    stored = bw.scales
    p.set(bw, "scales", lambda name: round_to_bf16(np.asarray(stored(name), np.float32)))


# ------------------------------------------------------------------------------------- RoPE / YaRN

def _yarn_factor(config: Mapping) -> float:
    p = rope_parameters(config)
    f = p.get("factor")
    return float(f) if f is not None else float(config["max_position_embeddings"]) / float(
        p["original_max_position_embeddings"])


def _unscaled_inv_freq(model: ReferenceModel) -> np.ndarray:
    plain = {**model.config, "rope_scaling": None, "rope_parameters": None,
             "rope_theta": rope_parameters(model.config)["rope_theta"]}
    return rope_tables(plain, model.dims.rope)[0]


def _yarn_ramp(model: ReferenceModel) -> np.ndarray:
    """The reference's interpolation ramp per pair (0: original frequency, 1: divided by the factor),
    recovered from its blended frequencies."""
    base, factor = _unscaled_inv_freq(model), _yarn_factor(model.config)
    return np.clip((1.0 - model.inv_freq / base) / (1.0 - 1.0 / factor), 0.0, 1.0)


def _yarn_ramp_swapped(p, model):
    base, factor, ramp = _unscaled_inv_freq(model), _yarn_factor(model.config), _yarn_ramp(model)
    p.set(model, "inv_freq", base / factor * (1.0 - ramp) + base * ramp)


def _yarn_interpolation_skipped(p, model):
    p.set(model, "inv_freq", _unscaled_inv_freq(model))


def _yarn_linear(p, model):
    p.set(model, "inv_freq", _unscaled_inv_freq(model) / _yarn_factor(model.config))


def _yarn_attention_factor_plain(p, model):
    p.set(model, "attention_factor", yarn_get_mscale(_yarn_factor(model.config)))


def _rope_half_split(p, model):
    def apply_rope(x, cos, sin):
        shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        h = x.shape[-1] // 2
        first, second = x[..., :h], x[..., h:]  # pairs (x[i], x[i + d/2]): the NeoX layout
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    p.set(ref, "apply_rope", apply_rope)


def _rope_decode_position(p, model):
    prepare = model._prepare

    def shifted(seg):
        tokens, positions, mask = prepare(seg)
        # a block after the prefill, at implicit positions (greedy and score decoding), starts one too early
        return tokens, positions - 1 if seg.positions is None and seg.cache.length else positions, mask
    p.set(model, "_prepare", shifted)


# ------------------------------------------------------------------------------------------- MLA

def _latent_eps_rms(p, model):
    # the convention's own variant (what the report recognises), set on the engine's model
    for name, value in CONVENTIONS["latent_norm_eps_rms"].settings(model.config).items():
        p.set(model, name, value)


def _softmax_no_mscale(p, model):
    p.set(model, "softmax_scale", (model.dims.nope + model.dims.rope) ** -0.5)


def _softmax_nope_dim(p, model):
    d = model.dims
    p.set(model, "softmax_scale", model.softmax_scale * ((d.nope + d.rope) / d.nope) ** 0.5)


def _q_norm_skipped(p, model):
    # The q_a_layernorm weights as the model's weight store holds them (it keeps every fetched tensor).
    skip = {id(model.w(f"model.layers.{i}.self_attn.q_a_layernorm.weight")) for i in range(model.dims.layers)}
    norm = ref.rms_norm
    p.set(ref, "rms_norm", lambda x, weight, eps: x if id(weight) in skip else norm(x, weight, eps))


def _kv_rope_key_off_by_one(p, model):
    view = KVCache.view

    def shifted(self, layer, upto):
        k_nope, k_pe, v = view(self, layer, upto)
        return k_nope, np.concatenate([k_pe[:1], k_pe[:-1]]), v  # row s gets row s-1's rope key
    p.set(KVCache, "view", shifted)


# ----------------------------------------------------------------------------------------- router

def _route_with(p, wrapper):
    route = ref.route
    p.set(ref, "route", lambda logits, bias, d: wrapper(route, logits, bias, d))


def _bias_ignored(p, model):
    _route_with(p, lambda route, logits, bias, d: route(logits, np.zeros_like(bias), d))


def _bias_in_weights(p, model):
    def wrapper(route, logits, bias, d):
        ids, _, margin = route(logits, bias, d)
        w = np.take_along_axis(ref.sigmoid(logits) + bias, ids, axis=-1)  # biased scores mix the outputs
        if d.norm_topk_prob:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return ids, w * d.routed_scaling_factor, margin
    _route_with(p, wrapper)


def _no_renorm(p, model):
    _route_with(p, lambda route, logits, bias, d: route(logits, bias, dataclasses.replace(d, norm_topk_prob=False)))


def _no_scaling(p, model):
    _route_with(p,
                lambda route, logits, bias, d: route(logits, bias, dataclasses.replace(d, routed_scaling_factor=1.0)))


def _groups_ignored(p, model):
    _route_with(p, lambda route, logits, bias, d: route(logits, bias, dataclasses.replace(d, n_group=1, topk_group=1)))


def _softmax_scoring(p, model):
    def wrapper(route, logits, bias, d):
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = np.clip(z / z.sum(axis=-1, keepdims=True), 1e-300, 1 - 1e-16)
        return route(np.log(probs) - np.log1p(-probs), bias, d)  # sigmoid(logit(p)) = p: softmax scores
    _route_with(p, wrapper)


def _group_max(p, model):
    p.set(ref, "group_scores", lambda grouped: grouped.max(axis=-1))


def _renorm_biased_sum(p, model):
    def wrapper(route, logits, bias, d):
        ids, _, margin = route(logits, bias, d)
        scores = ref.sigmoid(logits)
        w = np.take_along_axis(scores, ids, axis=-1)
        biased = np.take_along_axis(scores + bias, ids, axis=-1)
        return ids, w / (biased.sum(axis=-1, keepdims=True) + 1e-20) * d.routed_scaling_factor, margin
    _route_with(p, wrapper)


def _scaling_v3_value(p, model):
    _route_with(p, lambda route, logits, bias, d: route(
        logits, bias, dataclasses.replace(d, routed_scaling_factor=d.routed_scaling_factor * 2.5 / 2.827)))


def _scaled_by(factor: float):
    """routed_scaling_factor x `factor`: the routed experts' mixing weights off by (1 - factor)."""
    def install(p, model):
        _route_with(p, lambda route, logits, bias, d: route(
            logits, bias, dataclasses.replace(d, routed_scaling_factor=d.routed_scaling_factor * factor)))
    return install


def _truncated_scale(m) -> float:
    """routed_scaling_factor cut to one decimal (2.827 -> 2.8), as a fraction of itself."""
    f = float(m.get("routed_scaling_factor", 1.0))
    return np.floor(f * 10) / 10 / f


def _scale_truncated(p, model):
    _scaled_by(_truncated_scale({"routed_scaling_factor": model.dims.routed_scaling_factor}))(p, model)


def _truncation_changes(m, q, precision, kind, budget) -> bool:
    return _scaled(m, q, precision, kind, budget) and _truncated_scale(m) != 1.0


def _router_logits_bf16(p, model):
    _route_with(p, lambda route, logits, bias, d: route(round_to_bf16(logits.astype(np.float32)).astype(logits.dtype),
                                                        bias, d))


# ---------------------------------------------------------------------------------------- experts

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


def _shared_dropped(p, model):
    p.set(model, "dims", dataclasses.replace(model.dims, n_shared=0))


def _shared_scaled(p, model):
    swiglu = model._swiglu

    def scaled(x, prefix):
        y = swiglu(x, prefix)
        return y * model.dims.routed_scaling_factor if prefix.endswith(".shared_experts.") else y
    p.set(model, "_swiglu", scaled)


def _gelu(p, model):
    p.set(ref, "silu", lambda x: 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3))))


def _gate_up_swapped(p, model):
    def decode(name, fetch):
        m = _EXPERT.match(name)
        if m and m.group(3) in (".gate_proj.weight", ".up_proj.weight"):
            other = ".up_proj.weight" if m.group(3) == ".gate_proj.weight" else ".gate_proj.weight"
            return fetch(m.group(1) + m.group(2) + other)
        return fetch(name)
    _swap_weights(p, model, decode)


def _expert_offset(p, model):
    n = model.dims.n_experts

    def decode(name, fetch):
        m = _EXPERT.match(name)
        return fetch(f"{m.group(1)}{(int(m.group(2)) + 1) % n}{m.group(3)}") if m else fetch(name)
    _swap_weights(p, model, decode)


# ------------------------------------------------------------------------------ LM head, final norm

def _lm_head_tied(p, model):
    _swap_weights(p, model,
                  lambda name, fetch: fetch("model.embed_tokens.weight" if name == "lm_head.weight" else name))


def _final_norm_weight_missing(p, model):
    _swap_weights(p, model, lambda name, fetch: (np.ones_like(fetch(name)) if name == "model.norm.weight"
                                                 else fetch(name)))


# ----------------------------------------------------------------------------------------- DDTree

def _tree_mask_causal(p, model):
    # Lower-triangular over node index. The verifier's mask is that of the union of the trees of the jobs in one
    # state (k2vec.reference.speculative), built by this function, not Tree.visibility.
    p.set(speculative, "ancestor_visibility", lambda parents, depths: np.tri(len(parents), dtype=bool))


def _tree_positions_index(p, model):
    p.set(speculative, "tree_positions", lambda tree, start: int(start) + np.arange(tree.n + 1, dtype=np.int64))


def _bonus_chain_index(p, model):
    walk = speculative.accept_walk

    def accept(tree, target_argmax):
        accepted, _ = walk(tree, target_argmax)
        return accepted, int(np.asarray(target_argmax)[len(accepted) - 1])  # the row as if the path were a chain
    p.set(speculative, "accept_walk", accept)


def _kv_compaction_prefix(p, model):
    p.set(speculative, "compacted_kv_rows",
          lambda past, accepted: np.arange(past + len(accepted), dtype=np.int64))  # the first rows, not the accepted


# ---------------------------------------------------------------------------------------- catalogue

def _m(name, area, needs, install, changes, stands_for) -> Mutant:
    return Mutant(name, area, changes, stands_for, install, needs)


CATALOGUE: tuple[Mutant, ...] = (
    _m("int4_nibble_order", "int4", _int4, _nibble_order,
       "element 2j read from the high nibble and 2j+1 from the low",
       "packing order mismatch between a checkpoint and a kernel's unpack (GPTQ/AWQ/compressed-tensors layouts)"),
    _m("int4_zero_point_7", "int4", _int4, _zero_point_7,
       "stored nibble minus 7 instead of minus 8",
       "symmetric INT4 decoded with the wrong zero point (7 vs 8), an off-by-one in the offset"),
    _m("int4_twos_complement", "int4", _int4, _twos_complement,
       "nibbles read as signed two's-complement int4 instead of q + 8",
       "an engine whose kernels take signed int4 fed the offset-binary compressed-tensors bytes"),
    _m("int4_scale_group_off_by_one", "int4", _int4, _scale_group_off_by_one,
       "element k uses the scale of group (k+1)//32: each group's last weight takes the next group's scale",
       "group index computed with an off-by-one at the group boundary"),
    _m("int4_scale_transposed", "int4", _int4, _scale_transposed,
       "the [N, K/G] scale matrix read as if stored [K/G, N]",
       "scales in the wrong major order (K-major kernel layout vs the checkpoint's N-major)"),
    _m("int4_scale_bf16", "int4", _int4_float32_scales, _scale_bf16,
       "float32 scales rounded to bfloat16 before use",
       "a W4A16 kernel that only takes bf16 scales, silently narrowing a float32-scale checkpoint"),
    _m("yarn_ramp_swapped", "rope", _yarn, _yarn_ramp_swapped,
       "YaRN interpolates the high-frequency pairs and keeps the low-frequency ones (ramp reversed)",
       "the inv_freq mask used as 1 - mask (DeepSeek's `inv_freq_mask` convention inverted)"),
    _m("yarn_interpolation_skipped", "rope", _yarn, _yarn_interpolation_skipped,
       "the interpolation factor never applied: plain RoPE frequencies (mscale kept)",
       "rope_scaling read for mscale only, its frequency interpolation dropped"),
    _m("yarn_linear_interpolation", "rope", _yarn, _yarn_linear,
       "every frequency divided by the factor (linear position interpolation) instead of the YaRN ramp",
       "YaRN implemented as plain position interpolation ('linear' rope scaling)"),
    _m("yarn_attention_factor_plain", "rope", _yarn_attention_factor, _yarn_attention_factor_plain,
       "cos/sin scaled by get_mscale(factor) instead of mscale/mscale_all_dim's ratio",
       "Llama-style YaRN attention factor applied to a DeepSeek config (whose ratio is 1)"),
    _m("rope_half_split", "rope", _always, _rope_half_split,
       "RoPE rotates (x[i], x[i+d/2]) pairs instead of interleaved (x[2i], x[2i+1])",
       "NeoX vs GPT-J rotary layout confused (DeepSeek's rope_interleave)"),
    _m("rope_decode_position_off_by_one", "rope", _decoding, _rope_decode_position,
       "decode steps placed at cache length - 1: each new token at its predecessor's position",
       "the decode position taken as the last position instead of the next one"),
    _m("mla_latent_norm_eps_rms", "mla", _latent_eps_differs, _latent_eps_rms,
       "q_a_layernorm / kv_a_layernorm epsilon rms_norm_eps (1e-5 in the presets) instead of 1e-6",
       "vLLM/SGLang passing config.rms_norm_eps to the latent norms, where transformers uses 1e-6"),
    _m("mla_softmax_no_mscale", "mla", _mscale_softmax, _softmax_no_mscale,
       "softmax scale qk_head_dim**-0.5 without YaRN's mscale(factor, mscale_all_dim)**2",
       "the YaRN softmax correction left out of an attention kernel's scale"),
    _m("mla_softmax_scale_nope_dim", "mla", _always, _softmax_nope_dim,
       "softmax scale from qk_nope_head_dim instead of qk_nope + qk_rope",
       "head_dim taken from the wrong config field for the attention scale"),
    _m("mla_q_norm_skipped", "mla", _q_lora, _q_norm_skipped,
       "q_a_layernorm skipped: the query latent goes to q_b_proj unnormalised",
       "a fused q_a/q_b projection that forgets the norm between them"),
    _m("mla_kv_rope_key_off_by_one", "mla", _always, _kv_rope_key_off_by_one,
       "each cached row's rope key read from the row before it",
       "separate latent and rope-key caches indexed with an off-by-one slot"),
    _m("router_bias_ignored", "router", _moe, _bias_ignored,
       "e_score_correction_bias not added before the top-k",
       "noaux_tc's correction bias dropped by a loader or kernel"),
    _m("router_bias_in_weights", "router", _moe, _bias_in_weights,
       "the mixing weights taken from the biased scores",
       "the selection bias leaking into the expert weights"),
    _m("router_groups_ignored", "router", _grouped, _groups_ignored,
       "no group-limited selection: top-k over all experts",
       "n_group/topk_group ignored (Kimi K2 has one group, so engines tuned on it skip the step)"),
    _m("router_no_renorm", "router", _renormalised, _no_renorm,
       "top-k weights not renormalised (norm_topk_prob ignored)",
       "norm_topk_prob dropped from the config or the fused top-k kernel"),
    _m("router_scaling_missing", "router", _scaled, _no_scaling,
       "routed_scaling_factor not applied",
       "the routed scaling factor forgotten (or applied to the shared expert instead)"),
    _m("router_softmax_scores", "router", _moe, _softmax_scoring,
       "softmax router scores instead of sigmoid",
       "DeepSeek-V2 scoring_func reused for V3/K2"),
    _m("router_group_max", "router", _grouped, _group_max,
       "each group scored by its best expert instead of the sum of its best two",
       "DeepSeek-V2's group_limited_greedy group score reused for V3/K2's noaux_tc"),
    _m("router_renorm_biased_sum", "router", _renormalised, _renorm_biased_sum,
       "top-k weights normalised by the sum of their biased scores (the selection scores)",
       "a fused top-k kernel that renormalises with the scores it sorted by"),
    _m("router_scaling_v3_value", "router", _scaled, _scaling_v3_value,
       "routed_scaling_factor 12% low: x 2.5 / 2.827",
       "DeepSeek-V3's routed_scaling_factor 2.5 hard-coded in an engine run on Kimi K2 (2.827)"),
    # with router_scaling_v3_value (12%) and router_scaling_missing, the mixing-weight ladder
    # (report/resolution.py MIXING_LADDER): a bundle's resolution in mixing-weight terms
    _m("router_scaling_truncated", "router", _truncation_changes, _scale_truncated,
       "routed_scaling_factor cut to one decimal: 2.827 -> 2.8 (1% low)",
       "a scaling constant typed in by hand from the model card"),
    _m("router_scaling_5pct_low", "router", _scaled, _scaled_by(0.95),
       "routed experts' mixing weights 5% low: routed_scaling_factor x 0.95",
       "a mixing weight scaled twice by a near-1 factor (a partial fold of a scale into the weights)"),
    _m("router_scaling_10pct_low", "router", _scaled, _scaled_by(0.9),
       "routed experts' mixing weights 10% low: routed_scaling_factor x 0.9",
       "a routed scale folded into quantized expert weights and applied again at 90%"),
    _m("router_logits_bf16", "router", _moe, _router_logits_bf16,
       "router logits rounded to bfloat16 before scoring",
       "the gate GEMM run in bf16 where the reference routes in float32"),
    _m("experts_shared_dropped", "experts", _shared, _shared_dropped,
       "the shared expert's output not added",
       "shared experts lost when the MoE layer is fused or expert-parallel"),
    _m("experts_shared_scaled", "experts", _shared, _shared_scaled,
       "the shared expert's output multiplied by routed_scaling_factor too",
       "the routed scaling applied to the whole MoE output, shared expert included"),
    _m("experts_gelu", "experts", _always, _gelu,
       "GELU (tanh) instead of SiLU in every SwiGLU MLP",
       "hidden_act mapped to the wrong activation kernel"),
    _m("experts_gate_up_swapped", "experts", _moe, _gate_up_swapped,
       "routed experts' gate_proj and up_proj exchanged",
       "a fused w13 / gate_up_proj split in the wrong order"),
    _m("experts_id_offset", "experts", _moe, _expert_offset,
       "routed expert e computed with expert (e+1) mod E's weights",
       "an expert-parallel local/global expert index off by one"),
    _m("head_lm_head_tied", "head", _always, _lm_head_tied,
       "logits from the embedding matrix instead of lm_head",
       "tie_word_embeddings defaulted to true for an untied checkpoint"),
    _m("head_final_norm_weight_missing", "head", _always, _final_norm_weight_missing,
       "final RMSNorm without its weight (all ones)",
       "model.norm.weight not loaded and left at its init"),
    _m("ddtree_mask_causal", "ddtree", _tree, _tree_mask_causal,
       "tree attention causal over node index instead of ancestor-only",
       "a tree verified with the plain causal mask of linear speculative decoding"),
    _m("ddtree_positions_index", "ddtree", _tree, _tree_positions_index,
       "tree node positions start + node index instead of start + depth",
       "position ids of a flattened tree taken as a sequence"),
    _m("ddtree_bonus_chain_index", "ddtree", _tree, _bonus_chain_index,
       "bonus token read at row len(accepted)-1 instead of the last accepted node",
       "the acceptance of linear speculative decoding applied to a tree"),
    _m("ddtree_kv_compaction_prefix", "ddtree", _tree, _kv_compaction_prefix,
       "after a round the cache keeps the first len(accepted) tree rows, rejected branches included",
       "KV compaction by count (a chain's prefix) instead of by the accepted indices"),
)
MUTANTS: dict[str, Mutant] = {m.name: m for m in CATALOGUE}


def get(name: str) -> Mutant:
    try:
        return MUTANTS[name]
    except KeyError:
        raise MutantError(f"unknown mutant {name!r}; the catalogue (docs/mutants.md): {', '.join(MUTANTS)}") from None


@contextmanager
def injected(name: str) -> Iterator[Callable[[ReferenceModel], None]]:
    """Yields install(model), which injects mutant `name` into `model` (and the modules it calls);
    everything is restored when the context exits."""
    mutant = get(name)
    patcher = Patcher()
    try:
        yield lambda model: mutant.install(patcher, model)
    finally:
        patcher.restore()
