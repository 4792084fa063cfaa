"""The MMA-order tile's reason to exist, checked in its machine code (bench/sass.py compiles for sm_90 without a GPU):
its K loop takes the dequantised weight to the MMA in registers, with no shared-memory store and reload and no
barrier but the cp.async stage handoff. Written with the scale index as one division, the same tile split its scale
loads and sent each dequantised tile through shared memory (16 STS, 16 LDSM and 9 barriers per 256 elements in the
ONE_DOT + INTERLEAVE tile it replaced), which this check fails on."""
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


def test_mma_order_k_loop_has_no_shared_memory_trip(sass):
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True, num_warps=4, num_stages=4)
    d = sass.describe(sass.compile_config(config, 7168, 4096, 16, 90))
    mix = d["mix"]
    assert mix.get("HGMMA", 0) > 0, d           # the loop found is the MMA loop
    assert mix.get("STS", 0) == 0 and mix.get("LDSM", 0) == 0, d
    assert mix.get("BAR", 0) <= 2, d            # the cp.async stage handoff only
