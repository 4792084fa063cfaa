// The model: docs/model.md as code. Config (§0), RoPE/YaRN tables (§4), the KV cache (§3), and a
// forward over a block of T new tokens of one sequence at explicit positions with a mask.
#pragma once

#include <cstdint>
#include <vector>

#include "bundle.h"
#include "tensor.h"

namespace k2n {

// hf_config's dimensions, with the reference's defaults for absent keys (k2vec.reference.model.Dims).
struct Config {
    int64_t vocab, hidden, intermediate, moe_intermediate, layers, heads;
    int64_t n_experts, n_shared, top_k, n_group, topk_group, first_dense;
    int64_t q_lora_rank;  // 0: no q_lora (q_proj instead)
    int64_t kv_lora_rank, nope, rope, v;
    double eps, latent_eps, routed_scaling_factor;
    bool norm_topk_prob;
    // RoPE (§4): per-pair inverse frequencies, cos/sin scale A, and the softmax scale (with YaRN's mscale²).
    std::vector<double> inv_freq;
    double attention_factor = 1.0, softmax_scale = 1.0;

    static Config from_bundle(const nlohmann::json &meta);
    bool is_moe(int64_t layer) const { return layer >= first_dense; }
};

// Per layer: expanded per-head keys k_nope [S, H, nope], values v [S, H, v], and the one shared roped
// key k_pe [S, rope]; plus each row's position. Rows in insertion order (the oracle's layout, §3).
struct KVCache {
    std::vector<std::vector<float>> k_nope, v, k_pe;
    std::vector<int64_t> positions;
    int64_t length = 0;  // committed rows; a forward writes its rows after them, then commits

    KVCache(const Config &c) : k_nope(c.layers), v(c.layers), k_pe(c.layers) {}
    // Keep only rows `keep` (old row keep[i] becomes row i): DDTree's compaction after verification.
    void keep(const Config &c, const std::vector<int64_t> &keep);
};

struct ForwardOut {
    std::vector<float> logits;                       // [rows_out, vocab]: every row, or the last only
    std::vector<float> hidden;                       // [layers, T, hidden] residual stream after each layer
    std::vector<std::vector<int>> router;            // per MoE layer: [T, top_k] expert ids, selection order
};

class Model {
public:
    Model(const Bundle &b, const Config &c);
    const Config &config() const { return c_; }

    // Runs tokens[T] at `positions` (default cache.length + t) through the model, appending their keys and
    // values to `cache`. `mask` [T, cache.length + T] (1 = may attend), default causal. `last_only`: logits of
    // the last row only.
    ForwardOut forward(const std::vector<int> &tokens, KVCache &cache, std::vector<int64_t> positions = {},
                       std::vector<uint8_t> mask = {}, bool last_only = false) const;

private:
    struct Mlp { Weight gate, up, down; };
    struct Layer {
        std::vector<float> input_norm, post_norm, q_a_norm, kv_a_norm;
        Weight q_proj, q_a, q_b, kv_a, kv_b, o;
        Mlp dense, shared;
        Weight router;
        std::vector<float> router_bias;
        std::vector<Mlp> experts;
    };

    void attention(int64_t i, const float *h, int64_t T, KVCache &cache, const std::vector<int64_t> &pos,
                   const std::vector<uint8_t> &mask, float *out) const;
    void swiglu(const Mlp &m, const float *h, int64_t T, float *out) const;
    void moe(int64_t i, const float *h, int64_t T, float *out, std::vector<int> &ids) const;
    std::vector<int> route(const Layer &L, const float *logits, std::vector<float> &weights) const;
    void rope(float *x, int64_t pos) const;

    Config c_;
    const float *embed = nullptr;  // [vocab, hidden], used in place
    std::vector<float> final_norm;
    Weight lm_head;
    std::vector<Layer> layers_;
};

// RMSNorm(x, w, eps) over n values, in place (§2).
void rms_norm(float *x, const float *w, int64_t n, double eps);

}  // namespace k2n
