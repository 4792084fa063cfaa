"""Dense W4A16 kernel vs dequantize-then-matmul in float64 (k2vec.engines.gpu_triton.kernels.verify).

CPU: Triton's interpreter on small odd shapes, float32 and float16 activations (the interpreter mishandles
bfloat16 dots). GPU (marked `gpu`): every M in {1..64}, bfloat16 too. Outputs are NaN-poisoned before each launch.
"""
import itertools

import pytest
import torch

from support.kernel_checks import cuda_device, run_interpreted

GROUPS = (32, 64, 128)
SCALES = ("float32", "bfloat16")

# K = 9 G: several K tiles plus a partial one for every BLOCK_K; N = 37: partial N tiles
CPU_GRID = [(m, 37, 9 * g, g, sd, act)
            for m, g, sd, act in itertools.product((1, 3, 16, 33), GROUPS, SCALES, ("float32", "float16"))]
# one-row and tensor-core paths at the same M with every activation / scale option (the grid runs the defaults)
CPU_PATHS = [dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_PLANES=planes, SCALE_GROUPS=groups)
             for planes, groups in ((False, False), (True, False), (True, True))] + \
            [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_PLANES=planes) for planes in (False, True)] + \
            [# the weight's MMA-order words (K = 288 / 576: a partial last block of 128, padded in the words); with
             # PDL the first block's weights load before the wait (PEEL: the interpreter drops PDL, keeps the peel)
             dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True),
             dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True, PDL=True)]
# split-K on each tile path; K = 288 / 576 is 4.5 tiles of 64 / 128 (a partial tile), N = 37 (partial N tiles),
# and 5 tiles over 4 splits leaves the last split empty (runs of 2)
CPU_SPLITS = [dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_PLANES=True, SCALE_GROUPS=True, SPLIT_K=4),
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_PLANES=True, SPLIT_K=4),
              # natural-order x split into planes in registers (X_WIDE), on tensor cores and one-row; the one-row
              # GEMV with the next K tile prefetched (PREFETCH): 9 tiles of 64 over 4 splits (runs of 3, the last
              # empty) and unsplit
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, X_WIDE=True, SPLIT_K=2),
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, SPLIT_K=3),
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, SPLIT_K=4),
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True),
              # the biased codes (1 + u/128, one correction per group) on the one-row GEMV
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, BIASED_CODES=True,
                   SPLIT_K=4),
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, BIASED_CODES=True),
              # the MMA-order words in a 32-row tile, and split (5 blocks over 4 splits)
              dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True),
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True, SPLIT_K=4),
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True, PDL=True, SPLIT_K=4),   # the last split empty
              # the partials summed by a second launch (SPLIT_REDUCE), on the MMA tiles and the one-row GEMV
              dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True, SPLIT_K=4, SPLIT_REDUCE=True),
              dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, SPLIT_K=4,
                   SPLIT_REDUCE=True)]
MMA_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, MMA_ORDER=True)
# the one-row GEMV chains each run of 4 words (32 products) and adds the runs of a larger group: groups of 64 and
# 128 (2 and 4 runs), K = 9 G over 4 splits, both code forms
PREFETCH_ROW = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, SPLIT_K=4)
CPU_LARGE_GROUPS = [(g, dict(PREFETCH_ROW, BIASED_CODES=biased)) for g in (64, 128) for biased in (False, True)]
# a flipped bundle nibble, on the default tiles and on the MMA-order words made from the flipped bytes
CPU_FLIPS = [(m, 37, 288, 32, "float32", "float32", flip, None) for m in (1, 16) for flip in ("low", "high")] + \
            [(16, 37, 288, 32, "float32", "float32", flip, MMA_TILE) for flip in ("low", "high")]


@pytest.fixture(scope="module")
def cpu_results():
    calls = [("check_dense", list(case), {}) for case in CPU_GRID]
    calls += [("check_dense", [3, 37, 288, 32, "bfloat16", "float32"], {"config": cfg}) for cfg in CPU_PATHS]
    calls += [("check_dense", [3, 37, 576, 64, "float32", "float16"], {"config": cfg}) for cfg in CPU_PATHS]
    split_calls = [("check_dense", [m, 37, 576, 32, "bfloat16", act], {"config": cfg})
                   for cfg in CPU_SPLITS for m, act in ((1, "float32"), (3, "float16"))]
    calls += [("check_dense", list(case[:-2]), {"flip": case[-2], "config": case[-1]}) for case in CPU_FLIPS]
    group_calls = [("check_dense", [1, 37, 9 * g, g, "bfloat16", "float32"], {"config": cfg})
                   for g, cfg in CPU_LARGE_GROUPS]
    results = run_interpreted(calls + split_calls + group_calls)
    groups = results[len(calls) + len(split_calls):]
    splits = results[len(calls):len(calls) + len(split_calls)]
    results = results[:len(calls)]
    return {"grid": results[:len(CPU_GRID)], "paths": results[len(CPU_GRID):-len(CPU_FLIPS)],
            "flips": results[-len(CPU_FLIPS):], "splits": splits, "groups": groups}


