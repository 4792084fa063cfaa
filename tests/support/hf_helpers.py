"""Build tiny HF DeepseekV3 models with decisive (not near-tied) weights and load them for the numpy reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.numpy import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k2vec.model.checkpoint import INDEX_NAME, Checkpoint

BASE = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, rope_theta=50000.0, rope_scaling=None, rms_norm_eps=1e-5,
    routed_scaling_factor=2.827, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False, bos_token_id=0,
    eos_token_id=None, pad_token_id=None,  # no eos: generate always runs n steps
)


def yarn(factor=64.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, orig=4096) -> dict:
    return dict(type="yarn", factor=factor, original_max_position_embeddings=orig, beta_fast=beta_fast,
                beta_slow=beta_slow, mscale=mscale, mscale_all_dim=mscale_all_dim)


def config(**overrides) -> dict:
    """A Kimi/DeepSeek-style config.json dict (legacy `rope_theta` + `rope_scaling` keys)."""
    return {**BASE, **overrides}


def hf_config(cfg: dict) -> DeepseekV3Config:
    kw = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    if cfg.get("rope_scaling"):
        kw["rope_scaling"] = dict(cfg["rope_scaling"])
    return DeepseekV3Config(**kw, num_mtp_layers=0)


@torch.no_grad()
def build_hf_model(cfg: dict, seed: int) -> DeepseekV3ForCausalLM:
    """fp32 eager HF model with weights scaled for decisive greedy steps: matrices ~N(0, 1/fan_in),
    embeddings N(0, 1), a 3x larger lm_head (logit std ~3), norms in [0.8, 1.2], router bias ~N(0, 0.1^2).
    Note: the HF model caches torch weights; the fp32 numpy copy comes from `save_and_load`."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(cfg)).eval()
    model.set_attn_implementation("eager")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 0.1)
        elif t.ndim == 1:
            t.uniform_(0.8, 1.2)
        elif name.endswith("embed_tokens.weight"):
            t.normal_(0.0, 1.0)
        else:
            scale = 3.0 if name == "lm_head.weight" else 1.0
            t.normal_(0.0, scale / math.sqrt(t.shape[-1]))
    # Small latents (rms ~0.03) before q_a/kv_a_layernorm make their eps visible in the logits,
    # so a reference using rms_norm_eps there (instead of HF's 1e-6) fails the comparison.
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.q_a_proj is not None:
            attn.q_a_proj.weight.mul_(0.03)
        attn.kv_a_proj_with_mqa.weight[: cfg["kv_lora_rank"]].mul_(0.03)
    return model


def save_and_load(model: DeepseekV3ForCausalLM, path: Path, shard: bool = False):
    """save_pretrained (safetensors), then read it back as (config.json dict, name -> numpy array).
    HF writes per-expert names on save, so the files use DeepSeek-V3 names already."""
    model.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    if (path / INDEX_NAME).exists():
        ckpt = Checkpoint(path, verify=False)  # save_pretrained records no shard hashes
        return ckpt.config, ckpt
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


@torch.no_grad()
def hf_greedy(model: DeepseekV3ForCausalLM, prompt: list[int], n: int):
    """HF greedy generate: (tokens [n], logits [n, V] of each step)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].numpy(), torch.cat(out.logits).double().numpy()
