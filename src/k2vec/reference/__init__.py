"""Numpy reference (oracle) implementation of the DeepSeek-V3 / Kimi-K2 decoder and greedy generation."""

from .generate import GreedyResult, greedy_generate, logits_no_cache, top_k_sorted
from .model import (ForwardOutput, KVCache, ReferenceError, ReferenceModel, ReferenceModelError, Segment,
                    rope_tables, route)

__all__ = ["ReferenceModel", "KVCache", "ForwardOutput", "Segment", "ReferenceModelError", "ReferenceError",
           "GreedyResult", "greedy_generate", "logits_no_cache", "top_k_sorted", "rope_tables", "route"]
