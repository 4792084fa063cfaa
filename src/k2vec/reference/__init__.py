"""Numpy reference (oracle) implementation of the DeepSeek-V3 / Kimi-K2 decoder and greedy generation."""

from k2vec.reference.generate import GreedyResult, greedy_generate, logits_no_cache, top_k_sorted
from k2vec.reference.model import (
    ForwardOutput,
    KVCache,
    ReferenceModel,
    ReferenceModelError,
    Segment,
    rope_tables,
    route,
)

__all__ = ["ReferenceModel", "KVCache", "ForwardOutput", "Segment", "ReferenceModelError",
           "GreedyResult", "greedy_generate", "logits_no_cache", "top_k_sorted", "rope_tables", "route"]
