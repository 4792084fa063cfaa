"""Deterministic random streams: every seed derives from names, never from call order."""

from __future__ import annotations

import hashlib

import numpy as np


def seed_for(*parts: object) -> int:
    """A 64-bit seed from the parts' text, e.g. seed_for(model_seed, tensor_name)."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def rng_for(*parts: object) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed_for(*parts)))
