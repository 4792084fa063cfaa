"""DDTree speculative decoding with the reference model as the target (docs/ddtree.md §4).

Each round: build the tree from the recorded drafts of this round start; run the root and every tree
node in one forward, each node at position start + depth and attending to the cached context plus
its own root path (the ancestor-only mask); walk down from the root while the target's argmax is a
child; commit the accepted nodes, keep only their KV rows, and emit the target's argmax at the last
accepted node as the bonus token, which becomes the next root. At temperature 0 the emitted tokens
are the greedy tokens, whatever the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k2vec.ddtree import accept_walk, build_tree, compacted_kv_rows, tree_positions
from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.reference.generate import top_k_sorted
from k2vec.reference.model import ReferenceModelError, ReferenceModel, Segment


@dataclass
class Round:
    start: int                # absolute position of the root
    node_tokens: np.ndarray   # int64 [n+1]: root token, then the tree's tokens in pop order
    parents: np.ndarray       # int64 [n+1]: parents[0] = -1
    depths: np.ndarray        # int64 [n+1]: depths[0] = 0
    accepted: np.ndarray      # int64 [a]: accepted node indices, 0 (the root) first
    bonus: int                # the target's argmax at the last accepted node


@dataclass
class DDTreeResult:
    tokens: np.ndarray        # int64 [max_new_tokens], the emitted tokens (prefill argmax first)
    rounds: list[Round]

    @property
    def acceptance_lengths(self) -> np.ndarray:
        """Tokens committed per round: accepted nodes, root included (the paper's tau)."""
        return np.array([len(r.accepted) for r in self.rounds], dtype=np.int64)


def argmax_lower_id(logits: np.ndarray) -> np.ndarray:
    """Row-wise argmax, ties to the lower token id (np.argmax returns the first maximum)."""
    return np.argmax(logits, axis=-1)


@dataclass
class DDTreeJob:
    """One DDTree decoding: a prompt, its recorded drafts and a node budget."""
    prompt: np.ndarray
    drafts: RecordedDrafts
    budget: int


def ddtree_generate(model: ReferenceModel, jobs: list[DDTreeJob], max_new_tokens: int) -> list[DDTreeResult]:
    """Decode every job to `max_new_tokens` tokens. The jobs advance in lockstep, one round each per
    `forward_many` pass (each with its own KV cache, positions and tree mask), so the weights are read
    once per round for all of them; the numbers of each job are its own."""
    prompts = [np.asarray(j.prompt, dtype=np.int64).reshape(-1) for j in jobs]
    for job, prompt in zip(jobs, prompts):
        if job.drafts.first_start != prompt.size:
            raise ReferenceModelError(f"drafts start at position {job.drafts.first_start}, "
                                 f"the prompt has {prompt.size} tokens")
    caches = [model.new_cache(capacity=p.size + max_new_tokens + j.budget + 1) for p, j in zip(prompts, jobs)]
    outs = model.forward_many([Segment(p, c) for p, c in zip(prompts, caches)], last_only=True)
    roots = [int(top_k_sorted(o.logits[0], 1)[0]) for o in outs]
    emitted = [[r] for r in roots]
    starts = [p.size for p in prompts]
    rounds: list[list[Round]] = [[] for _ in jobs]
    active = [k for k in range(len(jobs)) if max_new_tokens > 1]
    while active:
        trees = {k: build_tree(jobs[k].drafts.round(starts[k]), jobs[k].budget) for k in active}
        segments, pasts, node_tokens, depths = [], {}, {}, {}
        for k in active:
            tree = trees[k]
            node_tokens[k] = np.concatenate([[roots[k]], tree.node_token_ids]).astype(np.int64)
            depths[k] = np.concatenate([[0], tree.node_depths]).astype(np.int64)
            pasts[k] = caches[k].length
            mask = np.concatenate([np.ones((tree.n + 1, pasts[k]), bool), tree.visibility()], axis=1)
            segments.append(Segment(node_tokens[k], caches[k], tree_positions(tree, starts[k]), mask))
        outs = model.forward_many(segments)
        for k, out in zip(active, outs):
            accepted, bonus = accept_walk(trees[k], argmax_lower_id(out.logits))
            accepted = np.asarray(accepted, dtype=np.int64)
            caches[k].keep(compacted_kv_rows(pasts[k], accepted))
            rounds[k].append(Round(starts[k], node_tokens[k], trees[k].parents.astype(np.int64), depths[k],
                                   accepted, int(bonus)))
            emitted[k].extend(int(t) for t in node_tokens[k][accepted[1:]])
            emitted[k].append(int(bonus))
            starts[k] += len(accepted)
            roots[k] = int(bonus)
        active = [k for k in active if len(emitted[k]) < max_new_tokens]
    return [DDTreeResult(np.array(e[:max_new_tokens], dtype=np.int64), r) for e, r in zip(emitted, rounds)]
