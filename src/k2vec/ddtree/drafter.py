"""The recorded "oracle with noise" drafter: per-position top-K draft lists built from a golden continuation.

An engine under test reads these lists from the bundle instead of running a drafter model, builds its
DDTree from them (`build_tree((ids, logprobs), budget)`), and verifies with the target. Indexing:

  * The sequence is prompt + generated tokens at absolute positions 0, 1, ...; the prompt has length P.
    The golden continuation g (target greedy tokens) puts g[i] at position P + i; g[0] is the prefill's
    argmax, i.e. the root of the first round.
  * A round starts at absolute position s (the reference's `start`): the root is the token at s (the last
    committed token, whose KV is not cached yet), and the drafter proposes positions s+1 .. s+B-1.
  * Stored round starts are s = P .. P+n_starts-1 (n_starts = len(g) by default); the lists for round s are
    row s - P, and entry j of that row (j = 0 .. B-2) is for absolute position s + 1 + j.
  * Position t has a golden token iff t - P < len(g). There, with probability `accuracy` the golden token
    is rank 0; otherwise it is absent (P_ABSENT) or at rank 1 + Geometric(GEOM_Q) (absent if that is >= K).
    Positions past the golden end are pure noise. The lists do not depend on what an engine committed.
  * Log-probs are multiples of 2^-10 (exact in float32; every sum along a tree path is exact in float32 and
    float64), non-increasing along the rank, strictly below rank 0 from rank 1 on, with an exact tie
    injected at some rank >= 1 in about TIE_PROB of the lists. Within equal log-probs ids are ascending, the
    order `top_k_logprobs` gives equal logits.

Randomness: each (round start s, position t) cell draws N_UNIFORMS uniforms from
rng_for(seed, prompt_key, s, t), so a cell never depends on call order, block size, or which other cells
were asked for. The accuracy is deliberately not part of the key: all accuracy levels share the same
draws (common random numbers), so a golden hit at accuracy p is also a hit at every p' > p, and the
acceptance length rises with accuracy cell by cell, not only on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k2vec.ddtree.tree import TreeInputError
from k2vec.seeds import rng_for

GRID = 2.0**-10  # log-prob quantum: keeps every tree score exact, so only the tie-break rule decides ties
P_ABSENT = 0.25  # a miss drops the golden token from the list with this probability
GEOM_Q = 0.5  # a listed miss sits at rank 1 + Geometric(GEOM_Q): rank 1 half the time, rank 2 a quarter...
TOP1_MIN, TOP1_SPAN = 0.30, 0.65  # rank-0 probability uniform in [0.30, 0.95)
ALPHA_MIN, ALPHA_SPAN = 0.8, 0.8  # Zipf exponent of ranks 1.. uniform in [0.8, 1.6)
TAIL_MASS = 0.9  # share of the non-top-1 mass that ranks 1..K-1 carry; the rest is outside the list
TIE_PROB, TIE_MAX_RANK = 0.25, 4  # a tie lp[r] == lp[r+1] at r in 1..min(TIE_MAX_RANK, K-2)
N_UNIFORMS = 9  # u[0] hit, u[1] absent, u[2] miss rank, u[3] top-1 prob, u[4] Zipf exponent,
#                 u[5] filler stride, u[6] filler offset, u[7] tie or not, u[8] tie rank


@dataclass(frozen=True)
class RecordedDrafts:
    ids: np.ndarray  # int32 [n_starts, B-1, K]: token ids in rank order
    logprobs: np.ndarray  # float32 [n_starts, B-1, K]: non-increasing along K
    golden_ranks: np.ndarray  # int32 [n_starts, B-1]: rank of the golden token, -1 if unlisted or none
    first_start: int  # the prompt length P: row i holds round start P + i

    def round(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [B-1, K], logprobs [B-1, K]) for the round whose root sits at absolute position `start`."""
        i = int(start) - self.first_start
        if not 0 <= i < self.ids.shape[0]:
            raise TreeInputError(
                f"no recorded drafts for round start {start}: stored starts are "
                f"{self.first_start}..{self.first_start + self.ids.shape[0] - 1}")
        return self.ids[i], self.logprobs[i]


def _uniforms(seed, prompt_key, starts: np.ndarray, n_pos: int) -> np.ndarray:
    u = np.empty((len(starts), n_pos, N_UNIFORMS))
    for i, s in enumerate(starts.tolist()):
        for j in range(n_pos):
            u[i, j] = rng_for(seed, prompt_key, s, s + 1 + j).random(N_UNIFORMS)
    return u


