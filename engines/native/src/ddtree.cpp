#include "ddtree.h"

#include <chrono>
#include <map>
#include <queue>
#include <stdexcept>

namespace k2n {

namespace {

struct Tree {
    std::vector<int> tokens, depths, parents;  // nodes 1..n (tokens, depths); parents[0..n], parents[0] = -1
    std::vector<std::map<int, int>> children;  // token -> child index, per node 0..n
};

// §2.4: best-first over rank paths. Popped first: the highest score; among equal scores the
// lexicographically smallest rank tuple (a proper prefix first).
struct Entry {
    double score;
    std::vector<int> ranks;
    int parent, depth, rank;
};
struct Later {
    bool operator()(const Entry &a, const Entry &b) const {  // true: a pops after b
        if (a.score != b.score) return a.score < b.score;
        return b.ranks < a.ranks;  // std::vector's < is lexicographic, a prefix first
    }
};

Tree build_tree(const Drafts &d, int64_t row, int budget) {
    const int64_t L = d.depth, K = std::min<int64_t>(budget, d.k);
    auto id = [&](int64_t depth, int64_t r) { return d.ids[(row * L + depth) * d.k + r]; };
    auto lp = [&](int64_t depth, int64_t r) { return static_cast<double>(d.logprobs[(row * L + depth) * d.k + r]); };
    Tree t;
    t.parents.push_back(-1);
    t.children.emplace_back();
    if (budget <= 0 || L == 0 || K == 0) return t;
    std::priority_queue<Entry, std::vector<Entry>, Later> heap;
    heap.push({lp(0, 0), {0}, 0, 1, 0});
    int n = 0;
    while (!heap.empty() && n < budget) {
        Entry e = heap.top();
        heap.pop();
        ++n;
        int token = id(e.depth - 1, e.rank);
        t.tokens.push_back(token);
        t.depths.push_back(e.depth);
        t.parents.push_back(e.parent);
        t.children.emplace_back();
        t.children[e.parent][token] = n;
        if (e.rank + 1 < K) {  // next sibling, exactly as written in §2.4: (score - lp) + lp'
            Entry s{(e.score - lp(e.depth - 1, e.rank)) + lp(e.depth - 1, e.rank + 1), e.ranks, e.parent, e.depth,
                    e.rank + 1};
            s.ranks.back() = e.rank + 1;
            heap.push(std::move(s));
        }
        if (e.depth < L) {  // first child
            Entry c{e.score + lp(e.depth, 0), e.ranks, n, e.depth + 1, 0};
            c.ranks.push_back(0);
            heap.push(std::move(c));
        }
    }
    return t;
}

}  // namespace

DDTreeResult ddtree_decode(const Model &m, const std::vector<int> &prompt, const Drafts &drafts, int budget,
                           int n_new, Timing &timing) {
    const Config &c = m.config();
    const int64_t P = static_cast<int64_t>(prompt.size());
    DDTreeResult res;
    KVCache cache(c);
    auto t0 = std::chrono::steady_clock::now();
    ForwardOut pre = m.forward(prompt, cache, {}, {}, /*last_only=*/true);
    timing.prefill_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int root = top_k(pre.logits.data(), c.vocab, 1)[0];
    res.tokens.push_back(root);
    int64_t s = P;  // the root's position; the cache holds positions 0..s-1
    while (static_cast<int>(res.tokens.size()) < n_new) {
        t0 = std::chrono::steady_clock::now();
        if (s - P >= drafts.n_starts) throw std::runtime_error("no recorded drafts for round start " + std::to_string(s));
        Tree tree = build_tree(drafts, s - P, budget);
        const int64_t n1 = static_cast<int64_t>(tree.parents.size()), past = cache.length, S = past + n1;
        Round r;
        r.start = s;
        r.tokens.push_back(root);
        r.tokens.insert(r.tokens.end(), tree.tokens.begin(), tree.tokens.end());
        r.parents = tree.parents;
        r.depths.push_back(0);
        r.depths.insert(r.depths.end(), tree.depths.begin(), tree.depths.end());
        // §3: positions s + depth; mask: every cached row, and in the tree block a node's ancestors and itself.
        std::vector<int64_t> pos(n1);
        std::vector<uint8_t> mask(n1 * S, 0);
        for (int64_t i = 0; i < n1; ++i) {
            pos[i] = s + r.depths[i];
            std::fill_n(&mask[i * S], past, 1);
            for (int64_t j = i; j >= 0; j = tree.parents[j]) mask[i * S + past + j] = 1;
        }
        ForwardOut out = m.forward(r.tokens, cache, pos, mask);
        // §4: walk the target's argmax down the tree; the bonus is the argmax at the last accepted node.
        std::vector<int> argmax(n1);
        for (int64_t i = 0; i < n1; ++i) argmax[i] = top_k(&out.logits[i * c.vocab], c.vocab, 1)[0];
        int cur = 0;
        r.accepted.push_back(0);
        for (auto it = tree.children[cur].find(argmax[cur]); it != tree.children[cur].end();
             it = tree.children[cur].find(argmax[cur])) {
            cur = it->second;
            r.accepted.push_back(cur);
        }
        r.bonus = argmax[cur];
        // KV compaction: rows 0..past-1, then the accepted nodes' rows in path order.
        std::vector<int64_t> keep(past);
        for (int64_t j = 0; j < past; ++j) keep[j] = j;
        for (int a : r.accepted) keep.push_back(past + a);
        cache.keep(c, keep);
        for (size_t a = 1; a < r.accepted.size(); ++a) res.tokens.push_back(r.tokens[r.accepted[a]]);
        res.tokens.push_back(r.bonus);
        s += static_cast<int64_t>(r.accepted.size());
        root = r.bonus;
        res.rounds.push_back(std::move(r));
        timing.decode_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    res.tokens.resize(n_new);
    return res;
}

}  // namespace k2n
