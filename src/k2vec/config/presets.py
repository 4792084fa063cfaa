"""The model presets a config entry starts from: K2's own shape, and small ones of the same architecture."""

from __future__ import annotations

from typing import Any

K2_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi-K2 architecture at test-friendly widths. hidden_size and moe_intermediate_size are multiples
# of 128 and 64, so the same weights also satisfy vLLM's Marlin MoE shape rules. Values not listed in
# a preset are the K2-Thinking ones (see _K2_COMMON).
_K2_COMMON: dict[str, Any] = {
    "n_shared_experts": 1,
    "rope_theta": 50000.0,
    "rope_scaling": K2_YARN,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "seed": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_K2_COMMON,
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    "small": {
        **_K2_COMMON,
        "vocab_size": 2048,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    # The real K2 widths (docs: README "Scale"). K2 routes with n_group 1 / topk_group 1, i.e. no group
    # restriction: kept as is with fewer experts, so top-8 of 16 is chosen exactly as K2 chooses top-8
    # of 384. Vocabulary reduced from 163840 to 16384 so that the embedding (16384 x 7168, 470 MB in
    # fp32) stays below the dense MLP's 18432 x 7168 (528 MB), the largest tensor the stages hold.
    "k2slice": {
        **_K2_COMMON,
        "vocab_size": 16384,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 3,
        "num_attention_heads": 64,
        "n_routed_experts": 16,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    # One full K2 MoE layer (all 384 experts, top-8, groups 1/1 as K2) for the quantization path's scale
    # test; intermediate_size is K2's but unused (no dense layer). Same reduced vocabulary as k2slice.
    "k2layer": {
        **_K2_COMMON,
        "vocab_size": 16384,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 1,
        "num_attention_heads": 64,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
}
