#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace k2n {

namespace {

using nlohmann::json;

int64_t get_int(const json &c, const char *key, int64_t fallback) {
    return c.contains(key) && !c[key].is_null() ? c[key].get<int64_t>() : fallback;
}

int64_t need_int(const json &c, const char *key) {
    if (!c.contains(key) || c[key].is_null()) throw std::runtime_error(std::string("hf_config.") + key + " missing");
    return c[key].get<int64_t>();
}

// A number from the RoPE settings; 0 where absent or null (the callers apply the reference's defaults).
double num(const json &p, const char *key) {
    return p.contains(key) && !p[key].is_null() ? p[key].get<double>() : 0.0;
}

double yarn_mscale(double factor, double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// σ(z) = 0.5 + 0.5·tanh(z/2): the oracle's form, no overflow for large |z| (§0).
float sigmoid(float z) { return 0.5f + 0.5f * std::tanh(0.5f * z); }

std::vector<float> vec(const Bundle &b, const std::string &name, int64_t n) {
    if (b.numel(name) != static_cast<uint64_t>(n)) throw std::runtime_error("tensor " + name + ": wrong size");
    const float *p = static_cast<const float *>(b.data(name, KDTR_F32));
    return std::vector<float>(p, p + n);
}

}  // namespace

// ---------------------------------------------------------------------------------------- config

Config Config::from_bundle(const json &meta) {
    const json &h = meta.at("hf_config");
    Config c{};
    c.vocab = need_int(h, "vocab_size");
    c.hidden = need_int(h, "hidden_size");
    c.intermediate = need_int(h, "intermediate_size");
    c.moe_intermediate = need_int(h, "moe_intermediate_size");
    c.layers = need_int(h, "num_hidden_layers");
    c.heads = need_int(h, "num_attention_heads");
    c.n_experts = get_int(h, "n_routed_experts", 0);
    c.n_shared = get_int(h, "n_shared_experts", 0);
    c.top_k = get_int(h, "num_experts_per_tok", 0);
    c.n_group = std::max<int64_t>(1, get_int(h, "n_group", 1));
    c.topk_group = std::max<int64_t>(1, get_int(h, "topk_group", 1));
    c.first_dense = get_int(h, "first_k_dense_replace", 0);
    c.q_lora_rank = get_int(h, "q_lora_rank", 0);
    c.kv_lora_rank = need_int(h, "kv_lora_rank");
    c.nope = need_int(h, "qk_nope_head_dim");
    c.rope = need_int(h, "qk_rope_head_dim");
    c.v = need_int(h, "v_head_dim");
    c.eps = h.at("rms_norm_eps").get<double>();
    // §2: the latent norms use the reference's ε (transformers' 1e-6), recorded in the golden metadata.
    c.latent_eps = meta.at("golden").at("reference").at("latent_norm_eps").get<double>();
    c.routed_scaling_factor = h.contains("routed_scaling_factor") ? h["routed_scaling_factor"].get<double>() : 1.0;
    c.norm_topk_prob = h.value("norm_topk_prob", false);
    if (h.value("hidden_act", std::string("silu")) != "silu") throw std::runtime_error("hidden_act must be silu");
    if (c.rope % 2) throw std::runtime_error("qk_rope_head_dim must be even");
    if (c.first_dense < c.layers && (c.n_experts % c.n_group || c.n_experts / c.n_group < 2))
        throw std::runtime_error("n_group must divide n_routed_experts, at least 2 experts per group");

    // §4.2: rope_parameters (HF v5) or rope_scaling + top-level rope_theta (DeepSeek/Kimi spelling).
    json p = h.contains("rope_parameters") && !h["rope_parameters"].is_null() ? h["rope_parameters"]
             : h.contains("rope_scaling") && !h["rope_scaling"].is_null()   ? h["rope_scaling"]
                                                                             : json::object();
    double theta = p.contains("rope_theta") ? num(p, "rope_theta") : h.contains("rope_theta") ? num(h, "rope_theta") : 0;
    if (theta == 0) theta = 10000.0;
    std::string type = p.contains("rope_type") && !p["rope_type"].is_null() ? p["rope_type"].get<std::string>()
                       : p.contains("type") && !p["type"].is_null()         ? p["type"].get<std::string>()
                                                                            : "default";
    const int64_t d = c.rope;
    c.inv_freq.resize(d / 2);
    for (int64_t i = 0; i < d / 2; ++i) c.inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / d);
    double softmax_mult = 1.0;
    if (type == "yarn") {
        double L = num(p, "original_max_position_embeddings");
        double f = p.contains("factor") && !p["factor"].is_null() ? num(p, "factor")
                                                                  : need_int(h, "max_position_embeddings") / L;
        double mscale = num(p, "mscale"), mscale_all = num(p, "mscale_all_dim");
        if (p.contains("attention_factor") && !p["attention_factor"].is_null())
            c.attention_factor = num(p, "attention_factor");
        else if (mscale != 0 && mscale_all != 0)
            c.attention_factor = yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all);
        else
            c.attention_factor = yarn_mscale(f, 1.0);
        double beta_fast = num(p, "beta_fast") != 0 ? num(p, "beta_fast") : 32.0;  // 0 or absent: default
        double beta_slow = num(p, "beta_slow") != 0 ? num(p, "beta_slow") : 1.0;
        // pair index whose wavelength makes r turns over the original context
        auto dim = [&](double r) { return d * std::log(L / (2 * M_PI * r)) / (2 * std::log(theta)); };
        double low = dim(beta_fast), high = dim(beta_slow);
        if (!p.contains("truncate") || p["truncate"].is_null() || p["truncate"].get<bool>()) {
            low = std::floor(low);
            high = std::ceil(high);
        }
        low = std::max(low, 0.0);
        high = std::min(high, static_cast<double>(d - 1));
        if (low == high) high += 0.001;  // no zero-width ramp
        for (int64_t i = 0; i < d / 2; ++i) {
            double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);  // 0: keep, 1: interpolate by f
            c.inv_freq[i] = c.inv_freq[i] / f * ramp + c.inv_freq[i] * (1.0 - ramp);
        }
        if (mscale_all != 0) softmax_mult = yarn_mscale(f, mscale_all) * yarn_mscale(f, mscale_all);
    } else if (type != "default") {
        throw std::runtime_error("only default and yarn RoPE are implemented, got " + type);
    }
    c.softmax_scale = std::pow(static_cast<double>(c.nope + c.rope), -0.5) * softmax_mult;
    return c;
}

