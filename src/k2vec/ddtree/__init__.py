"""DDTree speculative decoding: draft-tree construction, tree verification helpers, the recorded drafter.

docs/ddtree.md is the engine-facing specification of everything here.
"""

from k2vec.ddtree.drafter import RecordedDrafts, record_drafts
from k2vec.ddtree.tree import Tree, TreeInputError, ancestor_visibility, build_tree, top_k_logprobs
from k2vec.ddtree.walk import accept_walk, compacted_kv_rows, tree_attention_mask, tree_input_ids, tree_positions

__all__ = [
    "RecordedDrafts", "Tree", "TreeInputError", "accept_walk", "ancestor_visibility", "build_tree", "compacted_kv_rows",
    "record_drafts", "top_k_logprobs", "tree_attention_mask", "tree_input_ids", "tree_positions",
]
