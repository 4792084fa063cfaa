"""DDTree on the GPU (docs/ddtree.md): the tree from the recorded drafts with the project's own
construction (`k2vec.ddtree`, pure numpy, as the contract allows), verified in ONE forward per round over
the root and every node (positions start + depth, the ancestor-only mask built here on the device), the
acceptance walk, the bonus token, and the KV cache compacted to the accepted path after each round.
All prompts advance in lockstep: one forward per round verifies every prompt's tree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from k2vec.ddtree import Tree, accept_walk, build_tree
from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.engines.gpu_triton.model import KVCache, Segment, Transformer


def tree_mask(parents: Tensor, max_depth: int, past_length: int) -> Tensor:
    """Bool [n+1, past_length + n+1]: every cached row, then node j visible to node i iff j is i or one
    of its ancestors. Built on the parents' device by following parent pointers max_depth times."""
    n1 = parents.numel()
    nodes = torch.arange(n1, device=parents.device)
    visible = torch.zeros(n1, n1, dtype=torch.bool, device=parents.device)
    visible[nodes, nodes] = True
    ancestor = parents.clone()
    for _ in range(max_depth):
        live = ancestor >= 0
        visible[nodes[live], ancestor[live]] = True
        ancestor = torch.where(live, parents[ancestor.clamp(min=0)], ancestor)
    return torch.cat([torch.ones(n1, past_length, dtype=torch.bool, device=parents.device), visible], dim=1)


def compaction_rows(past_length: int, accepted: np.ndarray, device) -> Tensor:
    """Old cache row of each kept row: the committed context, then the accepted nodes in path order."""
    return torch.cat([torch.arange(past_length, device=device),
                      past_length + torch.as_tensor(accepted, dtype=torch.int64, device=device)])


@dataclass
class Round:
    start: int
    tokens: np.ndarray    # root, then the tree's tokens in node order
    parents: np.ndarray
    depths: np.ndarray
    accepted: np.ndarray
    bonus: int

    def to_json(self) -> dict:
        return {"start": self.start, "tokens": self.tokens.tolist(), "parents": self.parents.tolist(),
                "depths": self.depths.tolist(), "accepted": self.accepted.tolist(), "bonus": self.bonus}


@dataclass
class _Sequence:
    drafts: RecordedDrafts
    cache: KVCache
    start: int
    root: int
    emitted: list[int]
    rounds: list[Round]


def ddtree_decode(model: Transformer, prompts: list[np.ndarray], drafts: list[RecordedDrafts], budget: int,
                  max_new_tokens: int) -> list[tuple[list[int], list[Round]]]:
    """Emitted tokens (max_new_tokens, prefill argmax first) and the rounds of every prompt."""
    dev = model.device
    caches = [model.new_cache(p.size + max_new_tokens + budget + 1) for p in prompts]
    segs = [Segment(torch.as_tensor(p, device=dev), torch.arange(p.size, device=dev), c)
            for p, c in zip(prompts, caches)]
    roots = model.forward(segs, last_only=True).logits.argmax(-1).tolist()  # argmax: first maximum = lowest id
    seqs = [_Sequence(d, c, p.size, r, [r], []) for p, d, c, r in zip(prompts, drafts, caches, roots)]
    active = [s for s in seqs if max_new_tokens > 1]
    while active:
        trees: list[Tree] = [build_tree(s.drafts.round(s.start), budget) for s in active]
        segs, layout = [], []
        for s, tree in zip(active, trees):
            tokens = np.concatenate([[s.root], tree.node_token_ids]).astype(np.int64)
            depths = np.concatenate([[0], tree.node_depths]).astype(np.int64)
            parents = torch.as_tensor(tree.parents.astype(np.int64), device=dev)
            mask = tree_mask(parents, int(depths.max()), s.cache.length)
            segs.append(Segment(torch.as_tensor(tokens, device=dev), torch.as_tensor(s.start + depths, device=dev),
                                s.cache, mask))
            layout.append((tokens, depths, s.cache.length))
        argmax = model.forward(segs).logits.argmax(-1).cpu().numpy()
        offset = 0
        for s, tree, (tokens, depths, past) in zip(active, trees, layout):
            accepted, bonus = accept_walk(tree, argmax[offset:offset + tokens.size])
            offset += tokens.size
            accepted = np.asarray(accepted, dtype=np.int64)
            s.cache.keep(compaction_rows(past, accepted, dev))
            s.rounds.append(Round(s.start, tokens, tree.parents.astype(np.int64), depths, accepted, int(bonus)))
            s.emitted.extend(int(t) for t in tokens[accepted[1:]])
            s.emitted.append(int(bonus))
            s.start += accepted.size
            s.root = int(bonus)
        active = [s for s in active if len(s.emitted) < max_new_tokens]
    return [(s.emitted[:max_new_tokens], s.rounds) for s in seqs]