// ---------------------------------------------------------------------------------------- cache

void KVCache::keep(const Config &c, const std::vector<int64_t> &rows) {
    const int64_t kn = c.heads * c.nope, kv = c.heads * c.v, kp = c.rope;
    for (int64_t l = 0; l < c.layers; ++l) {
        std::vector<float> a(rows.size() * kn), b(rows.size() * kv), e(rows.size() * kp);
        for (size_t i = 0; i < rows.size(); ++i) {
            std::copy_n(&k_nope[l][rows[i] * kn], kn, &a[i * kn]);
            std::copy_n(&v[l][rows[i] * kv], kv, &b[i * kv]);
            std::copy_n(&k_pe[l][rows[i] * kp], kp, &e[i * kp]);
        }
        k_nope[l].swap(a);
        v[l].swap(b);
        k_pe[l].swap(e);
    }
    std::vector<int64_t> p(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) p[i] = positions[rows[i]];
    positions.swap(p);
    length = static_cast<int64_t>(rows.size());
}

// ---------------------------------------------------------------------------------------- weights

Model::Model(const Bundle &b, const Config &c) : c_(c) {
    const int64_t D = c.hidden, H = c.heads, qk = c.nope + c.rope;
    if (b.numel("model.embed_tokens.weight") != static_cast<uint64_t>(c.vocab * D))
        throw std::runtime_error("model.embed_tokens.weight: wrong size");
    embed = static_cast<const float *>(b.data("model.embed_tokens.weight", KDTR_F32));
    final_norm = vec(b, "model.norm.weight", D);
    lm_head = load_weight(b, "lm_head.weight", c.vocab, D);  // its own tensor: embeddings are not tied (§7)
    auto mlp = [&](const std::string &p, int64_t width) {
        return Mlp{load_weight(b, p + "gate_proj.weight", width, D), load_weight(b, p + "up_proj.weight", width, D),
                   load_weight(b, p + "down_proj.weight", D, width)};
    };
    for (int64_t i = 0; i < c.layers; ++i) {
        std::string p = "model.layers." + std::to_string(i) + ".", a = p + "self_attn.";
        Layer L;
        L.input_norm = vec(b, p + "input_layernorm.weight", D);
        L.post_norm = vec(b, p + "post_attention_layernorm.weight", D);
        if (c.q_lora_rank) {
            L.q_a = load_weight(b, a + "q_a_proj.weight", c.q_lora_rank, D);
            L.q_a_norm = vec(b, a + "q_a_layernorm.weight", c.q_lora_rank);
            L.q_b = load_weight(b, a + "q_b_proj.weight", H * qk, c.q_lora_rank);
        } else {
            L.q_proj = load_weight(b, a + "q_proj.weight", H * qk, D);
        }
        L.kv_a = load_weight(b, a + "kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.rope, D);
        L.kv_a_norm = vec(b, a + "kv_a_layernorm.weight", c.kv_lora_rank);
        L.kv_b = load_weight(b, a + "kv_b_proj.weight", H * (c.nope + c.v), c.kv_lora_rank);
        L.o = load_weight(b, a + "o_proj.weight", D, H * c.v);
        if (!c.is_moe(i)) {
            L.dense = mlp(p + "mlp.", c.intermediate);
        } else {
            L.router = load_weight(b, p + "mlp.gate.weight", c.n_experts, D);
            L.router_bias = vec(b, p + "mlp.gate.e_score_correction_bias", c.n_experts);
            for (int64_t e = 0; e < c.n_experts; ++e)
                L.experts.push_back(mlp(p + "mlp.experts." + std::to_string(e) + ".", c.moe_intermediate));
            if (c.n_shared) L.shared = mlp(p + "mlp.shared_experts.", c.n_shared * c.moe_intermediate);
        }
        layers_.push_back(std::move(L));
    }
}

// ---------------------------------------------------------------------------------------- blocks

void rms_norm(float *x, const float *w, int64_t n, double eps) {
    float ms = dot(x, x, n) / static_cast<float>(n);
    float inv = 1.0f / std::sqrt(ms + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] * inv * w[i];
}

// §4.1: rotate interleaved pairs (x[2i], x[2i+1]) by pos·inv_freq[i]; cos and sin carry A. The angle and its
// cos/sin are taken in double (as the oracle), then rounded once to float32.
void Model::rope(float *x, int64_t pos) const {
    for (int64_t i = 0; i < c_.rope / 2; ++i) {
        double angle = static_cast<double>(pos) * c_.inv_freq[i];
        float cs = static_cast<float>(std::cos(angle) * c_.attention_factor);
        float sn = static_cast<float>(std::sin(angle) * c_.attention_factor);
        float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * cs - b * sn;
        x[2 * i + 1] = b * cs + a * sn;
    }
}

// §3: MLA for rows h [T, D]; their keys/values go to cache rows [length, length + T).
void Model::attention(int64_t i, const float *h, int64_t T, KVCache &cache, const std::vector<int64_t> &pos,
                      const std::vector<uint8_t> &mask, float *out) const {
    const Layer &L = layers_[i];
    const int64_t H = c_.heads, qk = c_.nope + c_.rope, r_kv = c_.kv_lora_rank;
    std::vector<float> q(T * H * qk);
    if (c_.q_lora_rank) {
        std::vector<float> qa(T * c_.q_lora_rank);
        linear(L.q_a, h, T, qa.data());
        for (int64_t t = 0; t < T; ++t) rms_norm(&qa[t * c_.q_lora_rank], L.q_a_norm.data(), c_.q_lora_rank, c_.latent_eps);
        linear(L.q_b, qa.data(), T, q.data());
    } else {
        linear(L.q_proj, h, T, q.data());
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t hd = 0; hd < H; ++hd) rope(&q[(t * H + hd) * qk + c_.nope], pos[t]);

    // One shared projection: the kv latent (normed, then expanded per head) and the single rope key.
    std::vector<float> kv_a(T * (r_kv + c_.rope)), kv(T * H * (c_.nope + c_.v));
    linear(L.kv_a, h, T, kv_a.data());
    std::vector<float> latent(T * r_kv);
    const int64_t n0 = cache.length, S = n0 + T;
    cache.k_nope[i].resize(S * H * c_.nope);
    cache.v[i].resize(S * H * c_.v);
    cache.k_pe[i].resize(S * c_.rope);
    for (int64_t t = 0; t < T; ++t) {
        const float *row = &kv_a[t * (r_kv + c_.rope)];
        std::copy_n(row, r_kv, &latent[t * r_kv]);
        rms_norm(&latent[t * r_kv], L.kv_a_norm.data(), r_kv, c_.latent_eps);
        float *kpe = &cache.k_pe[i][(n0 + t) * c_.rope];
        std::copy_n(row + r_kv, c_.rope, kpe);
        rope(kpe, pos[t]);
    }
    linear(L.kv_b, latent.data(), T, kv.data());
    for (int64_t t = 0; t < T; ++t)
        for (int64_t hd = 0; hd < H; ++hd) {
            const float *src = &kv[(t * H + hd) * (c_.nope + c_.v)];
            std::copy_n(src, c_.nope, &cache.k_nope[i][((n0 + t) * H + hd) * c_.nope]);
            std::copy_n(src + c_.nope, c_.v, &cache.v[i][((n0 + t) * H + hd) * c_.v]);
        }

    // Scores over every cached row then the new rows, masked; softmax; weighted values.
    std::vector<float> o(T * H * c_.v, 0.0f), s(S);
    const float scale = static_cast<float>(c_.softmax_scale);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t hd = 0; hd < H; ++hd) {
            const float *qn = &q[(t * H + hd) * qk], *qp = qn + c_.nope;
            float mx = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < S; ++j) {
                bool visible = mask.empty() ? j <= n0 + t : mask[t * S + j] != 0;
                if (!visible) continue;
                s[j] = (dot(qn, &cache.k_nope[i][(j * H + hd) * c_.nope], c_.nope) +
                        dot(qp, &cache.k_pe[i][j * c_.rope], c_.rope)) * scale;
                mx = std::max(mx, s[j]);
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < S; ++j) {
                bool visible = mask.empty() ? j <= n0 + t : mask[t * S + j] != 0;
                s[j] = visible ? std::exp(s[j] - mx) : 0.0f;
                sum += s[j];
            }
            float *oh = &o[(t * H + hd) * c_.v];
            for (int64_t j = 0; j < S; ++j) {
                if (s[j] == 0.0f) continue;
                const float p = s[j] / sum, *vj = &cache.v[i][(j * H + hd) * c_.v];
                for (int64_t e = 0; e < c_.v; ++e) oh[e] += p * vj[e];
            }
        }
    linear(L.o, o.data(), T, out);  // heads concatenated: column h·d_v + c is head h, channel c
}

