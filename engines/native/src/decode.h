// Decoding modes (docs/engine-contract.md §2): greedy, and score (forced decoding of the golden tokens).
// Step j is the forward whose last row chooses token j: step 0 feeds the whole prompt (prefill), step j > 0
// feeds one token through the KV cache (decode).
#pragma once

#include <vector>

#include "model.h"

namespace k2n {

struct PromptResult {
    std::vector<int> tokens;                                    // [N] the engine's argmax at each step
    std::vector<std::vector<int>> topk_ids;                     // [N][K] descending logit, ties to the lower id
    std::vector<std::vector<float>> topk_logits;                // [N][K]
    std::vector<std::vector<std::vector<float>>> fingerprints;  // [N][layers][hidden], the token fed at step j
    std::vector<std::vector<std::vector<int>>> router;          // [fed rows][MoE layers][top_k]
};

struct Timing {
    double prefill_s = 0, decode_s = 0;
};

// The K largest logits of a row [vocab], descending, ties to the lower token id (§7).
std::vector<int> top_k(const float *logits, int64_t vocab, int64_t k);

// One prompt, `n_new` steps. forced == nullptr: greedy (feeds its own argmax); else score mode: feeds
// forced[0..n_new-2] and records the router of every fed position, prompt included.
PromptResult decode(const Model &m, const std::vector<int> &prompt, int n_new, int k, const std::vector<int> *forced,
                    Timing &timing);

}  // namespace k2n
