import itertools
import re

import numpy as np
import pytest
import torch

from k2vec.ddtree import (
    TreeInputError, accept_walk, build_tree, compacted_kv_rows, top_k_logprobs, tree_attention_mask,
    tree_input_ids, tree_positions,
)

# Hand-worked example (also docs/ddtree.md): L = 3 positions, V = 4 tokens, stored in rank order.
# Log-probs are dyadic, so every score below is exact in float64 and the ties are real ties.
HAND_IDS = np.array([[2, 0, 3, 1],   # depth 1: tie at ranks 1, 2 (ids ascending)
                     [1, 3, 0, 2],   # depth 2
                     [0, 1, 2, 3]])  # depth 3: tie at ranks 0, 1
HAND_LP = np.array([[-0.5, -1.0, -1.0, -3.0],
                    [-0.25, -1.5, -2.0, -4.0],
                    [-0.5, -0.5, -2.5, -3.0]], dtype=np.float32)
# budget 6 -> K = min(6, 4) = 4. Heap trace, entries as rank tuple: score (min key = (-score, tuple)):
#   start             {(0): -0.5}
#   pop (0)     -> node 1 = token 2, depth 1, parent 0; push (1): -0.5+0.5-1.0 = -1.0,
#                  (0,0): -0.5-0.25 = -0.75
#   pop (0,0)   -> node 2 = token 1, depth 2, parent 1; push (0,1): -0.75+0.25-1.5 = -2.0, (0,0,0): -1.25
#   pop (1)     -> node 3 = token 0, depth 1, parent 0; push (2): -1.0+1.0-1.0 = -1.0, (1,0): -1.25
#   pop (2)     -> node 4 = token 3, depth 1, parent 0 [ties (1) at -1.0, and pops after it: (1) < (2)];
#                  push (3): -3.0, (2,0): -1.25
#   now a three-way tie at -1.25 among (0,0,0), (1,0), (2,0); the smallest tuple (0,0,0) wins:
#   pop (0,0,0) -> node 5 = token 0, depth 3, parent 2; push (0,0,1): -1.25+0.5-0.5 = -1.25 (no child: L = 3)
#   ties (0,0,1), (1,0), (2,0) at -1.25: (0,0,1) < (1,0)
#   pop (0,0,1) -> node 6 = token 1, depth 3, parent 2. Budget reached.
HAND_TOKENS = [2, 1, 0, 3, 0, 1]
HAND_DEPTHS = [1, 2, 1, 1, 3, 3]
HAND_RANKS = [0, 0, 1, 2, 0, 1]
HAND_PARENTS = [-1, 0, 1, 0, 0, 2, 2]
HAND_SCORES = [-0.5, -0.75, -1.0, -1.0, -1.25, -1.25]
HAND_ANCESTORS = [{0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 4}, {0, 1, 2, 5}, {0, 1, 2, 6}]


def test_hand_worked_example():
    t = build_tree((HAND_IDS, HAND_LP), 6)
    assert t.node_token_ids.tolist() == HAND_TOKENS
    assert t.node_depths.tolist() == HAND_DEPTHS
    assert t.node_ranks.tolist() == HAND_RANKS
    assert t.parents.tolist() == HAND_PARENTS
    assert t.node_scores.tolist() == HAND_SCORES
    assert t.child_maps == ({2: 1, 0: 3, 3: 4}, {1: 2}, {0: 5, 1: 6}, {}, {}, {}, {})
    expect = np.zeros((7, 7), bool)
    for i, anc in enumerate(HAND_ANCESTORS):
        expect[i, list(anc)] = True
    np.testing.assert_array_equal(t.visibility(), expect)


def test_smaller_budgets_are_prefixes_and_large_budget_takes_all():
    for b in range(0, 6):  # K = min(b, 4) shrinks too, yet the first b pops cannot change
        t = build_tree((HAND_IDS, HAND_LP), b)
        assert t.node_token_ids.tolist() == HAND_TOKENS[:b]
        assert t.parents.tolist() == HAND_PARENTS[: b + 1]
    assert build_tree((HAND_IDS, HAND_LP), 1000).n == 4 + 16 + 64