// §5: SwiGLU, silu(h·gateᵀ) ⊙ (h·upᵀ), then ·downᵀ.
void Model::swiglu(const Mlp &m, const float *h, int64_t T, float *out) const {
    const int64_t I = m.gate.rows;
    std::vector<float> g(T * I), u(T * I);
    linear(m.gate, h, T, g.data());
    linear(m.up, h, T, u.data());
    for (int64_t k = 0; k < T * I; ++k) g[k] = g[k] * sigmoid(g[k]) * u[k];
    linear(m.down, g.data(), T, out);
}

// §6 routing for one token's router logits [E]: the chosen experts (descending biased score, ties to the
// lower id) and their weights (unbiased sigmoid scores, renormalised, times routed_scaling_factor).
std::vector<int> Model::route(const Layer &L, const float *logits, std::vector<float> &weights) const {
    const int64_t E = c_.n_experts, per = E / c_.n_group;
    std::vector<float> score(E), choice(E);
    for (int64_t e = 0; e < E; ++e) {
        score[e] = sigmoid(logits[e]);
        choice[e] = score[e] + L.router_bias[e];  // the bias steers selection only
    }
    auto before = [](const std::vector<float> &v) {  // descending value, ties to the lower index
        return [&v](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
    };
    if (c_.n_group > 1) {
        std::vector<float> gscore(c_.n_group);
        for (int64_t g = 0; g < c_.n_group; ++g) {  // a group's score: the sum of its 2 best biased scores
            std::vector<float> in(choice.begin() + g * per, choice.begin() + (g + 1) * per);
            std::partial_sort(in.begin(), in.begin() + 2, in.end(), std::greater<float>());
            gscore[g] = in[0] + in[1];
        }
        std::vector<int> groups(c_.n_group);
        std::iota(groups.begin(), groups.end(), 0);
        std::sort(groups.begin(), groups.end(), before(gscore));
        for (int64_t r = c_.topk_group; r < c_.n_group; ++r)  // dropped groups: out of the running
            for (int64_t e = groups[r] * per; e < (groups[r] + 1) * per; ++e)
                choice[e] = -std::numeric_limits<float>::infinity();
    }
    std::vector<int> ids(E);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + c_.top_k, ids.end(), before(choice));
    ids.resize(c_.top_k);
    weights.resize(c_.top_k);
    float sum = 0.0f;
    for (int64_t j = 0; j < c_.top_k; ++j) sum += (weights[j] = score[ids[j]]);
    for (int64_t j = 0; j < c_.top_k; ++j) {
        if (c_.norm_topk_prob) weights[j] = weights[j] / (sum + 1e-20f);
        weights[j] = weights[j] * static_cast<float>(c_.routed_scaling_factor);
    }
    return ids;
}

