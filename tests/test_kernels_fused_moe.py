"""Fused MoE W4A16 kernel vs a float64 reference (dequantized experts, silu(gate) * up, down, weighted sum).

Routing is random with top-k >= 2, tokens sharing experts and experts that get no token (only `used` of the
E experts are routed to). CPU: Triton's interpreter, float32 and float16 activations, both the one-pair-per-
program path (BLOCK_M 1) and the expert-sorted tensor-core path (BLOCK_M 16). GPU (marked `gpu`): every M in
{1..64}, bfloat16 too.
"""
import itertools

import pytest
import torch

from support.kernel_checks import cuda_device, run_interpreted

GROUPS = (32, 64, 128)
SCALES = ("float32", "bfloat16")
# the interpreter runs programs one at a time, so its cost is the number of tile iterations: big tiles, few cases
def both(**cfg):
    return cfg, cfg    # gate/up and down


PATHS = {"one-row": both(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SCALE_GROUPS=True),
         "sorted": both(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, X_PLANES=True),
         # the same paths with interleaved activations and per-word scaling
         "one-row-interleaved": both(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_PLANES=False, SCALE_GROUPS=False),
         "sorted-interleaved": both(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, X_PLANES=False),
         # one pair per program on tensor cores (row 0 of 16)
         "one-pair-tc": both(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True)}
# split-K (gate and up reduced apart, then SiLU): hidden 288 = 2.25 tiles of 128, so 3 splits over 3 tiles and
# 2 over 2 for the down projection (intermediate 160); the sorted path splits too; COMBINE: top-3 rows summed
# by the down launch
SPLIT_PATHS = {"one-pair-tc-split": both(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SPLIT_K=3),
               "one-row-split": both(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_PLANES=True, SCALE_GROUPS=True, SPLIT_K=4),
               "sorted-split": both(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_PLANES=True, SPLIT_K=2),
               # the down launch sums each token's top-k rows itself (the split-K reduction over j)
               "one-pair-tc-combine": (dict(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True,
                                            SPLIT_K=2),
                                       dict(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True,
                                            COMBINE=True)),
               "one-row-combine": (dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_PLANES=True, SCALE_GROUPS=True),
                                   dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_PLANES=True, SCALE_GROUPS=True,
                                        COMBINE=True)),
               # gate and up in separate programs (SPLIT_GU), split over K or not; one-row tiles with natural-order
               # x (X_WIDE) and the next K tile prefetched (PREFETCH), gate/up split 3 ways, down summing top-k rows
               "one-pair-tc-gu-split": (dict(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True,
                                             SPLIT_GU=True, SPLIT_K=3),
                                        dict(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=128, X_PLANES=True)),
               "sorted-gu": both(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SPLIT_GU=True),
               "one-row-prefetch-gu": (dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True,
                                            PREFETCH=True, SPLIT_GU=True, SPLIT_K=3),
                                       dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True,
                                            PREFETCH=True, COMBINE=True)),
               # the same with the biased codes (1 + u/128, one correction per group)
               "one-row-biased-gu": (dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True,
                                          PREFETCH=True, BIASED_CODES=True, SPLIT_GU=True, SPLIT_K=3),
                                     dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True,
                                          PREFETCH=True, BIASED_CODES=True, COMBINE=True)),
               # expert-sorted tiles with x and h read as they are (X_WIDE; hidden 288: a masked partial K tile),
               # gate and up apart, the down launch split
               "sorted-wide": (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_WIDE=True, SPLIT_GU=True),
                               dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_WIDE=True, SPLIT_K=2))}


def cpu_case(m, g, sd, act, path):
    # E 8 experts of which 6 are used; hidden 3G (partial K and N tiles), intermediate G; top-3
    return [m, 8, 3 * g, g, 3, 6, g, sd, act], {"config": path}


# every group size and scale dtype on both paths; M beyond one block per expert (33) and several rows (3)
CPU_GRID = ([(1, g, sd, "float32", "one-row") for g in GROUPS for sd in SCALES]
            + [(3, 64, sd, "float32", "one-row") for sd in SCALES]
            + [(16, g, sd, "float16", "sorted") for g in GROUPS for sd in SCALES]
            + [(m, 32, sd, act, "sorted") for m, sd, act in ((3, "float32", "float32"), (3, "bfloat16", "float16"),
                                                            (33, "float32", "float16"), (33, "bfloat16", "float32"))]
            + [(m, 64, "bfloat16", "float32", path) for m, path in ((3, "one-row-interleaved"),
                                                                    (16, "sorted-interleaved"))]
            + [(3, 32, "bfloat16", act, "one-pair-tc") for act in ("float32", "float16")])
# one (M, activation) per split path (the interpreter's time per path at M = 3 is two to four times M = 1's:
# bench/RESULTS.md, session 25): three tokens where pairs share experts matters (the expert-sorted paths, the down
# launch summing top-k rows), one token elsewhere
SPLIT_AT = {"one-pair-tc-split": (1, "float32"), "one-row-split": (1, "float32"), "sorted-split": (3, "float16"),
            "one-pair-tc-combine": (1, "float32"), "one-row-combine": (3, "float16"),
            "one-pair-tc-gu-split": (3, "float16"), "sorted-gu": (3, "float16"), "one-row-prefetch-gu": (1, "float32"),
            "one-row-biased-gu": (1, "float32"), "sorted-wide": (3, "float16")}