def test_stored_lists_use_first_min_budget_kstored_ranks():
    t = build_tree((HAND_IDS[:, :2], HAND_LP[:, :2]), 100)  # K_stored = 2 < budget: all 2 ranks, 2+4+8 nodes
    assert t.n == 14 and set(t.node_ranks.tolist()) == {0, 1}
    t = build_tree((HAND_IDS, HAND_LP), 2)  # K = 2: rank 2 of depth 1 is never offered
    assert t.node_token_ids.tolist() == [2, 1]


def test_empty_trees():
    for t in (build_tree((HAND_IDS, HAND_LP), 0), build_tree(np.zeros((0, 5), np.float32), 4),
              build_tree(np.zeros((3, 5), np.float32), 0)):
        assert t.n == 0 and t.parents.tolist() == [-1] and t.child_maps == ({},)
        np.testing.assert_array_equal(t.visibility(), [[True]])


def test_top_k_order_among_equal_logits():
    row = np.array([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]], np.float32)
    assert top_k_logprobs(row, 6)[0].tolist() == [[1, 2, 4, 5, 0, 3]]
    assert top_k_logprobs(row, 2)[0].tolist() == [[1, 2]]  # a tie straddling the cut keeps the lowest ids
    ids, lp = top_k_logprobs(row, 4)
    assert lp[0, 0] == lp[0, 1] == lp[0, 2] and lp.dtype == np.float32
    # x - lse in float32, lse = float32(max + log(sum exp((double)x_j - max)))
    lse = np.float32(3.0 + np.log(sum(np.exp(np.float64(v) - 3.0) for v in row[0])))
    np.testing.assert_array_equal(lp[0], np.float32([3.0, 3.0, 3.0, 2.0]) - lse)


def test_log_softmax_uses_a_correctly_rounded_logsumexp():
    # Large rows: a float32 reduction of 50k terms lands an ulp or more off; the float64 sum rounded once
    # agrees with an exactly rounded sum (math.fsum) here, in every row.
    import math
    x = (4 * np.random.default_rng(3).standard_normal((8, 50_000))).astype(np.float32)
    ids, lp = top_k_logprobs(x, 64)
    for d in range(8):
        x64 = x[d].astype(np.float64)
        lse = np.float32(x64.max() + math.log(math.fsum(np.exp(x64 - x64.max()).tolist())))
        np.testing.assert_array_equal(lp[d], x[d, ids[d]] - lse)


def test_logits_path_matches_torch_topk_and_logsumexp():
    rng = np.random.default_rng(7)
    for L, V, budget in [(15, 1000, 64), (4, 50, 16), (15, 300, 300), (6, 20, 64)]:
        logits = (3 * rng.standard_normal((L, V))).astype(np.float32)  # continuous: no ties
        K = min(budget, V)
        x = torch.from_numpy(logits)
        tl, ti = torch.topk(x, k=K, dim=-1)
        tlp = (tl - torch.logsumexp(x, dim=-1, keepdim=True)).numpy()
        ids, lp = top_k_logprobs(logits, K)
        np.testing.assert_array_equal(ids, ti.numpy())
        np.testing.assert_allclose(lp, tlp, rtol=0, atol=4e-6)
        # Same float32 subtraction as the reference: bit-equal except where torch's float32 logsumexp
        # is an ulp off the correctly rounded one (a single-rounding formula would match ~25% only).
        assert (lp == tlp).mean() > 0.6
        ours, theirs = build_tree(logits, budget), build_tree((ti.numpy(), tlp), budget)
        np.testing.assert_array_equal(ours.node_token_ids, theirs.node_token_ids)
        np.testing.assert_array_equal(ours.parents, theirs.parents)