// §6: y = Σ_j w_j · Expert_{ids_j}(h) (ascending expert id, as the oracle sums) + Shared(h). ids: [T, top_k].
void Model::moe(int64_t i, const float *h, int64_t T, float *out, std::vector<int> &ids) const {
    const Layer &L = layers_[i];
    const int64_t D = c_.hidden, E = c_.n_experts, k = c_.top_k;
    std::vector<float> logits(T * E);
    linear(L.router, h, T, logits.data());
    ids.assign(T * k, 0);
    std::vector<std::vector<float>> w(T);
    for (int64_t t = 0; t < T; ++t) {
        std::vector<int> chosen = route(L, &logits[t * E], w[t]);
        std::copy(chosen.begin(), chosen.end(), &ids[t * k]);
    }
    std::fill(out, out + T * D, 0.0f);
    std::vector<float> xe, ye;
    for (int64_t e = 0; e < E; ++e) {  // each expert once, over all the rows routed to it
        std::vector<int64_t> rows, slot;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j)
                if (ids[t * k + j] == e) rows.push_back(t), slot.push_back(j);
        if (rows.empty()) continue;
        const int64_t R = static_cast<int64_t>(rows.size());
        xe.resize(R * D);
        ye.resize(R * D);
        for (int64_t r = 0; r < R; ++r) std::copy_n(h + rows[r] * D, D, &xe[r * D]);
        swiglu(L.experts[e], xe.data(), R, ye.data());
        for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < D; ++c) out[rows[r] * D + c] += w[rows[r]][slot[r]] * ye[r * D + c];
    }
    if (c_.n_shared) {  // shared experts: unweighted, no routed_scaling_factor
        ye.resize(T * D);
        swiglu(L.shared, h, T, ye.data());
        for (int64_t k2 = 0; k2 < T * D; ++k2) out[k2] += ye[k2];
    }
}