@pytest.mark.parametrize("index", range(len(CPU_GRID)), ids=[" ".join(map(str, c)) for c in CPU_GRID])
def test_interpreted_dense_matches_float64(cpu_results, index):
    result = cpu_results["grid"][index]
    assert result["all_written"], f"{result['name']}: NaN survived in the output (unwritten elements)"
    assert result["rel_err"] <= result["tolerance"], result


def test_interpreted_every_tile_path_matches(cpu_results):
    assert len(cpu_results["paths"]) == 2 * len(CPU_PATHS)
    for result in cpu_results["paths"]:
        assert result["ok"], result


def test_interpreted_split_k_matches(cpu_results):
    # several split-K launches in one process: a counter left non-zero by one would break the next
    assert len(cpu_results["splits"]) == 2 * len(CPU_SPLITS)
    for result in cpu_results["splits"]:
        assert result["ok"], result


@pytest.mark.parametrize("index", range(len(CPU_LARGE_GROUPS)),
                         ids=[f"G={g} biased={cfg['BIASED_CODES']}" for g, cfg in CPU_LARGE_GROUPS])
def test_interpreted_one_row_path_sums_runs_of_a_larger_group(cpu_results, index):
    result = cpu_results["groups"][index]
    assert result["all_written"], result
    assert result["rel_err"] <= result["tolerance"], result


def test_split_reduce_gives_the_last_programs_sums_bit_for_bit():
    # two row tiles (M = 20 in 16-row tiles), a partial N tile, 7 K blocks over 3 splits (runs of 3, 3, 1); the
    # one-row GEMV's splits too
    results = run_interpreted([
        ("check_split_sums", [20, 70, 896], {"config": dict(MMA_TILE, SPLIT_K=3)}),
        ("check_split_sums", [1, 70, 896], {"config": dict(PREFETCH_ROW, SPLIT_K=3)})])
    for result in results:
        assert result["ok"], result


def test_split_k_counts_splits_within_k_tiles():
    from k2vec.engines.gpu_triton.kernels.configs import split_k
    cfg = dict(BLOCK_K=128)
    assert split_k({**cfg, "SPLIT_CTAS": 264}, 7168, 32) == 8       # 9 wanted: runs of 7 of 56 K tiles, 8 splits
    assert split_k({**cfg, "SPLIT_CTAS": 264}, 2048, 112) == 3
    assert split_k({**cfg, "SPLIT_CTAS": 264}, 256, 1) == 2          # at most one split per K tile
    assert split_k({**cfg, "SPLIT_K": 4}, 576, 5) == 4
    assert split_k(cfg, 7168, 1) == 1                               # no SPLIT_CTAS: no split
    # SPLIT_FIT: the grid stays within SPLIT_CTAS programs (one wave of a tile resident once per SM)
    fit = dict(BLOCK_K=256, SPLIT_CTAS=132, SPLIT_FIT=True)
    assert split_k({**fit, "SPLIT_FIT": False}, 7168, 32) == 5      # 160 programs: two waves
    assert split_k(fit, 7168, 32) == 4                              # 128
    assert split_k(fit, 2048, 56) == 2                              # 112
    assert split_k(fit, 7168, 16) == 7                              # 8 wanted: runs of 4 of 28 K tiles, 7 splits
    assert split_k(fit, 7168, 200) == 1                             # more tiles than programs: no split


def test_interpreted_flipped_nibble_is_detected(cpu_results):
    for result in cpu_results["flips"]:
        assert result["all_written"], result
        assert result["rel_err"] > 10 * result["tolerance"], f"a flipped nibble went unnoticed: {result}"


def test_mma_order_words_place_each_code_where_its_mma_thread_reads_it():
    from k2vec.engines.gpu_triton.kernels.int4_layout import mma_order_words
    n, k = 3, 160       # one whole block of 128 and a partial one (32 elements, padded with code 8)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k).tolist()
    words = mma_order_words(packed, k)
    assert words.dtype == torch.int32 and words.shape == (2, n, 16) and words.is_contiguous()   # block-major
    for r in range(n):
        for b in range(2):
            for c, j, e in itertools.product(range(4), range(4), range(8)):
                e0, e1, e2 = e & 1, (e >> 1) & 1, e >> 2
                col = 128 * b + 32 * j + 16 * e1 + 8 * e0 + 2 * c + e2
                nibble = (int(words[b, r, 4 * c + j]) >> (4 * e)) & 15
                assert nibble == (codes[r][col] if col < k else 8), (r, b, c, j, e)


@pytest.mark.parametrize("group_size, k", [(32, 160), (64, 192), (128, 256)],
                         ids=["g32-partial", "g64-partial", "g128"])