def test_rejects_bad_inputs():
    with pytest.raises(TreeInputError, match="log-probs must be non-increasing along the rank axis"):
        build_tree((HAND_IDS, HAND_LP[:, ::-1]), 4)  # increasing log-probs
    with pytest.raises(TreeInputError, match="token ids must be distinct within each position"):
        build_tree((np.array([[1, 1]]), np.array([[-1.0, -2.0]], np.float32)), 4)  # duplicate sibling ids
    with pytest.raises(TreeInputError, match=re.escape("log-probs must be finite and <= 0")):
        build_tree((HAND_IDS, -HAND_LP), 4)  # positive log-probs
    with pytest.raises(TreeInputError, match=re.escape("log-probs must be finite and <= 0")):
        build_tree((np.array([[1, 2]]), np.array([[0.5, 0.25]], np.float32)), 4)  # positive, yet in order
    with pytest.raises(TreeInputError, match=re.escape("log-probs must be finite and <= 0")):
        build_tree((np.array([[1, 2]]), np.array([[-0.5, np.nan]], np.float32)), 4)
    with pytest.raises(TreeInputError, match="draft logits contain NaN or infinity"):
        build_tree(np.array([[0.0, np.nan]], np.float32), 2)
    with pytest.raises(TreeInputError, match="budget must be >= 0, got -1"):
        build_tree((HAND_IDS, HAND_LP), -1)


# ---------------------------------------------------------------- invariants on random inputs

def _rank_tuples(t):
    rt = [()]
    for i in range(t.n):
        rt.append(rt[t.parents[i + 1]] + (int(t.node_ranks[i]),))
    return rt[1:]


def _random_case(rng, kind: str):
    L, V = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    budget = int(rng.integers(1, 40))
    if kind == "logits":
        logits = (rng.standard_normal((L, V))).astype(np.float32)
        ids, lp = top_k_logprobs(logits, min(budget, V))
        return logits, ids, lp, budget
    K = int(rng.integers(1, V + 1))
    ids = np.stack([rng.permutation(V)[:K] for _ in range(L)])
    if kind == "dyadic":  # coarse values: many exact ties in rows and between different paths
        lp = -np.sort(rng.integers(0, 6, (L, K)), axis=1) / 4.0
    else:  # "mixed": magnitudes 1e-12..10, as confident rows give; float64 path sums are then inexact,
        # so the reference's incremental sibling update gives other bits than a direct sum would
        lp = -np.sort(10.0 ** rng.uniform(-12, 1, (L, K)), axis=1)
    lp = lp.astype(np.float32)
    return (ids, lp), ids, lp, budget


def _check_invariants(t, ids, lp, budget):
    L, K = lp.shape[0], min(budget, lp.shape[1])
    assert t.n == min(budget, sum(K**d for d in range(1, L + 1)))
    par = t.parents
    assert par[0] == -1 and all(0 <= par[i] < i for i in range(1, t.n + 1))
    depth = np.concatenate([[0], t.node_depths])
    np.testing.assert_array_equal(depth[1:], depth[par[1:]] + 1)
    assert (t.node_depths <= L).all() and (t.node_ranks < K).all()
    np.testing.assert_array_equal(t.node_token_ids, ids[t.node_depths - 1, t.node_ranks])
    for p in range(t.n + 1):
        kids = np.flatnonzero(par == p)
        toks = t.node_token_ids[kids - 1].tolist()
        assert len(set(toks)) == len(toks)
        assert t.child_maps[p] == dict(zip(toks, kids.tolist()))
    # Scores follow the reference's arithmetic exactly: first child = parent + lp[d, 0],
    # next sibling = (previous sibling - lp[d, r-1]) + lp[d, r]; the previous sibling is always in the tree.
    lp64 = lp.astype(np.float64)
    score = np.concatenate([[0.0], t.node_scores])
    rt = _rank_tuples(t)
    index = {r: i + 1 for i, r in enumerate(rt)}
    for i, r in enumerate(rt, start=1):
        d = len(r) - 1
        if r[-1] == 0:
            assert score[i] == score[par[i]] + lp64[d, 0]
        else:
            prev = index[r[:-1] + (r[-1] - 1,)]
            assert score[i] == score[prev] - lp64[d, r[-1] - 1] + lp64[d, r[-1]]
    # Best-first: no unselected frontier prefix (first child or next sibling of a node) scores higher.
    frontier = [r + (0,) for r in rt if len(r) < L] + [r[:-1] + (r[-1] + 1,) for r in rt if r[-1] + 1 < K]
    frontier = [f for f in frontier if f not in index]
    if frontier:
        best_out = max(sum(lp64[d, k] for d, k in enumerate(f)) for f in frontier)
        assert t.node_scores.min() >= best_out - 1e-9
    # Visibility is the ancestor relation.
    vis = t.visibility()
    for i in range(t.n + 1):
        anc, j = set(), i
        while j != -1:
            anc.add(j)
            j = par[j]
        assert set(np.flatnonzero(vis[i]).tolist()) == anc


