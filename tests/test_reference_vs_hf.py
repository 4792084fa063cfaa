"""The numpy reference against transformers' DeepseekV3ForCausalLM (torch CPU, fp32, eager attention)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from support import hf_helpers as H
from k2vec.reference import ReferenceModel, greedy_generate, logits_no_cache, rope_tables

STEPS = 17  # prefill + 16 decode steps
REL_TOL = 1e-4
MARGIN_TOL = 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 300, 11], [2, 200, 31]]

# Coverage: q_lora_rank null/set, n_group 1 / >1 (topk_group < n_group), YaRN on/off (incl. beta_fast ==
# beta_slow and mscale != mscale_all_dim), first_k_dense_replace 0/1/2, norm_topk_prob on/off, 1-2 shared experts.
CONFIGS = {
    "noqlora-nogroup-norope-moe0": H.config(q_lora_rank=None, first_k_dense_replace=0),
    "qlora-groups-yarn32-dense1": H.config(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                           rope_scaling=H.yarn(beta_fast=32.0)),
    "qlora-nogroup-yarnK2thinking-mscale": H.config(rope_scaling=H.yarn(beta_fast=1.0, mscale_all_dim=0.8),
                                                    num_hidden_layers=4, first_k_dense_replace=2),
    "noqlora-groups-yarn-nonorm-shared2": H.config(q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=0,
                                                   norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.5,
                                                   rope_scaling=H.yarn(factor=8.0, beta_fast=4.0, mscale=0.7,
                                                                       mscale_all_dim=0.7)),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    hf = H.build_hf_model(cfg, seed=1234)
    sharded = request.param.startswith("qlora-groups")  # exercises k2vec.model.checkpoint.Checkpoint
    saved_cfg, weights = H.save_and_load(hf, tmp_path_factory.mktemp(request.param), shard=sharded)
    return cfg, saved_cfg, weights, hf


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@torch.no_grad()
def hf_router_choices(hf, tokens):
    """Per MoE layer: the expert sets HF's router picks for each token of one full forward."""
    picked, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, i=i: picked.__setitem__(i, np.sort(out[2].numpy(), axis=-1))))
    out = hf(torch.tensor([tokens]), output_hidden_states=True)
    for h in hooks:
        h.remove()
    return picked, [h[0].double().numpy() for h in out.hidden_states], out.logits[0].double().numpy()


def test_greedy_and_logits_match_hf(pair):
    cfg, saved_cfg, weights, hf = pair
    model = ReferenceModel(cfg, weights)
    results = greedy_generate(model, PROMPTS, STEPS, top_k=8)  # a batch of prompts of different lengths
    for prompt, res in zip(PROMPTS, results):
        hf_tokens, hf_logits = H.hf_greedy(hf, prompt, STEPS)

        # Teacher-forced on HF's tokens through the KV cache: prefill, then one token per step.
        cache = model.new_cache()
        ours = [model.forward(prompt, cache=cache).logits]
        for tok in hf_tokens[:-1]:
            ours.append(model.forward([tok], cache=cache).logits)
        prefill, steps = ours[0], np.concatenate([ours[0][-1:]] + ours[1:])
        assert rel_err(steps, hf_logits) <= REL_TOL

        # Greedy choices agree wherever HF's own decision is not a near-tie.
        srt = np.sort(hf_logits, axis=-1)
        hf_margin = srt[:, -1] - srt[:, -2]
        differ = np.flatnonzero(steps.argmax(-1) != hf_tokens)
        if differ.size:
            print(f"steps where argmax differs from HF: {differ}, HF margins {hf_margin[differ]}")
        assert (hf_margin[differ] < MARGIN_TOL).all()
        if not differ.size:  # then greedy_generate followed HF's path exactly: check its records
            np.testing.assert_array_equal(res.tokens, hf_tokens)
            np.testing.assert_allclose(res.topk_logits, np.take_along_axis(steps, res.topk_ids, -1), rtol=0, atol=1e-9)
            assert (np.diff(res.topk_logits, axis=-1) <= 0).all()

        # Whole sequence in one HF forward: prompt logits, per-layer hidden states and router choices.
        seq = list(prompt) + list(hf_tokens)
        picked, hf_hidden, hf_full = hf_router_choices(hf, seq)
        assert rel_err(prefill, hf_full[: len(prompt)]) <= REL_TOL
        out = model.forward(seq, record=True)
        n_layers = cfg["num_hidden_layers"]
        for i in range(n_layers - 1):  # HF's hidden_states[i+1] = output of layer i ...
            assert rel_err(out.hidden[i], hf_hidden[i + 1]) <= REL_TOL
        last = out.hidden[-1] / np.sqrt(np.mean(out.hidden[-1] ** 2, -1, keepdims=True) + cfg["rms_norm_eps"])
        last *= np.asarray(weights["model.norm.weight"], np.float64)  # ... except the last, after the final norm
        assert rel_err(last, hf_hidden[n_layers]) <= REL_TOL
        assert sorted(picked) == model.moe_layers
        for i in model.moe_layers:
            decisive = out.router_margins[i] > 1e-5
            assert decisive.mean() > 0.9
            np.testing.assert_array_equal(np.sort(out.router_ids[i], -1)[decisive], picked[i][decisive])
        # greedy_generate's router records are the same choices, by position.
        if not differ.size:
            for m, i in enumerate(model.moe_layers):
                np.testing.assert_array_equal(res.router_ids[m], out.router_ids[i][:-1])
            np.testing.assert_allclose(res.hidden, out.hidden[:, len(prompt) - 1 : -1].transpose(1, 0, 2), atol=1e-9)

    # The config.json HF wrote (v5 `rope_parameters`, no `rope_scaling`) gives the same model.
    seq = PROMPTS[0] + list(results[0].tokens)
    np.testing.assert_array_equal(logits_no_cache(ReferenceModel(saved_cfg, weights), seq), logits_no_cache(model, seq))


