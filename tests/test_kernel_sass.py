"""The MMA-order tile's reason to exist, checked in its machine code (bench/sass.py compiles for sm_90 without a GPU):
its K loop takes the dequantised weight to the MMA in registers, with no shared-memory store and reload, where the
ONE_DOT + INTERLEAVE tile it replaces makes that trip (so the check can tell the two apart)."""
import importlib.util
from pathlib import Path

import pytest

SASS = Path(__file__).resolve().parents[1] / "bench" / "sass.py"


@pytest.fixture(scope="module")
def sass():
    spec = importlib.util.spec_from_file_location("bench_sass", SASS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = {   # name: (config, shared-memory round trips expected in the K loop)
    "mma-order": (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True, num_warps=4, num_stages=4), False),
    "one-dot-interleave": (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SWAP_AB=True, ONE_DOT=True, X_WIDE=True,
                                INTERLEAVE=True, num_warps=4, num_stages=3), True),
}


@pytest.mark.parametrize("name", CASES)
def test_k_loop_shared_memory_trips(sass, name):
    config, trips = CASES[name]
    d = sass.describe(sass.compile_config(config, 7168, 4096, 16, 90))
    mix = d["mix"]
    assert mix.get("HGMMA", 0) > 0, d           # the loop found is the MMA loop
    assert (mix.get("STS", 0) > 0 and mix.get("LDSM", 0) > 0) == trips, d
    if not trips:
        assert mix.get("BAR", 0) <= 2, d        # the cp.async stage handoff only
