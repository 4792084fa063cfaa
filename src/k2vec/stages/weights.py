"""Deterministic synthetic fp32 weights for a resolved model spec.

Every tensor is drawn from its own stream, seeded by (model seed, tensor name), so adding, removing
or reshaping one tensor leaves every other tensor's bytes unchanged.

Initialisation: uniform distributions, scaled by the tensor's own shape only.
- Linear projections [out, in] (and the router): U(-a, a) with std 1/sqrt(in), so each projection
  roughly preserves the RMS of its input and activations stay O(1) through every layer (each
  sublayer sees an RMS-normalised input, and the residual stream grows by about one unit per layer).
- Embeddings: std 1.
- lm_head: std LOGIT_STD/sqrt(hidden): logits have a standard deviation of about LOGIT_STD. With
  logits spread that wide the gap between the two largest of V logits is of order 1, so greedy
  decoding is decisive (a top-1/top-2 gap under 1e-3 is about a 1-in-1000 event).
- RMSNorm weights: U(0.75, 1.25), and the router's e_score_correction_bias: U(0, 0.2). Neither is
  the trivial constant, so an engine that skips a norm weight or the selection bias is caught. The
  bias is non-negative so every selection score (sigmoid + bias) is positive: implementations that
  mask dropped expert groups with 0 (DeepSeek's reference, HF 4.x) and with -inf (HF 5.x) then pick
  the same experts, and the golden routing is unambiguous.

Why uniform and not normal: the values are computed from the raw 64-bit PCG64 stream (stable by
numpy's policy across versions) with IEEE basic operations only (no log/sin/cos, whose last bit can
differ between SIMD implementations), so the checkpoint is bit-identical on every machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from k2vec.atomic import atomic_directory
from k2vec.model.architecture import hf_config, tensor_shapes
from k2vec.model.checkpoint import StreamedTensor, shard_groups, write_shards
from k2vec.model.limits import CHUNK_VALUES
from k2vec.seeds import seed_for

LOGIT_STD = 4.0
NORM_RANGE = (0.75, 1.25)
BIAS_RANGE = (0.0, 0.2)
_SQRT3 = math.sqrt(3.0)


def uniform(seed: int, shape: list[int], low: float, high: float) -> np.ndarray:
    """float32 values in [low, high) from the top 24 bits of the PCG64 raw stream (exact in float32)."""
    return np.concatenate(list(uniform_chunks(seed, math.prod(shape), low, high))).reshape(shape)


def uniform_chunks(seed: int, n: int, low: float, high: float, chunk: int = CHUNK_VALUES) -> Iterator[np.ndarray]:
    """`uniform`'s n values, flat, `chunk` at a time: the raw stream continues across calls, so the
    values do not depend on the chunk size, and memory stays at ~20 B per value of one chunk."""
    bitgen = np.random.PCG64(seed)
    scale, offset = np.float32(high - low), np.float32(low)
    for start in range(0, n, chunk):
        raw = bitgen.random_raw(min(chunk, n - start))
        raw >>= np.uint64(40)
        unit = raw.astype(np.float32)  # exact: 24-bit integers
        del raw
        unit *= np.float32(2.0**-24)
        unit *= scale
        unit += offset
        yield unit


def init_range(name: str, shape: list[int]) -> tuple[float, float]:
    """The (low, high) of a tensor's uniform init, from its name and its own shape only."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return NORM_RANGE
    if name.endswith("e_score_correction_bias"):
        return BIAS_RANGE
    if name == "model.embed_tokens.weight":
        std = 1.0
    elif name == "lm_head.weight":
        std = LOGIT_STD / math.sqrt(shape[1])
    else:
        std = 1.0 / math.sqrt(shape[1])
    a = std * _SQRT3
    return (-a, a)


def make_tensor(model: dict[str, Any], name: str, shape: list[int]) -> np.ndarray:
    low, high = init_range(name, shape)
    return uniform(seed_for(model["seed"], name), shape, low, high)


def streamed_tensor(model: dict[str, Any], name: str, shape: list[int]) -> StreamedTensor:
    """`make_tensor`'s values as a chunk stream, for writing without holding the tensor."""
    low, high = init_range(name, shape)
    seed = seed_for(model["seed"], name)
    return StreamedTensor("F32", tuple(shape), lambda: uniform_chunks(seed, math.prod(shape), low, high))


def write_checkpoint(model: dict[str, Any], out_dir: str | Path) -> dict:
    """Write the fp32 HF checkpoint of `model` (a resolved model spec) into `out_dir`, atomically.

    Tensors are drawn and written a chunk at a time: memory does not grow with the model's widths."""
    shapes = tensor_shapes(model)
    groups = shard_groups(model)

    def shard(names: list[str]) -> Iterator[tuple[str, StreamedTensor]]:
        for n in names:
            yield n, streamed_tensor(model, n, shapes[n])

    with atomic_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config(model), indent=2, sort_keys=True) + "\n")
        index = write_shards(tmp, (shard(g) for g in groups), len(groups))
    return index
