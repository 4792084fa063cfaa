"""DDTree draft-tree construction (Ringel & Romano, arXiv 2604.12989), pinned bit for bit.

This follows `build_ddtree_tree` in the authors' `ddtree.py`: per depth the top-K tokens, K = min(budget, V),
their float32 log-probabilities, then a best-first heap over rank tuples that pops at most `budget` prefixes.
The authors' code leaves two things unspecified; we pin them (docs/ddtree.md says the same):
  * the order of equal logits in the top-K list (`torch.topk` guarantees none): higher logit first, then
    lower token id first;
  * how the float32 log-softmax is computed: as the reference, float32 `top_logit - logsumexp(row)`, with
    the float32 logsumexp pinned to the rounding of a float64 max-shifted sum, which does not depend on the
    summation order of V terms (a float32 reduction does).
The heap itself (float64 scores, incremental sibling update, (-score, rank tuple) ordering) is the authors'.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from k2vec.errors import K2VecError


class TreeInputError(K2VecError, ValueError):
    """Draft inputs that the tree builder cannot use (shape, dtype, non-finite or unsorted values)."""


@dataclass(frozen=True)
class Tree:
    """A draft tree. Index 0 is the root (the round's last committed token); nodes 1..n in pop order.

    Arrays over the n non-root nodes (node i+1 is entry i): `node_token_ids`, `node_depths` (1..L),
    `node_ranks` (the node's rank in its depth's top-K list), `node_scores` (float64 sum of log-probs
    along the root-to-node path, as the heap computed it). `parents` has n+1 entries, parents[0] = -1.
    `child_maps[i]` maps token id -> child index of node i.
    """

    node_token_ids: np.ndarray  # int32 [n]
    node_depths: np.ndarray  # int32 [n]
    node_ranks: np.ndarray  # int32 [n]
    node_scores: np.ndarray  # float64 [n]
    parents: np.ndarray  # int32 [n+1]
    child_maps: tuple[dict[int, int], ...]

    @property
    def n(self) -> int:
        return int(self.node_token_ids.shape[0])

    def visibility(self) -> np.ndarray:
        """(n+1)x(n+1) bool: vis[i, j] is True iff j is i or an ancestor of i (the root included)."""
        return ancestor_visibility(self.parents, self.node_depths)


def ancestor_visibility(parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """The ancestor-only mask of a tree given as `parents` (int [n+1], parents[0] = -1, node 0 the root) and
    the depths of its nodes (int, the root's 0 included or not: only the largest is used, as the number of
    climbing steps). (n+1)x(n+1) bool: vis[i, j] is True iff j is i or an ancestor of i."""
    n1 = len(parents)
    vis = np.zeros((n1, n1), dtype=bool)
    rows = np.arange(n1)
    up = np.asarray(parents).astype(np.intp)
    up[0] = 0  # the root is its own parent, so the climb stops there
    anc = rows.copy()
    # Climb one level per step, marking each ancestor: depth <= max depth, so max depth + 1 steps suffice.
    for _ in range(int(np.max(depths, initial=0)) + 1):
        vis[rows, anc] = True
        anc = up[anc]
    return vis


def top_k_logprobs(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of float32 `logits` [L, V]: the top-k token ids (int32) and their float32 log-softmax.

    Order: logit descending, equal logits by token id ascending. Log-prob of token x in a row with max m:
    x - lse in float32, where lse = float32((double)m + log(sum_j exp((double)x_j - (double)m))).
    """
    x = np.asarray(logits)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.floating):
        raise TreeInputError(f"draft logits must be a 2-D float array [L, V], got {x.dtype} {x.shape}")
    x = x.astype(np.float32, copy=False)  # the reference works on draft_logits.float()
    L, V = x.shape
    if not 1 <= k <= V:
        raise TreeInputError(f"top-k size {k} must be in 1..V={V}")
    if not np.isfinite(x).all():
        raise TreeInputError("draft logits contain NaN or infinity")
    ids = np.empty((L, k), dtype=np.int32)
    if L:
        kth = np.partition(x, V - k, axis=1)[:, V - k]  # the k-th largest logit of each row
        for d in range(L):
            # Every entry >= the k-th largest, ids ascending; a stable sort on -logit then puts equal
            # logits in id order, and ties straddling the cut keep their lowest ids.
            cand = np.flatnonzero(x[d] >= kth[d])
            ids[d] = cand[np.argsort(-x[d, cand], kind="stable")[:k]]
    x64 = x.astype(np.float64)
    m = x64.max(axis=1, keepdims=True) if L else np.zeros((0, 1))
    lse = (m + np.log(np.exp(x64 - m).sum(axis=1, keepdims=True))).astype(np.float32)
    # float32 - float32, one IEEE rounding: the reference's `top_logits - log_z`.
    lp = np.take_along_axis(x, ids.astype(np.intp), axis=1) - lse
    return ids, lp