def _log_probs(u: np.ndarray, K: int) -> np.ndarray:
    """Non-increasing float32 log-probs [..., K] on the GRID, sub-normalised (sum of probs < 1)."""
    q0 = TOP1_MIN + TOP1_SPAN * u[..., 3]
    alpha = ALPHA_MIN + ALPHA_SPAN * u[..., 4]
    w = np.arange(1, K, dtype=np.float64) ** -alpha[..., None]
    rest = ((1.0 - q0) * TAIL_MASS)[..., None] * w / w.sum(axis=-1, keepdims=True)
    lp = np.log(np.concatenate([q0[..., None], rest], axis=-1))
    lp = np.minimum.accumulate(lp, axis=-1)  # Zipf rank 1 may exceed a small top-1 probability
    lp = np.floor(lp / GRID) * GRID  # rounding down keeps the order and the sum below 1
    lp[..., 1:] = np.minimum(lp[..., 1:], lp[..., :1] - GRID)  # rank 0 strictly first: top-1 is unambiguous
    if K >= 3:
        tie = u[..., 7] < TIE_PROB
        r = 1 + np.floor(u[..., 8] * min(TIE_MAX_RANK, K - 2)).astype(np.intp)
        lower = np.take_along_axis(lp, (r + 1)[..., None], axis=-1)[..., 0]
        cur = np.take_along_axis(lp, r[..., None], axis=-1)[..., 0]
        # Lowering rank r to rank r+1's value keeps the order and the sum below 1.
        np.put_along_axis(lp, r[..., None], np.where(tie, lower, cur)[..., None], axis=-1)
    return lp.astype(np.float32)


def _filler_pool(u: np.ndarray, V: int, size: int) -> np.ndarray:
    """`size` distinct ids per cell: (b + a*r) mod V for r = 0..size-1 with gcd(a, V) = 1."""
    a = 1 + np.floor(u[..., 5] * (V - 1)).astype(np.int64)
    while (bad := np.gcd(a, V) != 1).any():
        a[bad] = a[bad] % (V - 1) + 1  # next stride in 1..V-1; coprimes are dense, so this ends fast
    b = np.floor(u[..., 6] * V).astype(np.int64)
    return (b[..., None] + a[..., None] * np.arange(size, dtype=np.int64)) % V


def record_drafts(golden, *, prompt_len: int, vocab_size: int, accuracy: float, prompt_key, seed,
                  block_size: int = 16, k_stored: int = 64, n_starts: int | None = None) -> RecordedDrafts:
    """Oracle-with-noise draft lists for every round start P .. P+n_starts-1 of one prompt.

    K = min(k_stored, vocab_size) ids per position; see the module docstring for the exact semantics.
    """
    g = np.asarray(golden)
    V, P, B = int(vocab_size), int(prompt_len), int(block_size)
    p = float(accuracy)
    if g.ndim != 1 or not np.issubdtype(g.dtype, np.integer) or ((g < 0) | (g >= V)).any():
        raise TreeInputError(f"golden tokens must be a 1-D integer array with ids in 0..{V - 1}")
    if V < 2 or B < 2 or P < 0 or k_stored < 1 or not 0.0 <= p <= 1.0:
        raise TreeInputError(f"need vocab_size >= 2, block_size >= 2, prompt_len >= 0, k_stored >= 1 and "
                             f"accuracy in [0, 1]; got {V}, {B}, {P}, {k_stored}, {p}")
    N = len(g)
    S = N if n_starts is None else int(n_starts)
    J, K = B - 1, min(int(k_stored), V)
    starts = P + np.arange(S, dtype=np.int64)
    gi = (starts - P)[:, None] + 1 + np.arange(J)[None, :]  # golden index of each drafted position
    has = gi < N
    gold = np.where(has, g[np.minimum(gi, max(N - 1, 0))] if N else -1, -1).astype(np.int64)

    u = _uniforms(seed, prompt_key, starts, J)
    hit = has & (u[..., 0] < p)
    miss_rank = 1 + np.floor(np.log1p(-u[..., 2]) / np.log1p(-GEOM_Q))
    absent = has & ~hit & ((u[..., 1] < P_ABSENT) | (miss_rank >= K))
    rank = np.where(hit, 0, np.minimum(miss_rank, K)).astype(np.int64)
    if K == V:  # every token is listed, so an "absent" golden token goes last
        rank = np.where(absent, K - 1, rank)
        absent = np.zeros_like(absent)
    slot = np.where(has & ~absent, rank, K)  # K = nowhere

    # Fillers: a pool of min(K+1, V) distinct ids with the golden token taken out (kept order).
    pool = _filler_pool(u, V, min(K + 1, V))
    keep = pool != gold[..., None]
    pool = np.take_along_axis(pool, np.argsort(~keep, axis=-1, kind="stable"), axis=-1)
    k = np.arange(K)
    src = np.where(k < slot[..., None], k, k - 1)
    ids = np.take_along_axis(pool, np.maximum(src, 0), axis=-1)
    ids = np.where(k == slot[..., None], gold[..., None], ids)

    lp = _log_probs(u, K)
    order = np.lexsort((ids, -lp), axis=-1)  # equal log-probs: ids ascending
    ids = np.take_along_axis(ids, order, axis=-1).astype(np.int32)
    lp = np.take_along_axis(lp, order, axis=-1)
    match = ids == gold[..., None]
    golden_ranks = np.where(match.any(axis=-1), match.argmax(axis=-1), -1).astype(np.int32)
    return RecordedDrafts(ids=ids, logprobs=lp, golden_ranks=golden_ranks, first_start=P)