// ---------------------------------------------------------------------------------------- forward

ForwardOut Model::forward(const std::vector<int> &tokens, KVCache &cache, std::vector<int64_t> positions,
                          std::vector<uint8_t> mask, bool last_only) const {
    const int64_t T = static_cast<int64_t>(tokens.size()), D = c_.hidden, S = cache.length + T;
    if (T == 0) throw std::runtime_error("forward needs at least one token");
    if (positions.empty())
        for (int64_t t = 0; t < T; ++t) positions.push_back(cache.length + t);
    if (static_cast<int64_t>(positions.size()) != T) throw std::runtime_error("one position per token");
    if (!mask.empty()) {
        if (static_cast<int64_t>(mask.size()) != T * S) throw std::runtime_error("mask must be [T, cache + T]");
        for (int64_t t = 0; t < T; ++t)
            if (std::none_of(&mask[t * S], &mask[t * S] + S, [](uint8_t m) { return m != 0; }))
                throw std::runtime_error("mask: a token that attends to nothing");
    }
    ForwardOut res;
    res.hidden.resize(c_.layers * T * D);
    std::vector<float> x(T * D), hn(T * D), y(T * D);
    for (int64_t t = 0; t < T; ++t) {
        if (tokens[t] < 0 || tokens[t] >= c_.vocab) throw std::runtime_error("token id out of range");
        std::copy_n(embed + static_cast<int64_t>(tokens[t]) * D, D, &x[t * D]);
    }
    auto norm = [&](const std::vector<float> &w) {
        hn = x;
        for (int64_t t = 0; t < T; ++t) rms_norm(&hn[t * D], w.data(), D, c_.eps);
    };
    for (int64_t i = 0; i < c_.layers; ++i) {
        const Layer &L = layers_[i];
        norm(L.input_norm);
        attention(i, hn.data(), T, cache, positions, mask, y.data());
        for (int64_t k = 0; k < T * D; ++k) x[k] += y[k];
        norm(L.post_norm);
        if (!c_.is_moe(i)) {
            swiglu(L.dense, hn.data(), T, y.data());
        } else {
            res.router.emplace_back();
            moe(i, hn.data(), T, y.data(), res.router.back());
        }
        for (int64_t k = 0; k < T * D; ++k) x[k] += y[k];
        std::copy(x.begin(), x.end(), &res.hidden[i * T * D]);  // fingerprint[i] (§1)
    }
    cache.positions.insert(cache.positions.end(), positions.begin(), positions.end());
    cache.length = S;

    const int64_t first = last_only ? T - 1 : 0, R = T - first;
    hn.assign(x.begin() + first * D, x.end());
    for (int64_t r = 0; r < R; ++r) rms_norm(&hn[r * D], final_norm.data(), D, c_.eps);
    res.logits.resize(R * c_.vocab);
    linear(lm_head, hn.data(), R, res.logits.data());
    return res;
}

}  // namespace k2n