def _check_stored(ids: np.ndarray, lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids)
    lp = np.asarray(lp)
    if ids.ndim != 2 or ids.shape != lp.shape:
        raise TreeInputError(f"stored top-K ids {ids.shape} and log-probs {lp.shape} must both be [L, K]")
    if not np.issubdtype(ids.dtype, np.integer) or not np.issubdtype(lp.dtype, np.floating):
        raise TreeInputError(f"stored ids must be integers and log-probs floats, got {ids.dtype}, {lp.dtype}")
    lp = lp.astype(np.float32, copy=False)  # the builder's inputs are float32 by definition
    if not np.isfinite(lp).all() or (lp > 0).any():
        raise TreeInputError("stored log-probs must be finite and <= 0")
    if (np.diff(lp, axis=1) > 0).any():
        raise TreeInputError("stored log-probs must be non-increasing along the rank axis")
    if (ids < 0).any() or (ids > np.iinfo(np.int32).max).any():
        raise TreeInputError("stored token ids must be in 0..2^31-1")
    srt = np.sort(ids, axis=1)
    if (srt[:, 1:] == srt[:, :-1]).any():
        raise TreeInputError("stored token ids must be distinct within each position")
    return ids.astype(np.int32, copy=False), lp


def _empty_tree() -> Tree:
    e = np.zeros(0, dtype=np.int32)
    return Tree(e, e.copy(), e.copy(), np.zeros(0), np.array([-1], dtype=np.int32), ({},))


def build_tree(draft, budget: int) -> Tree:
    """Build the DDTree draft tree with at most `budget` non-root nodes.

    `draft` is either float logits [L, V] (top-K taken with K = min(budget, V), see `top_k_logprobs`) or a
    pair (top_ids [L, K_stored], top_logprobs [L, K_stored]) already in rank order, of which the first
    K = min(budget, K_stored) ranks are used. Stored log-probs are used as float32, exactly as given.
    """
    budget = int(budget)
    if budget < 0:
        raise TreeInputError(f"budget must be >= 0, got {budget}")
    if isinstance(draft, tuple):
        if len(draft) != 2:
            raise TreeInputError("a stored draft is a pair (top_ids, top_logprobs)")
        ids, lp = _check_stored(*draft)
        if budget == 0 or ids.shape[0] == 0 or ids.shape[1] == 0:
            return _empty_tree()
        k = min(budget, ids.shape[1])
        ids, lp = ids[:, :k], lp[:, :k]
    else:
        logits = np.asarray(draft)
        if logits.ndim != 2:
            raise TreeInputError(f"draft logits must be [L, V], got shape {logits.shape}")
        if budget == 0 or logits.shape[0] == 0:
            return _empty_tree()
        ids, lp = top_k_logprobs(logits, min(budget, logits.shape[1]))
    return _best_first(ids, lp, budget)


def _best_first(ids: np.ndarray, lp: np.ndarray, budget: int) -> Tree:
    L, K = lp.shape
    lpf = lp.astype(np.float64).tolist()  # float32 -> float64 is exact; Python floats keep the loop fast
    idl = ids.tolist()
    tok, dep, rnk, scr = [], [], [], []
    parents = [-1]
    child_maps: list[dict[int, int]] = [{}]
    # Entries (-logw, rank_tuple, parent, depth, rank, logw), as in the reference: equal scores pop the
    # lexicographically smallest 0-based rank tuple first. No two entries share a rank tuple, so the order
    # is total and the pop order is the global (-score, rank tuple) order of all prefixes.
    heap = [(-lpf[0][0], (0,), 0, 1, 0, lpf[0][0])]
    while heap and len(tok) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        token = idl[depth - 1][rank]
        index = len(tok) + 1
        tok.append(token)
        dep.append(depth)
        rnk.append(rank)
        scr.append(logw)
        parents.append(parent)
        child_maps.append({})
        child_maps[parent][token] = index
        if rank + 1 < K:
            # The reference's incremental update, evaluated left to right in float64.
            sib = logw - lpf[depth - 1][rank] + lpf[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < L:
            child = logw + lpf[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child))
    return Tree(
        node_token_ids=np.array(tok, dtype=np.int32),
        node_depths=np.array(dep, dtype=np.int32),
        node_ranks=np.array(rnk, dtype=np.int32),
        node_scores=np.array(scr, dtype=np.float64),
        parents=np.array(parents, dtype=np.int32),
        child_maps=tuple(child_maps),
    )
