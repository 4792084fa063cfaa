"""The DeepSeek-V3 / Kimi-K2 checkpoint layout: tensor names and shapes, and the HF config.json.

Kept apart from config expansion so that the weights stage depends on nothing but this layout.
"""

from __future__ import annotations

from typing import Any

# The architecture settings of a model spec, with transformers' DeepseekV3Config key names.
ARCH_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
    "topk_group", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling", "max_position_embeddings",
    "rms_norm_eps", "routed_scaling_factor", "norm_topk_prob",
)
# The Linear modules of the layout by their last name component (nn.Linear in transformers and DeepSeek's code,
# LinearBase in vLLM), and `lm_head`. The router `mlp.gate` is its own module, the embedding an Embedding.
LINEAR_MODULES = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                  "up_proj", "down_proj")


def tensor_shapes(m: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor of the checkpoint, in checkpoint order, with DeepSeek-V3 names and [out, in] shapes."""
    H, V, H_heads = m["hidden_size"], m["vocab_size"], m["num_attention_heads"]
    qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [V, H]}
    for i in range(m["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = [H]
        a = p + "self_attn."
        if m["q_lora_rank"] is None:
            shapes[a + "q_proj.weight"] = [H_heads * qk, H]
        else:
            shapes[a + "q_a_proj.weight"] = [m["q_lora_rank"], H]
            shapes[a + "q_a_layernorm.weight"] = [m["q_lora_rank"]]
            shapes[a + "q_b_proj.weight"] = [H_heads * qk, m["q_lora_rank"]]
        shapes[a + "kv_a_proj_with_mqa.weight"] = [m["kv_lora_rank"] + m["qk_rope_head_dim"], H]
        shapes[a + "kv_a_layernorm.weight"] = [m["kv_lora_rank"]]
        shapes[a + "kv_b_proj.weight"] = [H_heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]]
        shapes[a + "o_proj.weight"] = [H, H_heads * m["v_head_dim"]]
        shapes[p + "post_attention_layernorm.weight"] = [H]
        if i < m["first_k_dense_replace"]:
            shapes.update(_mlp(p + "mlp.", H, m["intermediate_size"]))
        else:
            E = m["n_routed_experts"]
            shapes[p + "mlp.gate.weight"] = [E, H]
            shapes[p + "mlp.gate.e_score_correction_bias"] = [E]
            for e in range(E):
                shapes.update(_mlp(f"{p}mlp.experts.{e}.", H, m["moe_intermediate_size"]))
            if m["n_shared_experts"]:
                shapes.update(_mlp(p + "mlp.shared_experts.", H, m["moe_intermediate_size"] * m["n_shared_experts"]))
    shapes["model.norm.weight"] = [H]
    shapes["lm_head.weight"] = [V, H]
    return shapes


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, list[int]]:
    return {prefix + "gate_proj.weight": [inter, hidden], prefix + "up_proj.weight": [inter, hidden],
            prefix + "down_proj.weight": [hidden, inter]}



def hf_config(model: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers' DeepseekV3ForCausalLM, in the Kimi-K2 checkpoint's key style."""
    cfg = {k: model[k] for k in ARCH_KEYS}
    # RoPE stated in full rather than left to transformers' defaults (docs/bundle-contents.md): rotary
    # dims rotate as interleaved pairs (2i, 2i+1), and YaRN's ramp bounds are truncated to integers.
    if cfg["rope_scaling"] is not None:
        rs = cfg["rope_scaling"]
        cfg["rope_scaling"] = {**rs, "rope_type": rs.get("rope_type") or rs.get("type"), "truncate": True}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        # Kimi checkpoints say kimi_k2; transformers only knows the identical deepseek_v3.
        "model_type": "deepseek_v3",
        **cfg,
        "num_key_value_heads": model["num_attention_heads"],
        "rope_interleave": True,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
