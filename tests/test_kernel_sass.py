"""The MMA-order tile's reason to exist, checked in its machine code (bench/sass.py compiles for sm_90 without a GPU):
its K loop takes the dequantised weight to the MMA in registers, with no shared-memory store and reload and no
barrier but the cp.async stage handoff. Written with the scale index as one division, the same tile split its scale
loads and sent each dequantised tile through shared memory (16 STS, 16 LDSM and 9 barriers per 256 elements in the
ONE_DOT + INTERLEAVE tile it replaced), which this check fails on."""
import pytest

from conftest import bench_module


@pytest.fixture(scope="module")
def sass():
    return bench_module("sass")


def test_mma_order_k_loop_has_no_shared_memory_trip(sass):
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True, num_warps=4, num_stages=4)
    d = sass.describe(sass.compile_config(config, 7168, 4096, 16, 90))
    mix = d["mix"]
    assert mix.get("HGMMA", 0) > 0, d           # the loop found is the MMA loop
    assert mix.get("STS", 0) == 0 and mix.get("LDSM", 0) == 0, d
    assert mix.get("BAR", 0) <= 2, d            # the cp.async stage handoff only


# the one-row GEMV (M = 1, dense and the fused MoE's launches) is issue-bound (bench/RESULTS.md, ncu): its K loop
# should spend one fused multiply-add and one prmt per weight and little else. A per-word partial sum costs an FMUL
# and group FADDs, x widened to float32 after it is spread over the rows an IMAD per use: 490 instructions per trip
# where this tile takes 405 (Triton 3.7.1).
GEMV = dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=1024, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, CODES_ASM=True,
            BIASED_CODES=True, PDL=True, SPLIT_CTAS=132, num_warps=8, num_stages=3)


def test_one_row_k_loop_is_a_chain_of_fused_multiply_adds(sass):
    d = sass.describe(sass.compile_config(GEMV, 7168, 4096, 1, 90))
    mix = d["mix"]
    weights = 32 * 1024 // (8 * 32)         # per lane and K tile: BLOCK_N x BLOCK_K over 8 warps of 32
    assert weights <= mix.get("PRMT", 0) <= weights + 8, d      # the loop found is the GEMV's K loop
    assert weights <= mix.get("FFMA", 0) <= weights + 8 and mix.get("FMUL", 0) <= 2, d
    assert d["loop_instructions"] <= 3.4 * weights, d
