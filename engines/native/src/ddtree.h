// DDTree mode (docs/ddtree.md): per round, a draft tree built best-first from the recorded drafter's lists,
// verified in one forward with the ancestor mask at positions s + depth, accepted by walking the target's
// argmax down the tree, and the KV cache compacted to the accepted path.
#pragma once

#include <vector>

#include "decode.h"
#include "model.h"

namespace k2n {

// The recorded drafter's lists of one prompt and accuracy: ids/logprobs [n_starts, L, K] (§5).
struct Drafts {
    std::vector<int> ids;
    std::vector<float> logprobs;
    int64_t n_starts = 0, depth = 0, k = 0;
};

struct Round {
    int64_t start = 0;                 // position of the root
    std::vector<int> tokens;           // root, then the tree's tokens in node order
    std::vector<int> parents, depths;  // parents[0] = -1, depths[0] = 0
    std::vector<int> accepted;         // accepted node indices, 0 first
    int bonus = 0;
};

struct DDTreeResult {
    std::vector<int> tokens;  // [n_new]
    std::vector<Round> rounds;
};

DDTreeResult ddtree_decode(const Model &m, const std::vector<int> &prompt, const Drafts &drafts, int budget,
                           int n_new, Timing &timing);

}  // namespace k2n
