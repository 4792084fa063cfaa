#include "decode.h"

#include <algorithm>
#include <chrono>
#include <numeric>

namespace k2n {

std::vector<int> top_k(const float *logits, int64_t vocab, int64_t k) {
    std::vector<int> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    k = std::min(k, vocab);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [logits](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ids.resize(k);
    return ids;
}

PromptResult decode(const Model &m, const std::vector<int> &prompt, int n_new, int k, const std::vector<int> *forced,
                    Timing &timing) {
    const Config &c = m.config();
    const int64_t D = c.hidden;
    PromptResult r;
    KVCache cache(c);
    std::vector<int> feed = prompt;
    for (int step = 0; step < n_new; ++step) {
        auto t0 = std::chrono::steady_clock::now();
        ForwardOut out = m.forward(feed, cache, {}, {}, /*last_only=*/true);
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        (step == 0 ? timing.prefill_s : timing.decode_s) += dt;

        const int64_t T = static_cast<int64_t>(feed.size());
        std::vector<int> best = top_k(out.logits.data(), c.vocab, k);
        r.tokens.push_back(best[0]);
        r.topk_ids.push_back(best);
        std::vector<float> vals;
        for (int id : best) vals.push_back(out.logits[id]);
        r.topk_logits.push_back(vals);
        std::vector<std::vector<float>> fp(c.layers);  // the residual stream of the last fed row, per layer
        for (int64_t i = 0; i < c.layers; ++i) {
            const float *h = &out.hidden[(i * T + T - 1) * D];
            fp[i].assign(h, h + D);
        }
        r.fingerprints.push_back(std::move(fp));
        // Router: greedy records the token fed at each step (the last prompt token first); score, every row.
        for (int64_t t = forced ? 0 : T - 1; t < T; ++t) {
            std::vector<std::vector<int>> row;
            for (const auto &layer : out.router)
                row.emplace_back(layer.begin() + t * c.top_k, layer.begin() + (t + 1) * c.top_k);
            r.router.push_back(std::move(row));
        }
        feed.assign(1, forced ? (*forced)[step] : best[0]);
    }
    return r;
}

}  // namespace k2n