def test_engine_latent_eps_differs_from_hf(pair):
    """HF uses eps 1e-6 in q_a/kv_a_layernorm, not rms_norm_eps (1e-5 here). The weights make that
    visible, so the comparison above would catch a reference that used rms_norm_eps there."""
    cfg, _, weights, hf = pair
    seq = PROMPTS[0]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([seq])).logits[0].double().numpy()
    assert rel_err(logits_no_cache(ReferenceModel(cfg, weights), seq), hf_logits) <= REL_TOL
    assert rel_err(logits_no_cache(ReferenceModel(cfg, weights, latent_norm_eps=None), seq), hf_logits) > 10 * REL_TOL


YARN_CASES = {
    "k2-thinking": dict(rope_dim=64, yarn=H.yarn(factor=64.0, beta_fast=1.0, beta_slow=1.0)),
    "k2.5": dict(rope_dim=64, yarn=H.yarn(factor=64.0, beta_fast=32.0)),
    "dsv3-mscale": dict(rope_dim=64, yarn=H.yarn(factor=40.0, beta_fast=32.0, mscale=1.0, mscale_all_dim=0.707)),
    # beta = 1.01 * orig / 2pi puts both correction dims just below 0: low = high = 0 after floor/ceil/clamp,
    # and without the +0.001 pair 0 would get 0/0.
    "low-eq-high-0": dict(rope_dim=16, yarn=H.yarn(factor=4.0, beta_fast=660.0, beta_slow=660.0)),
    "low-eq-high-untruncated": dict(rope_dim=16,
                                    yarn={**H.yarn(factor=4.0, beta_fast=2.0, beta_slow=2.0), "truncate": False}),
    "clamped-low": dict(rope_dim=8, yarn=H.yarn(factor=16.0, beta_fast=1e6, beta_slow=0.5)),
    "no-mscale-all-dim": dict(rope_dim=32, yarn=H.yarn(factor=32.0, mscale=0.0, mscale_all_dim=0.0)),
    "default": dict(rope_dim=32, yarn=None),
}


@pytest.mark.parametrize("case", list(YARN_CASES), ids=list(YARN_CASES))
def test_rope_tables_match_hf(case):
    rope_dim, yarn = YARN_CASES[case]["rope_dim"], YARN_CASES[case]["yarn"]
    cfg = H.config(qk_rope_head_dim=rope_dim, rope_scaling=yarn)
    hf_cfg = H.hf_config(cfg)
    if yarn and "truncate" in yarn:
        hf_cfg.rope_parameters["truncate"] = yarn["truncate"]
    if yarn:
        hf_inv, hf_att = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    else:
        hf_inv, hf_att = 1.0 / 50000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim), 1.0
    inv, att, softmax_mult = rope_tables(cfg, rope_dim)
    np.testing.assert_allclose(inv, hf_inv.double().numpy(), rtol=1e-6)
    assert math.isclose(att, hf_att, rel_tol=1e-12)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    qk = cfg["qk_nope_head_dim"] + rope_dim
    assert math.isclose(qk ** -0.5 * softmax_mult, yarn_apply_mscale(hf_cfg.rope_parameters, qk ** -0.5), rel_tol=1e-12)
    if case == "low-eq-high-0":
        base = 1.0 / 50000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)
        np.testing.assert_allclose(inv, np.r_[base[:1], base[1:] / 4.0], rtol=1e-12)
    if case == "low-eq-high-untruncated":  # low = high = 4.28 untruncated; ramp over [4.28, 4.281]: step after pair 4
        assert 4 < 16 * math.log(4096 / (2 * 2 * math.pi)) / (2 * math.log(50000.0)) < 5
        base = 1.0 / 50000.0 ** (np.arange(0, rope_dim, 2) / rope_dim)
        np.testing.assert_allclose(inv[:5], base[:5], rtol=1e-12)
        np.testing.assert_allclose(inv[5:], base[5:] / 4.0, rtol=1e-12)
