"""Fuzz the Python reader: mutated, truncated and spliced bundles give KdtrError or a valid bundle,
never another exception, a hang, or memory out of proportion to the file."""

import time
import tracemalloc

import numpy as np
import pytest

from k2vec.kdtr import KdtrError, open_bundle_buffer
from k2vec.kdtr.fuzz import cases

ALLOC_SLACK = 64 << 10


def _run(n: int, seed: int) -> dict:
    verdicts = {"ok": 0, "err": 0}
    worst = 0.0
    tracemalloc.start()
    try:
        for data in cases(seed, n):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            try:
                b = open_bundle_buffer(data, verify=True)
                # an accepted bundle is usable: every tensor materialises with its shape
                for t in b.tensors:
                    assert b[t.name].shape == t.shape and b[t.name].nbytes == t.nbytes
                verdicts["ok"] += 1
            except KdtrError as e:
                assert e.field and e.offset is not None and e.offset <= max(len(data), 1 << 64)
                verdicts["err"] += 1
            worst = max(worst, time.perf_counter() - t0)
            peak = tracemalloc.get_traced_memory()[1] - base
            assert peak < len(data) + ALLOC_SLACK, f"peak {peak} for a {len(data)}-byte file"
    finally:
        tracemalloc.stop()
    assert worst < 1.0, f"slowest case took {worst:.2f} s"
    # the mutator must produce both outcomes, or it is not testing much
    assert verdicts["ok"] > n // 20 and verdicts["err"] > n // 2, verdicts
    return verdicts


def test_fuzz_python_reader():
    _run(5_000, seed=20260101)


@pytest.mark.slow
def test_fuzz_python_reader_long():
    _run(100_000, seed=7)


def test_seed_bundles_in_the_corpus_are_valid():
    from k2vec.kdtr.fuzz import seed_bundles
    for data in seed_bundles():
        b = open_bundle_buffer(data, verify=True)
        assert all(isinstance(b[t.name], np.ndarray) for t in b.tensors)