def test_mma_order_scales_are_block_major_with_a_partial_blocks_groups_zero(group_size, k):
    from k2vec.engines.gpu_triton.kernels.int4_layout import mma_order_scales
    n, per_block = 3, 128 // group_size
    scales = torch.arange(1, 1 + n * (k // group_size), dtype=torch.float32).reshape(n, k // group_size)
    out = mma_order_scales(scales.to(torch.bfloat16), k, group_size)
    blocks = -(-k // 128)
    assert out.dtype == torch.bfloat16 and out.shape == (blocks, n, per_block) and out.is_contiguous()
    for b, r, g in itertools.product(range(blocks), range(n), range(per_block)):
        group = b * per_block + g
        want = float(scales[r, group]) if group < k // group_size else 0.0
        assert float(out[b, r, g]) == want, (b, r, g)


def test_mma_order_config_needs_the_mma_words():
    from k2vec.engines.gpu_triton.kernels import pack_for_gpu, w4a16_linear
    from k2vec.engines.gpu_triton.kernels.verify import random_int4
    weight = pack_for_gpu(*random_int4(32, 128, 32, "float32", torch.Generator().manual_seed(1), "cpu"), 32,
                          "float32", "cpu", mma_order=False)
    assert weight.mma is None
    with pytest.raises(ValueError, match="MMA-order words"):
        w4a16_linear(torch.zeros(4, 128), weight, config=MMA_TILE)
    with pytest.raises(ValueError, match="MMA_ORDER is a tensor-core tile"):
        w4a16_linear(torch.zeros(4, 128), weight, config=dict(MMA_TILE, BLOCK_K=256))


def test_dense_configs_give_a_shape_its_own_table():
    from k2vec.engines.gpu_triton.kernels.configs import (
        DENSE_CONFIGS,
        DENSE_CONFIGS_FP32,
        DENSE_SHAPE_CONFIGS,
        dense_configs,
        tile_config,
    )
    assert dense_configs(7168, 2048, torch.bfloat16) is DENSE_SHAPE_CONFIGS[(7168, 2048)]
    assert dense_configs(7168, 2048, torch.float16) is DENSE_SHAPE_CONFIGS[(7168, 2048)]
    assert dense_configs(2048, 7168, torch.bfloat16) is DENSE_SHAPE_CONFIGS[(2048, 7168)]
    assert dense_configs(7168, 4096, torch.bfloat16) is DENSE_SHAPE_CONFIGS[(7168, 4096)]
    assert dense_configs(1536, 7168, torch.bfloat16) is DENSE_CONFIGS          # no table of its own
    assert dense_configs(7168, 2048, torch.float32) is DENSE_CONFIGS_FP32
    for table in (DENSE_CONFIGS, *DENSE_SHAPE_CONFIGS.values()):     # every M covered, every entry launchable
        bounds = [bound for bound, _ in table]
        assert bounds == sorted(bounds) and bounds[-1] >= 1 << 62, bounds
        for _, cfg in table:
            tile_config(cfg, 32, interpret=False)


def test_tile_config_refuses_an_unknown_key():
    from k2vec.engines.gpu_triton.kernels.configs import tile_config
    # ONE_DOT: a session-13 tile option since removed; a typo of a known key fails the same way
    for key in ("ONE_DOT", "BLOCK_n"):
        with pytest.raises(ValueError, match=f"unknown key\\(s\\) {key}"):
            tile_config(dict(MMA_TILE, **{key: True}), 32, interpret=True)
    assert tile_config(MMA_TILE, 32, interpret=True)["MMA_ORDER"]


def test_flip_nibble_changes_exactly_one_code():
    from k2vec.engines.gpu_triton.kernels.verify import flip_nibble, generator
    packed = torch.randint(0, 256, (5, 7), dtype=torch.uint8, generator=generator("cpu", "flip"))
    for high in (False, True):
        flipped = packed.clone()
        index, mask = flip_nibble(flipped, generator("cpu", "flip", high), high)
        changed = (flipped != packed).nonzero().tolist()
        assert changed == [list(index)]
        assert int(flipped[index] ^ packed[index]) == mask == (0x80 if high else 0x08)


GPU_GRID = [(m, 1000, 18 * g, g, sd, act) for m, g, sd, act in
            itertools.product((1, 2, 4, 8, 16, 32, 64), GROUPS, SCALES, ("float32", "bfloat16", "float16"))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_GRID, ids=[" ".join(map(str, c)) for c in GPU_GRID])
def test_gpu_dense_matches_float64(case):
    from k2vec.engines.gpu_triton.kernels.verify import check_dense
    result = check_dense(*case, device=cuda_device())
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 16, 64))
@pytest.mark.parametrize("flip", ("low", "high"))
def test_gpu_flipped_nibble_is_detected(m, flip):
    from k2vec.engines.gpu_triton.kernels.verify import check_dense
    result = check_dense(m, 1000, 576, 32, "float32", "float32", device=cuda_device(), flip=flip)
    assert result.all_written and result.rel_err > 10 * result.tolerance, result