assert SPLIT_AT.keys() == SPLIT_PATHS.keys()
SPLIT_GRID = [(*SPLIT_AT[path], path) for path in SPLIT_PATHS]


@pytest.fixture(scope="module")
def cpu_results():
    calls = [("check_moe", *cpu_case(m, g, sd, act, PATHS[path])) for m, g, sd, act, path in CPU_GRID]
    flips = [("check_moe", cpu_case(5, 32, "float32", "float32", PATHS[path])[0],
              {"config": PATHS[path], "flip": flip}) for path in ("one-row", "sorted") for flip in ("low", "high")]
    defaults = [("check_moe", cpu_case(m, 32, "bfloat16", "float32", None)[0], {}) for m in (1, 16)]
    defaults += [("check_moe", cpu_case(m, 32, "bfloat16", "float16", None)[0], {}) for m in (1, 16)]
    # int32 expert ids (int64, as torch's topk gives them, everywhere else): one pair per program and sorted
    defaults += [("check_moe", cpu_case(m, 32, "bfloat16", "float16", None)[0], {"ids_dtype": "int32"})
                 for m in (1, 33)]
    splits = [("check_moe", [m, 8, 288, 160, 3, 6, 32, "bfloat16", act], {"config": SPLIT_PATHS[path]})
              for m, act, path in SPLIT_GRID]
    results = run_interpreted(calls + flips + defaults + splits)
    n, f, d = len(calls), len(flips), len(defaults)
    return {"grid": results[:n], "flips": results[n:n + f], "defaults": results[n + f:n + f + d],
            "splits": results[n + f + d:]}


@pytest.mark.parametrize("index", range(len(CPU_GRID)), ids=[" ".join(map(str, c)) for c in CPU_GRID])
def test_interpreted_fused_moe_matches_float64(cpu_results, index):
    result = cpu_results["grid"][index]
    assert result["all_written"], f"{result['name']}: NaN survived in the output (unwritten elements)"
    assert result["rel_err"] <= result["tolerance"], result


def test_interpreted_default_configs_match(cpu_results):
    for result in cpu_results["defaults"]:
        assert result["ok"], result


@pytest.mark.parametrize("index", range(len(SPLIT_GRID)), ids=[" ".join(map(str, c)) for c in SPLIT_GRID])
def test_interpreted_split_k_fused_moe_matches_float64(cpu_results, index):
    result = cpu_results["splits"][index]
    assert result["ok"], result


def test_interpreted_flipped_nibble_is_detected(cpu_results):
    for result in cpu_results["flips"]:
        assert result["all_written"], result
        assert result["rel_err"] > 10 * result["tolerance"], f"a flipped nibble went unnoticed: {result}"


def test_sorted_layout_groups_pairs_by_expert():
    from k2vec.engines.gpu_triton.kernels.fused_moe import sort_pairs_by_expert
    ids = torch.tensor([3, 0, 3, 5, 3, 0, 1, 3, 3])     # expert 2 and 4 unused, expert 3 spans two blocks
    pair_ids, block_expert = sort_pairs_by_expert(ids, num_experts=6, block_m=4)
    blocks = pair_ids.view(-1, 4).tolist()
    real = [(int(e), [p for p in b if p < len(ids)]) for e, b in zip(block_expert, blocks) if e < 6]
    assert real == [(0, [1, 5]), (1, [6]), (3, [0, 2, 4, 7]), (3, [8]), (5, [3])]
    assert all(p == len(ids) for e, b in zip(block_expert, blocks) if e == 6 for p in b)   # spare blocks empty
    assert len(block_expert) == (9 + 6 * 3) // 4     # the host-sync-free bound


def test_dense_only_tile_is_refused():
    from k2vec.engines.gpu_triton.kernels import verify
    from k2vec.engines.gpu_triton.kernels.fused_moe import fused_moe
    gen = verify.generator("cpu", "one-dot")
    experts = verify.random_experts(4, 64, 32, 32, "float32", gen, "cpu")
    # the experts keep the bundle's byte order only: the dense MMA-order tile is refused, not launched
    mma = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True)
    with pytest.raises(ValueError, match="MMA_ORDER"):
        fused_moe(torch.randn(1, 64), experts, torch.tensor([[0, 1]]), torch.ones(1, 2), config=(mma, mma))


GPU_GRID = list(itertools.product((1, 2, 4, 8, 16, 32, 64), GROUPS, SCALES, ("float32", "bfloat16", "float16")))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ("default", "sorted"))
@pytest.mark.parametrize("case", GPU_GRID, ids=[" ".join(map(str, c)) for c in GPU_GRID])
def test_gpu_fused_moe_matches_float64(case, path):
    from k2vec.engines.gpu_triton.kernels.verify import check_moe
    m, g, sd, act = case
    config = None if path == "default" else both(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, X_PLANES=True)
    # 40 experts, 30 used, hidden 9G, intermediate 5G: partial tiles everywhere; top-8 as in K2
    result = check_moe(m, 40, 9 * g, 5 * g, 8, 30, g, sd, act, device=cuda_device(), config=config)
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 16, 64))
def test_gpu_flipped_nibble_is_detected(m):
    from k2vec.engines.gpu_triton.kernels.verify import check_moe
    result = check_moe(m, 40, 288, 160, 8, 30, 32, "float32", "float32", device=cuda_device(), flip="low")
    assert result.all_written and result.rel_err > 10 * result.tolerance, result
