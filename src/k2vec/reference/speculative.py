"""DDTree speculative decoding with the reference model as the target (docs/ddtree.md §4).

Each round: build the tree from the recorded drafts of this round start; run the root and every tree
node in one forward, each node at position start + depth and attending to the cached context plus
its own root path (the ancestor-only mask); walk down from the root while the target's argmax is a
child; commit the accepted nodes, keep only their KV rows, and emit the target's argmax at the last
accepted node as the bonus token, which becomes the next root. At temperature 0 the emitted tokens
are the greedy tokens, whatever the drafts.

Many jobs decoded together (`ddtree_generate`) share that work where it is the same: jobs in the same
state (same prompt, same tokens emitted so far) have the same context and root, so they hold one cache
and verify the union of their trees once. The mask keeps each node's logits those of its own root path,
so each job's rounds are the ones it would have alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k2vec.ddtree import accept_walk, ancestor_visibility, build_tree, compacted_kv_rows, tree_positions
from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.ddtree.tree import Tree
from k2vec.reference.generate import top_k_sorted
from k2vec.reference.model import KVCache, ReferenceModelError, ReferenceModel, Segment


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


class _UnionTree:
    """The trees of the jobs in one state merged by token path, to be verified as one: a node is (its
    parent's union index, its token), so a path that several trees hold is verified once. Node 0 is the
    shared root; trees are added node by node in pop order, so a parent always precedes its children.
    `n` and `node_depths` are a Tree's, so that `tree_positions` applies."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.depths = [int(root)], [-1], [0]
        self._children: list[dict[int, int]] = [{}]

    @property
    def n(self) -> int:
        return len(self.tokens) - 1

    @property
    def node_depths(self) -> np.ndarray:
        return np.array(self.depths[1:], dtype=np.int64)

    def add(self, tree: Tree) -> np.ndarray:
        """Merge `tree` in. Its index map, int64 [tree.n + 1]: node i of `tree` is union node map[i]."""
        index = [0]
        for token, parent, depth in zip(tree.node_token_ids.tolist(), tree.parents[1:].tolist(),
                                        tree.node_depths.tolist()):
            up = index[parent]
            node = self._children[up].get(token)
            if node is None:
                node = len(self.tokens)
                self._children[up][token] = node
                self._children.append({})
                self.tokens.append(token)
                self.parents.append(up)
                self.depths.append(depth)
            index.append(node)
        return np.array(index, dtype=np.int64)

    def visibility(self) -> np.ndarray:
        return ancestor_visibility(np.array(self.parents), self.depths)


def ddtree_generate(model: ReferenceModel, jobs: list[DDTreeJob], max_new_tokens: int) -> list[DDTreeResult]:
    """Decode every job to `max_new_tokens` tokens. The jobs advance in lockstep, one round each per
    `forward_many` pass, so the weights are read once per round for all of them.

    Work is shared between jobs in the same state, i.e. with identical tokens (prompt, then every token
    emitted so far): at temperature 0 every job of a prompt emits the greedy tokens, so such jobs have the
    same context and root. The prefill runs once per distinct prompt; each round, the jobs of one state
    hold one KV cache and are verified in one segment whose tree is the union of their trees by token path.
    Each job walks its own tree on its own nodes' rows of that segment, so its rounds are exactly its own:
    a node sees only the context and its own root path, so its logits equal a separate verification's up
    to float summation order. The rows each new state keeps (the context, then the accepted path) are
    gathered into a new cache of its own."""
    prompts = [np.asarray(j.prompt, dtype=np.int64).reshape(-1) for j in jobs]
    for job, prompt in zip(jobs, prompts):
        if job.drafts.first_start != prompt.size:
            raise ReferenceModelError(f"drafts start at position {job.drafts.first_start}, "
                                 f"the prompt has {prompt.size} tokens")
    prompt_keys = [p.tobytes() for p in prompts]
    emitted: list[list[int]] = [[] for _ in jobs]

    def state(k: int) -> tuple[bytes, tuple[int, ...]]:
        return prompt_keys[k], tuple(emitted[k])

    def spare(ks: list[int]) -> int:  # the most rows a round of these jobs verifies: the root and every node
        return 1 + sum(jobs[k].budget for k in ks)

    by_prompt = _grouped(range(len(jobs)), lambda k: prompt_keys[k])
    first = [model.new_cache(capacity=prompts[ks[0]].size + spare(ks)) for ks in by_prompt.values()]
    outs = model.forward_many([Segment(prompts[ks[0]], c) for ks, c in zip(by_prompt.values(), first)],
                              last_only=True)
    caches: dict[tuple, KVCache] = {}
    for ks, cache, out in zip(by_prompt.values(), first, outs):
        for k in ks:
            emitted[k].append(int(top_k_sorted(out.logits[0], 1)[0]))
        caches[state(ks[0])] = cache
    rounds: list[list[Round]] = [[] for _ in jobs]
    active = [k for k in range(len(jobs)) if max_new_tokens > 1]
    while active:
        trees, segments, groups = {}, [], []
        for key, ks in _grouped(active, state).items():
            start = prompts[ks[0]].size + len(emitted[ks[0]]) - 1
            union = _UnionTree(emitted[ks[0]][-1])
            index = {}
            for k in ks:
                trees[k] = build_tree(jobs[k].drafts.round(start), jobs[k].budget)
                index[k] = union.add(trees[k])
            cache = caches[key]
            past = cache.length
            mask = np.concatenate([np.ones((union.n + 1, past), bool), union.visibility()], axis=1)
            segments.append(Segment(np.array(union.tokens, dtype=np.int64), cache, tree_positions(union, start), mask))
            groups.append((ks, start, past, cache, index))
        outs = model.forward_many(segments)
        born: dict[tuple, tuple[KVCache, np.ndarray]] = {}
        for (ks, start, past, cache, index), out in zip(groups, outs):
            argmax = argmax_lower_id(out.logits)
            for k in ks:
                tree = trees[k]
                accepted, bonus = accept_walk(tree, argmax[index[k]])
                accepted = np.asarray(accepted, dtype=np.int64)
                node_tokens = np.concatenate([[emitted[k][-1]], tree.node_token_ids]).astype(np.int64)
                depths = np.concatenate([[0], tree.node_depths]).astype(np.int64)
                rounds[k].append(Round(start, node_tokens, tree.parents.astype(np.int64), depths, accepted,
                                       int(bonus)))
                emitted[k].extend(int(t) for t in node_tokens[accepted[1:]])
                emitted[k].append(int(bonus))
                if len(emitted[k]) < max_new_tokens:
                    # Jobs that reach one state hold the same tokens: the first one's rows serve them all.
                    born.setdefault(state(k), (cache, compacted_kv_rows(past, index[k][accepted])))
        active = [k for k in active if len(emitted[k]) < max_new_tokens]
        # Each new state gets its own cache (forward_many needs one per segment), sized for its next round.
        caches = {key: born[key][0].gathered(born[key][1], spare(ks)) for key, ks in _grouped(active, state).items()}
    return [DDTreeResult(np.array(e[:max_new_tokens], dtype=np.int64), r) for e, r in zip(emitted, rounds)]


def _grouped(items, key) -> dict:
    """key -> the items with that key, in order of first appearance."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups
