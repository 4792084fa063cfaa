"""Verifying a DDTree draft tree at temperature 0: the verify-pass inputs, the acceptance walk, KV compaction.

Mirrors `compile_ddtree_tree` and `follow_verified_tree` in the authors' `ddtree.py`.
"""

from __future__ import annotations

import numpy as np

from k2vec.ddtree.tree import Tree, TreeInputError


def tree_input_ids(tree: Tree, root_token: int) -> np.ndarray:
    """Token ids of the verify pass, int64 [n+1]: the root token, then the nodes in index order."""
    return np.concatenate([[int(root_token)], tree.node_token_ids]).astype(np.int64)


def tree_positions(tree: Tree, start: int) -> np.ndarray:
    """Position ids, int64 [n+1]: start + depth, the root (depth 0) at `start`."""
    return int(start) + np.concatenate([[0], tree.node_depths]).astype(np.int64)


def tree_attention_mask(tree: Tree, past_length: int, dtype=np.float32) -> np.ndarray:
    """Additive mask [n+1, past_length+n+1]: 0 where a tree row may attend, finfo(dtype).min elsewhere.

    Every row sees all `past_length` cached positions and, within the tree block, itself and its ancestors.
    """
    n1 = tree.n + 1
    mask = np.zeros((n1, past_length + n1), dtype=dtype)
    mask[:, past_length:][~tree.visibility()] = np.finfo(dtype).min
    return mask


def accept_walk(tree: Tree, target_argmax: np.ndarray) -> tuple[list[int], int]:
    """Greedy acceptance: from the root, follow the child whose token is the target's argmax at the
    current node, while one exists. Returns (accepted node indices, 0 first; bonus token), where the bonus
    is the target's argmax at the last accepted node. len(accepted) is the acceptance length tau."""
    post = np.asarray(target_argmax)
    if post.shape != (tree.n + 1,):
        raise TreeInputError(f"target argmax must have shape ({tree.n + 1},), got {post.shape}")
    post = post.tolist()
    accepted = [0]
    cur = 0
    nxt = int(post[0])
    while nxt in tree.child_maps[cur]:
        cur = tree.child_maps[cur][nxt]
        accepted.append(cur)
        nxt = int(post[cur])
    return accepted, nxt


def compacted_kv_rows(past_length: int, accepted: list[int]) -> np.ndarray:
    """Cache rows to keep after a round, in their new order: rows 0..past_length-1, then row
    past_length + i for each accepted index i. Row r of the compacted cache is the old row result[r]."""
    acc = np.asarray(accepted, dtype=np.int64)
    return np.concatenate([np.arange(past_length, dtype=np.int64), past_length + acc])