@pytest.mark.parametrize("kind", ["logits", "dyadic", "mixed"])
def test_invariants_and_brute_force_on_random_inputs(kind):
    rng = np.random.default_rng(["logits", "dyadic", "mixed"].index(kind))
    checked_order = 0
    for _ in range(200):
        draft, ids, lp, budget = _random_case(rng, kind)
        t = build_tree(draft, budget)
        _check_invariants(t, ids, lp, budget)
        # Brute force: every prefix of the first K ranks, scored by a direct float64 sum.
        L, K = lp.shape[0], min(budget, lp.shape[1])
        pre = [r for d in range(1, L + 1) for r in itertools.product(range(K), repeat=d)]
        score = {r: sum(float(lp[d, k]) for d, k in enumerate(r)) for r in pre}
        got = _rank_tuples(t)
        if kind == "dyadic":  # exact arithmetic: pop order = (-score, rank tuple) order, ties included
            assert got == sorted(pre, key=lambda r: (-score[r], r))[: t.n]
            checked_order += 1
        else:  # rounding may reorder near-equal scores: compare the selected sets, clear margins only
            s = sorted(score.values(), reverse=True)
            if t.n < len(s) and s[t.n - 1] - s[t.n] < 1e-9:
                continue
            assert set(got) == set(sorted(pre, key=lambda r: -score[r])[: t.n])
            checked_order += 1
    assert checked_order > 150


# ---------------------------------------------------------------- walk and verify-pass helpers

def test_walk_on_hand_example():
    t = build_tree((HAND_IDS, HAND_LP), 6)
    assert accept_walk(t, np.array([2, 1, 1, 0, 0, 0, 3])) == ([0, 1, 2, 6], 3)
    assert accept_walk(t, np.array([2, 1, 0, 0, 0, 7, 3])) == ([0, 1, 2, 5], 7)
    assert accept_walk(t, np.array([0, 9, 9, 5, 9, 9, 9])) == ([0, 3], 5)  # node 3 has no children
    assert accept_walk(t, np.array([1, 9, 9, 9, 9, 9, 9])) == ([0], 1)  # no root child has token 1
    assert accept_walk(t, np.array([2, 3, 9, 9, 9, 9, 9])) == ([0, 1], 3)
    with pytest.raises(TreeInputError):
        accept_walk(t, np.zeros(6, np.int64))


def test_walk_follows_any_planted_path():
    rng = np.random.default_rng(5)
    for _ in range(100):
        draft, ids, lp, budget = _random_case(rng, "logits")
        t = build_tree(draft, budget)
        target = rng.integers(100, 200, t.n + 1)  # tokens no node has: the walk stops wherever not planted
        node, path = int(rng.integers(0, t.n + 1)), []
        while node != -1:
            path.append(node)
            node = t.parents[node]
        path = path[::-1]
        for a, b in zip(path, path[1:]):
            target[a] = t.node_token_ids[b - 1]
        assert accept_walk(t, target) == (path, int(target[path[-1]]))


def test_verify_pass_inputs_and_compaction():
    t = build_tree((HAND_IDS, HAND_LP), 6)
    assert tree_input_ids(t, 42).tolist() == [42] + HAND_TOKENS
    assert tree_positions(t, 10).tolist() == [10, 11, 12, 11, 11, 13, 13]
    m = tree_attention_mask(t, past_length=3)
    assert m.shape == (7, 10) and m.dtype == np.float32
    assert (m[:, :3] == 0).all()
    np.testing.assert_array_equal(m[:, 3:] == 0, t.visibility())
    assert (m[:, 3:][~t.visibility()] == np.finfo(np.float32).min).all()
    assert compacted_kv_rows(5, [0, 2, 6]).tolist() == [0, 1, 2, 3, 4, 5, 7, 11]
