"""docs/model.md is the reference's forward pass written down. Its constants table (§0) is parsed, its
equations are re-implemented here in plain numpy from the page (loops where the code vectorises), and
both are compared with src/k2vec/reference/model.py: a rule or constant of the page that disagrees
with the oracle fails here."""
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import REPO

from k2vec.config.presets import PRESETS
from k2vec.model import int4
from k2vec.model.architecture import tensor_shapes
from k2vec.reference import model as ref
from k2vec.reference.generate import top_k_sorted
from k2vec.reference.speculative import argmax_lower_id
from k2vec.stages import golden

TEXT = (REPO / "docs/model.md").read_text()
DOC = " ".join(TEXT.split())


def doc_constants() -> dict[str, float]:
    section = TEXT.split("## 0.")[1].split("## 1.")[0]
    return {k: float(v) for k, v in re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.M)}


C = doc_constants()


# ---- the page's equations, written from the page ---------------------------------------------

def doc_sigmoid(z):
    return 0.5 + 0.5 * np.tanh(z / 2)                                    # §0


def doc_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w  # §2


def lin(x, w):
    return x @ w.T


def doc_mscale(f, m):
    return 1.0 if f <= 1 else C["mscale_coeff"] * m * math.log(f) + 1.0


def doc_rope_tables(cfg: dict, d: int) -> dict:
    """§4.2 and §4.3: inv_freq, A, softmax_mult, and (yarn) the ramp bounds."""
    p = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(p.get("rope_theta", cfg.get("rope_theta", C["rope_theta_default"])))
    kind = p.get("rope_type") or p.get("type") or "default"
    inv = np.array([1.0 / theta ** (2 * i / d) for i in range(d // 2)])
    if kind == "default":
        return {"inv_freq": inv, "A": 1.0, "mult": 1.0}
    f = p.get("factor") or cfg["max_position_embeddings"] / p["original_max_position_embeddings"]
    L = p["original_max_position_embeddings"]
    bf, bs = p.get("beta_fast") or C["beta_fast_default"], p.get("beta_slow") or C["beta_slow_default"]

    def dim(r):
        return d * math.log(L / (2 * math.pi * r)) / (2 * math.log(theta))

    low, high = dim(bf), dim(bs)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += C["zero_width_ramp"]
    ramp = np.array([min(max((i - low) / (high - low), 0.0), 1.0) for i in range(d // 2)])
    m, m_all = p.get("mscale"), p.get("mscale_all_dim")
    if p.get("attention_factor") is not None:
        A = p["attention_factor"]
    elif m and m_all:
        A = doc_mscale(f, m) / doc_mscale(f, m_all)
    else:
        A = doc_mscale(f, 1)
    return {"inv_freq": inv / f * ramp + inv * (1 - ramp), "A": A,
            "mult": doc_mscale(f, m_all) ** 2 if m_all else 1.0, "low": low, "high": high}


def doc_rope(x, cos, sin):
    """§4.1 on x [T, d] (cos, sin [T, d/2], A already in them): interleaved pairs."""
    y = np.empty_like(x)
    for i in range(x.shape[-1] // 2):
        a, b = x[:, 2 * i], x[:, 2 * i + 1]
        y[:, 2 * i], y[:, 2 * i + 1] = a * cos[:, i] - b * sin[:, i], b * cos[:, i] + a * sin[:, i]
    return y


def doc_route(logits, bias, cfg):
    """§6, token by token: (ids in selection order, weights)."""
    E, k, G, Gk = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    per, top = E // G, int(C["group_score_top"])
    s = doc_sigmoid(logits)
    all_ids, all_w = [], []
    for t in range(len(logits)):
        c = s[t] + bias
        if G > 1:
            g = [sum(sorted(c[j * per:(j + 1) * per])[-top:]) for j in range(G)]
            kept = sorted(range(G), key=lambda j: (-g[j], j))[:Gk]
            c = np.array([c[e] if e // per in kept else -np.inf for e in range(E)])
        ids = sorted(range(E), key=lambda e: (-c[e], e))[:k]
        w = s[t, ids]
        if cfg["norm_topk_prob"]:
            w = w / (w.sum() + C["renorm_eps"])
        all_ids.append(ids)
        all_w.append(w * cfg["routed_scaling_factor"])
    return np.array(all_ids), np.array(all_w)


def doc_swiglu(h, W, p):
    g = lin(h, W[p + "gate_proj.weight"])                                 # §5: silu(g) ⊙ up, then down
    return lin(g * doc_sigmoid(g) * lin(h, W[p + "up_proj.weight"]), W[p + "down_proj.weight"])


def doc_mla(h, W, p, cfg, cos, sin, scale):
    """§3 over one whole sequence (no cache), causal, head by head."""
    T, H = len(h), cfg["num_attention_heads"]
    nope, rope, dv, rkv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    eps = C["latent_norm_eps"]
    if cfg["q_lora_rank"] is None:
        q = lin(h, W[p + "q_proj.weight"])
    else:
        q = lin(doc_rms(lin(h, W[p + "q_a_proj.weight"]), W[p + "q_a_layernorm.weight"], eps), W[p + "q_b_proj.weight"])
    q = q.reshape(T, H, nope + rope)
    a = lin(h, W[p + "kv_a_proj_with_mqa.weight"])
    c = doc_rms(a[:, :rkv], W[p + "kv_a_layernorm.weight"], eps)
    k_pe = doc_rope(a[:, rkv:], cos, sin)
    kv = lin(c, W[p + "kv_b_proj.weight"]).reshape(T, H, nope + dv)
    o = np.zeros((T, H, dv))
    causal = np.tril(np.ones((T, T), bool))
    for hd in range(H):
        s = (q[:, hd, :nope] @ kv[:, hd, :nope].T + doc_rope(q[:, hd, nope:], cos, sin) @ k_pe.T) * scale
        s = np.where(causal, s, -np.inf)
        pr = np.exp(s - s.max(axis=-1, keepdims=True))
        o[:, hd] = (pr / pr.sum(axis=-1, keepdims=True)) @ kv[:, hd, nope:]
    return lin(o.reshape(T, H * dv), W[p + "o_proj.weight"])


def doc_forward(cfg, W, tokens, positions):
    """§1: (logits [T, V], hidden [layers, T, D], router ids per MoE layer)."""
    eps, rt = cfg["rms_norm_eps"], doc_rope_tables(cfg, cfg["qk_rope_head_dim"])
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5 * rt["mult"]
    phi = positions[:, None] * rt["inv_freq"][None, :]
    cos, sin = np.cos(phi) * rt["A"], np.sin(phi) * rt["A"]
    x = W["model.embed_tokens.weight"][tokens]
    hidden, routed = [], {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + doc_mla(doc_rms(x, W[p + "input_layernorm.weight"], eps), W, p + "self_attn.", cfg, cos, sin, scale)
        h = doc_rms(x, W[p + "post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + doc_swiglu(h, W, p + "mlp.")
        else:
            ids, w = doc_route(lin(h, W[p + "mlp.gate.weight"]), W[p + "mlp.gate.e_score_correction_bias"], cfg)
            y = np.zeros_like(x)
            for t in range(len(x)):
                for e, we in zip(ids[t], w[t]):
                    y[t] += we * doc_swiglu(h[t:t + 1], W, f"{p}mlp.experts.{e}.")[0]
            if cfg["n_shared_experts"]:
                y = y + doc_swiglu(h, W, p + "mlp.shared_experts.")
            x = x + y
            routed[i] = ids
        hidden.append(x)
    return lin(doc_rms(x, W["model.norm.weight"], eps), W["lm_head.weight"]), np.stack(hidden), routed


def doc_shapes(cfg) -> dict[str, list[int]]:
    """The weight shapes the page's tables state (§3, §5, §6, §7)."""
    D, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    nope, rope, dv, rq, rkv = (cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                "q_lora_rank", "kv_lora_rank"))
    E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]

    def mlp(p, inter):
        return {p + "gate_proj.weight": [inter, D], p + "up_proj.weight": [inter, D],
                p + "down_proj.weight": [D, inter]}

    s = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D], "lm_head.weight": [V, D]}
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        s |= {p + "input_layernorm.weight": [D], p + "post_attention_layernorm.weight": [D],
              a + "kv_a_proj_with_mqa.weight": [rkv + rope, D], a + "kv_a_layernorm.weight": [rkv],
              a + "kv_b_proj.weight": [H * (nope + dv), rkv], a + "o_proj.weight": [D, H * dv]}
        if rq is None:
            s[a + "q_proj.weight"] = [H * (nope + rope), D]
        else:
            s |= {a + "q_a_proj.weight": [rq, D], a + "q_a_layernorm.weight": [rq],
                  a + "q_b_proj.weight": [H * (nope + rope), rq]}
        if i < cfg["first_k_dense_replace"]:
            s |= mlp(p + "mlp.", cfg["intermediate_size"])
        else:
            s |= {p + "mlp.gate.weight": [E, D], p + "mlp.gate.e_score_correction_bias": [E]}
            for e in range(E):
                s |= mlp(f"{p}mlp.experts.{e}.", I)
            if cfg["n_shared_experts"]:
                s |= mlp(p + "mlp.shared_experts.", cfg["n_shared_experts"] * I)
    return s


# ---- cases -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardCase:
    name: str
    config: dict


BASE = dict(vocab_size=48, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
            num_attention_heads=3, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
            topk_group=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=6, max_position_embeddings=262144, rms_norm_eps=1e-5,
            routed_scaling_factor=2.827, norm_topk_prob=True, rope_theta=50000.0,
            rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                              beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0))

FORWARD_CASES = [
    # groups with 4 experts each, renormalised, shared experts, YaRN with A != 1, latent eps != rms_norm_eps
    ForwardCase("yarn-groups-qlora", BASE),
    # plain query projection, default RoPE (theta from the default), no groups, no renorm, no shared expert
    ForwardCase("default-rope-q-proj", {**BASE, "q_lora_rank": None, "rope_theta": None, "rope_scaling": None,
                                        "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                                        "n_shared_experts": 0, "first_k_dense_replace": 0,
                                        "routed_scaling_factor": 1.5}),
    # HF v5 spelling, factor implied by max_position_embeddings, ramp bounds not truncated
    ForwardCase("rope-parameters-implicit-factor", {**BASE, "rope_theta": None, "rope_scaling": None,
                                                    "rope_parameters": dict(rope_type="yarn", rope_theta=20000.0,
                                                                            original_max_position_embeddings=512,
                                                                            beta_fast=16.0, beta_slow=2.0,
                                                                            mscale=1.0, mscale_all_dim=0.5,
                                                                            truncate=False)}),
]


def random_weights(cfg, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    W = {}
    for name, shape in doc_shapes(cfg).items():
        if name.endswith("e_score_correction_bias"):
            W[name] = rng.uniform(0.0, 0.1, shape)
        elif len(shape) == 1:
            W[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            W[name] = rng.standard_normal(shape) * (0.5 if name.endswith("gate.weight") else 1.0) / math.sqrt(shape[1])
    return {k: v.astype(np.float32) for k, v in W.items()}


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: c.name)
def test_the_documented_forward_is_the_reference(case):
    cfg = {k: v for k, v in case.config.items() if v is not None}
    cfg.setdefault("q_lora_rank", None)
    assert doc_shapes(cfg) == tensor_shapes(cfg)
    W = random_weights(cfg, 0)
    Wd = {k: v.astype(np.float64) for k, v in W.items()}
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg["vocab_size"], 7)
    positions = np.array([0, 1, 2, 900, 3000, 40000, 200000])   # explicit, far apart: every frequency band
    model = ref.ReferenceModel(cfg, W)
    out = model.forward(tokens, positions=positions, record=True)
    logits, hidden, routed = doc_forward(cfg, Wd, tokens, positions)
    np.testing.assert_allclose(out.hidden, hidden, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.logits, logits, rtol=1e-10, atol=1e-12)
    assert {i: v.tolist() for i, v in out.router_ids.items()} == {i: v.tolist() for i, v in routed.items()}

    # §3: default positions continue the cache, new rows see the cache and earlier new rows
    cache = model.new_cache()
    model.forward(tokens[:4], cache=cache)
    step = model.forward(tokens[4:], cache=cache)
    np.testing.assert_allclose(step.logits, doc_forward(cfg, Wd, tokens, np.arange(7.0))[0][4:], rtol=1e-10, atol=1e-12)


def test_the_latent_norm_eps_matters_in_that_case():
    """The first forward case tells the documented latent eps from rms_norm_eps (else it proves nothing)."""
    cfg = FORWARD_CASES[0].config
    assert cfg["rms_norm_eps"] != C["latent_norm_eps"]
    W = random_weights(cfg, 0)
    tokens, positions = np.arange(5), np.arange(5)
    a = ref.ReferenceModel(cfg, W).forward(tokens, positions=positions).logits
    b = ref.ReferenceModel(cfg, W, latent_norm_eps=None).forward(tokens, positions=positions).logits
    assert np.abs(a - b).max() > 1e-8


# ---- constants and single ops ----------------------------------------------------------------

def test_the_constants_table_names_the_codes_constants():
    assert set(C) == {"latent_norm_eps", "group_score_top", "renorm_eps", "mscale_coeff", "beta_fast_default",
                      "beta_slow_default", "rope_theta_default", "zero_width_ramp", "int4_offset"}
    assert C["latent_norm_eps"] == ref.HF_LATENT_NORM_EPS == golden.HF_LATENT_NORM_EPS


def test_each_norm_has_the_documented_eps():
    """§2's table: the three decoder norms take rms_norm_eps, the two latent norms the constant."""
    section = TEXT.split("## 2.")[1].split("## 3.")[0]
    rows = re.findall(r"^\| `model\.(?:layers\.\{i\}\.)?(?:self_attn\.)?(\w+)`[^|]* \| [^|]+ \| (.+?) \|$", section,
                      re.M)
    eps = {name: (cell if "latent" not in cell else float(re.fullmatch(r"`latent_norm_eps` = ([0-9e.-]+), "
                                                                     r"\*\*not\*\* `rms_norm_eps`", cell).group(1)))
           for name, cell in rows}
    assert eps == {"input_layernorm": "`rms_norm_eps` (config)", "post_attention_layernorm": "`rms_norm_eps`",
                   "norm": "`rms_norm_eps`", "q_a_layernorm": C["latent_norm_eps"],
                   "kv_a_layernorm": C["latent_norm_eps"]}
    for where in ("q = linear(RMSNorm(linear(h, q_a_proj), q_a_layernorm, ",
                  "c = RMSNorm(a[:, :r_kv], kv_a_layernorm, "):
        assert float(re.search(re.escape(where) + r"([0-9e.-]+)\)", DOC).group(1)) == C["latent_norm_eps"], where


def test_rms_norm():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((5, 9)) * 1e-3, rng.standard_normal(9)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-5), doc_rms(x, w, 1e-5), rtol=1e-14)


@dataclass(frozen=True)
class RopeCase:
    name: str
    config: dict
    d: int = 16


K2 = {k: PRESETS["tiny"][k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings")}
ROPE_CASES = [
    RopeCase("k2-preset-d16", K2),
    RopeCase("k2-preset-d64", K2, 64),
    RopeCase("betas-absent-untruncated", {**K2, "rope_scaling": dict(type="yarn", factor=40.0, beta_fast=0,
                                          original_max_position_embeddings=4096, truncate=False)}),
    RopeCase("mscale-only", {**K2, "rope_scaling": {**K2["rope_scaling"], "mscale_all_dim": 0, "mscale": 0.8}}),
    RopeCase("explicit-attention-factor", {**K2, "rope_scaling": {**K2["rope_scaling"], "attention_factor": 0.9}}),
    RopeCase("factor-at-most-1", {**K2, "rope_scaling": {**K2["rope_scaling"], "factor": 1.0}}),
    RopeCase("default-theta", {"rope_scaling": None}),
    # low == high without truncation, 0.0004 below an integer: pair 5 sits inside the widened ramp
    RopeCase("zero-width-ramp", {"rope_theta": 10000.0, "rope_scaling": dict(
        type="yarn", factor=8.0, beta_fast=1.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=2 * math.pi * 10000.0 ** (2 * 4.9996 / 16))}),
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.name)
def test_rope_tables(case):
    inv, A, mult = ref.rope_tables(case.config, case.d)
    doc = doc_rope_tables(case.config, case.d)
    np.testing.assert_allclose(inv, doc["inv_freq"], rtol=1e-14)
    assert A == pytest.approx(doc["A"], rel=1e-14) and mult == pytest.approx(doc["mult"], rel=1e-14)


def test_the_zero_width_ramp_case_uses_the_widening():
    doc = doc_rope_tables(ROPE_CASES[-1].config, 16)
    assert (doc["high"] - doc["low"] == pytest.approx(C["zero_width_ramp"])
            and 0 < 5 - doc["low"] < doc["high"] - doc["low"])


def test_rope_rotates_interleaved_pairs():
    rng = np.random.default_rng(3)
    x, phi = rng.standard_normal((4, 8)), rng.uniform(0, 6, (4, 4))
    np.testing.assert_allclose(ref.apply_rope(x, np.cos(phi), np.sin(phi)), doc_rope(x, np.cos(phi), np.sin(phi)),
                               rtol=1e-14, atol=1e-15)


def test_the_worked_example():
    """§4.3's numbers are what the reference computes for the presets' K2 RoPE settings."""
    text = DOC.split("Worked example")[1].split("## 5.")[0]
    bounds = [tuple(map(int, m)) for m in re.findall(r"`low = (\d+)`, `high = (\d+)`", text)]
    scales = [(int(a), float(b), float(c)) for a, b, c in
              re.findall(r"softmax_scale = (\d+)\^\(−1/2\) · ([\d.]+) = ([\d.]+)", text)]
    assert [len(bounds), len(scales)] == [2, 2]
    for (low, high), (qk, mult, scale), (d, nope) in zip(bounds, scales, [(64, 128), (16, 32)]):
        doc = doc_rope_tables(K2, d)
        assert (doc["low"], doc["high"], qk) == (low, high, d + nope)
        model_scale = ref.rope_tables(K2, d)[2] * (d + nope) ** -0.5
        assert mult == pytest.approx(ref.rope_tables(K2, d)[2], abs=1e-8)
        assert scale == pytest.approx(model_scale, abs=1e-8)


# ---- the router ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RouterCase:
    name: str
    config: dict
    logits: str      # how the logits are drawn


ROUTER = dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
              routed_scaling_factor=2.827)
ROUTER_CASES = [
    RouterCase("groups-renorm", ROUTER, "normal"),
    RouterCase("groups-no-renorm", {**ROUTER, "norm_topk_prob": False}, "normal"),
    RouterCase("one-group", {**ROUTER, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8}, "normal"),
    RouterCase("tiny-scores", ROUTER, "tiny"),        # sum of the chosen scores ~1e-14: the 1e-20 shows
    RouterCase("all-tied", ROUTER, "zero"),           # every score and group equal: lower indices win
    RouterCase("group-ties", ROUTER, "group-ties"),   # groups 1 and 3 tie on top-2 sum; experts tie inside
]


def router_inputs(case: RouterCase):
    rng = np.random.default_rng(4)
    E, T = case.config["n_routed_experts"], 200
    if case.logits == "normal":
        return rng.standard_normal((T, E)) * 2, rng.uniform(0, 0.2, E)
    if case.logits == "tiny":
        return rng.uniform(-34, -31, (T, E)), np.zeros(E)
    if case.logits == "zero":
        return np.zeros((4, E)), np.zeros(E)
    # group 0 first; groups 1 and 3 tie for the second place (their best two are equal); group 2 last
    row = np.array([4, 4, -9, -9, 3, 3, -5, -5, 1, 0, -9, -9, 3, 3, -6, -6], float)
    return np.tile(row, (4, 1)), np.zeros(E)


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: c.name)
def test_route(case):
    logits, bias = router_inputs(case)
    d = ref.Dims.from_config({**PRESETS["tiny"], "first_k_dense_replace": 0, **case.config})
    ids, w, _ = ref.route(logits, bias, d)
    doc_ids, doc_w = doc_route(logits, bias, case.config)
    assert ids.tolist() == doc_ids.tolist()
    np.testing.assert_allclose(w, doc_w, rtol=1e-12, atol=0)


def test_the_tie_cases_are_ties():
    logits, bias = router_inputs(ROUTER_CASES[-1])
    c = doc_sigmoid(logits[0]) + bias
    g = [np.sort(c[j * 4:(j + 1) * 4])[-2:].sum() for j in range(4)]
    assert g[0] > g[1] == g[3] > g[2]                      # the second kept group is decided by the tie
    assert doc_route(logits, bias, ROUTER)[0][0].tolist() == [0, 1, 4]   # group 1 kept, expert 4 before 5
    assert ref.route(*router_inputs(ROUTER_CASES[-2]), ref.Dims.from_config(
        {**PRESETS["tiny"], "first_k_dense_replace": 0, **ROUTER}))[0][0].tolist() == [0, 1, 2]


def test_the_group_score_sums_the_documented_top():
    """With 4 experts a group, summing the top 2 and the top 3 rank groups differently here."""
    logits, bias = router_inputs(ROUTER_CASES[0])
    s = doc_sigmoid(logits) + bias
    g = s.reshape(len(s), 4, 4)
    top = int(C["group_score_top"])
    np.testing.assert_allclose(ref.group_scores(g), np.sort(g, axis=-1)[..., -top:].sum(-1), rtol=1e-15)
    assert (np.argsort(-np.sort(g)[..., -2:].sum(-1))[:, :2] != np.argsort(-np.sort(g)[..., -3:].sum(-1))[:, :2]).any()


def test_selection_and_weights_rules_are_stated():
    for rule in ["`c = s + b`: used **only to select**", "`w_j = s[ids_j]`: the **unbiased** sigmoid scores",
                 "`w_j = w_j / (Σ_j' w_j' + 1e-20)`", "`w_j = w_j · routed_scaling_factor` (always",
                 "added **unweighted** (no `routed_scaling_factor`)", "ties to the lower group index",
                 "descending, ties to the lower expert id", "set `c = −∞` for every expert of the other groups"]:
        assert rule in DOC, rule


# ---- greedy choice, INT4 ---------------------------------------------------------------------

def test_argmax_and_top_k_ties_go_to_the_lower_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 3.0])
    doc = sorted(range(6), key=lambda i: (-logits[i], i))
    assert top_k_sorted(logits, 5).tolist() == doc[:5] and int(argmax_lower_id(logits)) == doc[0] == 1
    assert "Greedy token = argmax of the step's logits, **ties to the lower token id**" in DOC


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_int4_dequantization(scale_dtype):
    rng = np.random.default_rng(5)
    g, codes = 32, rng.integers(-8, 8, (3, 128)).astype(np.int8)
    scales = rng.uniform(0.01, 1, (3, 4)).astype(np.float32)
    if scale_dtype == "bfloat16":
        sc_bits = int4.bf16_bits(scales)
        scales_f32 = (sc_bits.astype(np.uint32) << 16).view(np.float32)       # §8: bits << 16
    else:
        scales_f32 = scales
    qw = int4.pack(codes)
    doc = np.empty((3, 128), np.float32)
    for n in range(3):
        for k in range(128):
            u = (int(qw[n, k >> 1]) >> (4 * (k & 1))) & 0xF
            doc[n, k] = np.float32(u - int(C["int4_offset"])) * scales_f32[n, k // g]
    code = int4.dequantize(int4.unpack(qw, 128), scales_f32, g)
    assert np.array_equal(doc, code) and np.array_equal(int4.unpack(qw, 128), codes)
