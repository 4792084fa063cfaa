"""The fused MoE's launches on the CUDA kernel (MOE 1: gate/up, MOE 2: down): the experts' load-time copies, checked
on the CPU against the model of what the kernel's lanes read, with the kernel's own rules for pairing a gate row with
its up row and for laying a token's pairs side by side along K; which calls reach them; the compiled kernel (gate/up
waits for the routing before it reads a weight, down reads x only after its wait); and on a GPU (marked `gpu`)
fused_moe with CUDA tiles against float64, and flipped nibbles seen in their own column.
"""
import dataclasses
import importlib
import re
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from support.cuda_operands import FakeX, compile_for_sm90, emulate, needs_nvrtc, reference

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import (CudaKernelError, CudaOrder, CudaTile, MoeLaunch,
                                                         down_order_copy, gate_up_order_copy, interleave_gate_up,
                                                         w4a16_cuda_down, w4a16_cuda_gate_up)


@dataclass(frozen=True)
class CopyCase:
    name: str
    experts: int
    inter: int
    hidden: int
    rows: int        # the block's rows whose epilogue pairs gate and up (16 nwn tpw)
    scales: str


COPY_CASES = [CopyCase("3 experts, one tile pair per block", 3, 32, 128, 32, "bfloat16"),
              CopyCase("2 experts, three tile pairs per block", 2, 48, 192, 96, "bfloat16"),
              CopyCase("float32 scales, two pairs per block", 2, 64, 128, 64, "float32")]


def random_experts(case: CopyCase, rng):
    """uint8 [E, 2I, H/2] and scales [E, 2I, H/32] (bf16 bits or float32): gate rows, then up rows, per expert."""
    packed = rng.integers(0, 256, (case.experts, 2 * case.inter, case.hidden // 2), dtype=np.uint8)
    shape = (case.experts, 2 * case.inter, case.hidden // 32)
    if case.scales == "float32":
        scales = rng.uniform(0.002, 0.03, shape).astype(np.float32)
        return packed, scales, torch.from_numpy(scales)
    scales = rng.integers(0x3b00, 0x3d00, shape).astype(np.uint16)
    return packed, scales, torch.from_numpy(scales.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.name)
def test_gate_up_copy_pairs_each_gate_row_with_its_up_row(case):
    """Expert e's tiles of the copy, read as the lanes read them (emulate), then paired as the kernel's epilogue pairs
    them (block b's output q: gate at row 32 (q // 16) + q % 16 of the block, up 16 rows on, h column b rows / 2 + q),
    give x @ gate^T and x @ up^T of that expert, column for column."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    packed, scales, scale_tensor = random_experts(case, rng)
    x = rng.standard_normal((3, case.hidden))
    copy = gate_up_order_copy(torch.from_numpy(packed), scale_tensor, case.hidden)
    tiles = 2 * case.inter // 16
    assert copy.codes.shape[0] == case.experts * tiles
    blocks, q = np.arange(2 * case.inter // case.rows)[:, None], np.arange(case.rows // 2)[None, :]
    gate_row = (blocks * case.rows + 32 * (q // 16) + q % 16).ravel()
    column = (blocks * case.rows // 2 + q).ravel()
    for e in range(case.experts):
        y = emulate(x, copy.codes[e * tiles:(e + 1) * tiles].numpy(), copy.scales[e * tiles:(e + 1) * tiles].numpy())
        gate = reference(x, packed[e, :case.inter], scales[e, :case.inter])
        up = reference(x, packed[e, case.inter:], scales[e, case.inter:])
        np.testing.assert_allclose(y[:, gate_row], gate[:, column], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(y[:, gate_row + 16], up[:, column], rtol=1e-12, atol=1e-12)


def test_interleave_takes_gate_and_up_tiles_in_turn():
    rows = torch.arange(64)      # an expert of I = 32: gate rows 0-31, up rows 32-63
    assert interleave_gate_up(rows).tolist() == [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)]


@dataclass(frozen=True)
class DownCase:
    name: str
    tile: CudaTile
    experts: int
    hidden: int      # the down weight's rows (N)
    inter: int       # an expert's K
    top_k: int


DOWN_CASES = [DownCase("a pair per K warp group", CudaTile(1, 4, 1, 8), 5, 32, 128, 4),
              DownCase("two K warp groups a pair, a cluster of 2", CudaTile(1, 3, 2, 8), 4, 48, 256, 3),
              DownCase("a pair per block of 4 K warps", CudaTile(2, 4, 2, 8), 6, 64, 512, 2)]


@pytest.mark.parametrize("case", DOWN_CASES, ids=lambda c: c.name)
def test_down_sums_each_tokens_pairs_by_the_kernels_slice_rule(case):
    """A token's output as the down kernel forms it: K warp group i (block kblock, warp wk: i = kblock NWK + wk) reads
    x[i STEPS 64 ..] of the token's top_k rows of h side by side and, from pair j = i STEPS // ks (ks an expert's
    steps), expert ids[j]'s copy at steps i STEPS % ks ..; its sum times route_w[j]; the groups' sums added in i's
    order. Read as the lanes read it (emulate), that is sum_j route_w[j] h_j @ down_ids[j]^T."""
    assert case.tile.fits_down(case.hidden, case.inter, case.top_k)
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    packed = rng.integers(0, 256, (case.experts, case.hidden, case.inter // 2), dtype=np.uint8)
    bits = rng.integers(0x3b00, 0x3d00, (case.experts, case.hidden, case.inter // 32)).astype(np.uint16)
    copy = down_order_copy(torch.from_numpy(packed), torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
                           case.inter)
    ids = rng.permutation(case.experts)[:case.top_k]
    route_w = rng.uniform(0.1, 1.0, case.top_k)
    h = rng.standard_normal((1, case.top_k * case.inter))
    d = case.tile.defines(case.top_k * case.inter, 1, False, MoeLaunch(True, case.top_k, True))
    steps, ks, tiles = d["STEPS"], case.inter // 64, case.hidden // 16
    codes = copy.codes.numpy().reshape(case.experts, tiles, ks, 32, 4)
    scales = copy.scales.numpy().reshape(case.experts, tiles, ks, 8, 2)
    out = np.zeros((1, case.hidden))
    for i in range(d["CL"] * d["NWK"]):
        j, step0 = i * steps // ks, i * steps % ks
        e, cut = ids[j], slice(step0, step0 + steps)
        out += route_w[j] * emulate(h[:, i * steps * 64:(i + 1) * steps * 64], codes[e][:, cut], scales[e][:, cut])
    want = sum(route_w[j] * reference(h[:, j * case.inter:(j + 1) * case.inter], packed[ids[j]], bits[ids[j]])
               for j in range(case.top_k))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@dataclass(frozen=True)
class FitCase:
    name: str
    tile: CudaTile
    n: int          # an expert's gate and up rows
    k: int
    fits: bool


FIT_CASES = [
    FitCase("K2's experts, 2 warps along N", CudaTile(2, 8, 1, 8), 4096, 7168, True),
    FitCase("a cluster of 8 along K", CudaTile(2, 1, 8, 8), 4096, 7168, True),
    FitCase("two tiles per warp", CudaTile(1, 8, 1, 8, tpw=2), 4096, 7168, True),
    FitCase("16-row blocks: a gate tile without its up tile", CudaTile(1, 8, 1, 8), 4096, 7168, False),
    FitCase("48-row blocks split a tile pair", CudaTile(3, 4, 1, 8), 4032, 7168, False),
    FitCase("x multicast (one row of x to share)", CudaTile(2, 8, 1, 8, xmc=2), 4096, 7168, False),
    FitCase("K not in whole steps per warp", CudaTile(2, 8, 1, 8), 4096, 7104, False),
]


@pytest.mark.parametrize("case", FIT_CASES, ids=lambda c: c.name)
def test_gate_up_tile_fits(case):
    assert case.tile.fits_gate_up(case.n, case.k) is case.fits


@dataclass(frozen=True)
class DownFitCase:
    name: str
    tile: CudaTile
    fits: bool       # for K2's down launch: N 7168, an expert's K 2048, top-8 (K = 16384)


DOWN_FIT_CASES = [
    DownFitCase("a pair per K warp group, 16-row blocks", CudaTile(1, 8, 1, 8), True),
    DownFitCase("a cluster of 8: a pair per block", CudaTile(2, 1, 8, 8), True),
    DownFitCase("4 K warps, no cluster: a slice of two pairs", CudaTile(2, 4, 1, 8), False),
    DownFitCase("x multicast", CudaTile(1, 8, 1, 8, xmc=2), False),
    DownFitCase("x's whole slice, 32 steps, in 8 rows would not fit; in one row it does", CudaTile(1, 8, 1, 8), True),
]


@pytest.mark.parametrize("case", DOWN_FIT_CASES, ids=lambda c: c.name)
def test_down_tile_fits(case):
    assert case.tile.fits_down(7168, 2048, 8) is case.fits


def test_moe_shared_memory_holds_one_row_of_x():
    """The MoE's launches keep one row of x (XROWS 1); the same tile for the dense kernel at M = 1 keeps 8."""
    tile = CudaTile(1, 8, 1, 8)
    assert not tile.fits(7168, 16384, 1) and tile.fits(7168, 16384, 1, moe=True)
    assert tile.shared_bytes(16384, 1) - tile.shared_bytes(16384, 1, moe=True) == 8 * 7 * (32 * 64 + 32) * 2


def test_moe_defines():
    defines = CudaTile(2, 8, 1, 8, ch=4).defines(7168, 1, False, MoeLaunch(False, 8, True, True))
    assert {key: defines[key] for key in ("MOE", "TOPK", "IDS64", "OUT_PLANES", "MT", "XROWS")} == dict(
        MOE=1, TOPK=8, IDS64=1, OUT_PLANES=1, MT=1, XROWS=1)
    assert CudaTile(2, 8, 1, 8).defines(16384, 1, False, MoeLaunch(True, 8, False))["MOE"] == 2
    assert CudaTile(2, 8, 1, 8).defines(7168, 1, False, MoeLaunch(False, 6, False))["IDS64"] == 0


@dataclass(frozen=True)
class RefusalCase:
    name: str
    tile: CudaTile
    x: torch.Tensor
    ids: torch.Tensor
    h_shape: tuple[int, int]
    says: str


X2 = torch.zeros(2, 1024, dtype=torch.bfloat16)
IDS = torch.zeros(2 * 4, dtype=torch.int64)
REFUSALS = [
    RefusalCase("16-row blocks", CudaTile(1, 4, 1, 8), X2, IDS, (8, 64), "does not fit the gate/up launch"),
    RefusalCase("float16 x", CudaTile(2, 4, 1, 8), X2.half(), IDS, (8, 64), "torch.float16"),
    RefusalCase("float ids", CudaTile(2, 4, 1, 8), X2, IDS.float(), (8, 64), "int32 or int64"),
    RefusalCase("ids of another top-k", CudaTile(2, 4, 1, 8), X2, IDS[:6], (6, 64), "expert ids must be 8"),
    RefusalCase("h of the experts' whole width", CudaTile(2, 4, 1, 8), X2, IDS, (8, 128), r"h must be .*\[8, 64\]"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.name)
def test_gate_up_refuses_before_launching(case):
    """w4a16_cuda_gate_up checks the call before it reaches the driver (this runs without a GPU)."""
    copy = CudaOrder(torch.zeros(8, 16, 32, 4, dtype=torch.int32), torch.zeros(8, 16, 8, 2, dtype=torch.int32))
    with pytest.raises(CudaKernelError, match=case.says):
        w4a16_cuda_gate_up(case.x, copy, case.ids, 4, 128, 1024, torch.empty(case.h_shape, dtype=torch.bfloat16),
                           case.tile)


@dataclass(frozen=True)
class DownRefusalCase:
    name: str
    tile: CudaTile
    route_w: torch.Tensor
    out_shape: tuple[int, int]
    says: str


H8 = torch.zeros(8, 512, dtype=torch.bfloat16)      # 2 tokens of top-4, an expert's K 512
W8 = torch.ones(8)
DOWN_REFUSALS = [
    DownRefusalCase("a K warp group's slice over two pairs", CudaTile(1, 2, 1, 8), W8, (2, 64), "not fit the down"),
    DownRefusalCase("bf16 routing weights", CudaTile(1, 4, 2, 8), W8.bfloat16(), (2, 64), "route_w must be 8"),
    DownRefusalCase("an output row per pair", CudaTile(1, 4, 2, 8), W8, (8, 64), r"out must be .*\[2, 64\]"),
]


@pytest.mark.parametrize("case", DOWN_REFUSALS, ids=lambda c: c.name)
def test_down_refuses_before_launching(case):
    copy = CudaOrder(torch.zeros(8, 8, 32, 4, dtype=torch.int32), torch.zeros(8, 8, 8, 2, dtype=torch.int32))
    with pytest.raises(CudaKernelError, match=case.says):
        w4a16_cuda_down(H8, copy, torch.zeros(8, dtype=torch.int64), case.route_w, 4, 64, 512,
                        torch.empty(case.out_shape, dtype=torch.bfloat16), case.tile)


# ---------------------------------------------------------------- which calls reach it

K2_TILE, K2_DOWN = CudaTile(2, 8, 1, 8, ch=4), CudaTile(1, 8, 1, 8, ch=2)
BF16_OUT = torch.empty(2, 7168, dtype=torch.bfloat16)


@dataclass(frozen=True)
class DispatchCase:
    name: str
    x: FakeX
    with_copies: bool
    entries: tuple[dict, dict]
    want: tuple[CudaTile | None, CudaTile | None]
    out: torch.Tensor = BF16_OUT


DISPATCH = [
    DispatchCase("both configs naming a tile", FakeX(2), True, ({"CUDA": K2_TILE}, {"CUDA": K2_DOWN}),
                 (K2_TILE, K2_DOWN)),
    DispatchCase("gate/up alone", FakeX(2), True, ({"CUDA": K2_TILE}, {}), (K2_TILE, None)),
    DispatchCase("down alone", FakeX(2), True, ({}, {"CUDA": K2_DOWN}), (None, K2_DOWN)),
    DispatchCase("experts without the copies: Triton", FakeX(2), False, ({"CUDA": K2_TILE}, {"CUDA": K2_DOWN}),
                 (None, None)),
    DispatchCase("float16 x: Triton", FakeX(2, torch.float16), True, ({"CUDA": K2_TILE}, {}), (None, None)),
    DispatchCase("x not 16-byte aligned: Triton", FakeX(2, ptr=(1 << 20) + 8), True, ({"CUDA": K2_TILE}, {}),
                 (None, None)),
    DispatchCase("x on the CPU: Triton", FakeX(2, is_cuda=False), True, ({"CUDA": K2_TILE}, {}), (None, None)),
    DispatchCase("tiles that do not fit: Triton", FakeX(2), True,
                 ({"CUDA": CudaTile(1, 8, 1, 8)}, {"CUDA": CudaTile(2, 4, 1, 8)}), (None, None)),
    DispatchCase("more pairs than the grid's z holds: Triton", FakeX(8192), True,
                 ({"CUDA": K2_TILE}, {"CUDA": K2_DOWN}), (None, None)),
    DispatchCase("as many as it holds", FakeX(8191), True, ({"CUDA": K2_TILE}, {}), (K2_TILE, None)),
    DispatchCase("a float32 output: the Triton down launch", FakeX(2), True, ({"CUDA": K2_TILE}, {"CUDA": K2_DOWN}),
                 (K2_TILE, None), torch.empty(2, 7168)),
    DispatchCase("an output with a row stride: the Triton down launch", FakeX(2), True,
                 ({"CUDA": K2_TILE}, {"CUDA": K2_DOWN}), (K2_TILE, None),
                 torch.empty(2, 8000, dtype=torch.bfloat16)[:, :7168]),
]


@pytest.mark.parametrize("case", DISPATCH, ids=lambda c: c.name)
def test_moe_dispatch(case, monkeypatch):
    from k2vec.engines.gpu_triton.kernels import w4a16
    fused_moe = importlib.import_module("k2vec.engines.gpu_triton.kernels.fused_moe")   # not the function
    monkeypatch.setattr(w4a16, "runs_on", lambda index: True)
    monkeypatch.setattr(w4a16, "interpreting", lambda: False)
    copy = CudaOrder(torch.zeros(0), torch.zeros(0)) if case.with_copies else None    # only presence is read
    experts = fused_moe.PackedExperts(*[torch.zeros(0)] * 4, 384, 7168, 2048, 32, copy, copy)
    assert fused_moe.moe_cuda_tiles(case.entries, experts, case.x, case.out, 8) == case.want


def test_a_cuda_tile_on_the_sorted_path_is_refused():
    """The CUDA gate/up launch takes one pair per block: a config that names it on the expert-sorted path is an
    error wherever it runs, not only on a GPU."""
    from k2vec.engines.gpu_triton.kernels.fused_moe import fused_moe
    from k2vec.engines.gpu_triton.kernels.verify import generator, random_experts
    gen = generator("cpu", "sorted cuda")
    experts = random_experts(4, 128, 32, 32, "bfloat16", gen, "cpu", cuda_order=True)
    assert experts.cuda13 is not None
    sorted_tc = dict(BLOCK_M=16, SORTED=True, BLOCK_N=32, BLOCK_K=128)
    with pytest.raises(ValueError, match="one pair per block"):
        fused_moe(torch.zeros(2, 128), experts, torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2),
                  config=(dict(sorted_tc, CUDA=CudaTile(2, 2, 1, 8)), sorted_tc))


def test_experts_get_the_copy_only_where_the_format_allows():
    from k2vec.engines.gpu_triton.kernels.verify import generator, random_experts
    gen = generator("cpu", "copy rule")
    with_copies = random_experts(2, 128, 64, 32, "bfloat16", gen, "cpu", cuda_order=True)
    assert with_copies.cuda13 is not None and with_copies.cuda2 is not None
    assert with_copies.cuda2.codes.shape == (2 * 128 // 16, 64 // 64, 32, 4)
    assert random_experts(2, 128, 64, 64, "bfloat16", gen, "cpu", cuda_order=True).cuda13 is None   # G 64
    assert random_experts(2, 96, 64, 32, "bfloat16", gen, "cpu", cuda_order=True).cuda13 is None    # H 96: K % 64
    only_gate_up = random_experts(2, 128, 32, 32, "bfloat16", gen, "cpu", cuda_order=True)          # I 32: K % 64
    assert only_gate_up.cuda13 is not None and only_gate_up.cuda2 is None
    assert random_experts(2, 128, 64, 32, "bfloat16", gen, "cpu").cuda13 is None


def test_moe_names_cuda_only_where_a_moe_config_names_a_cuda_tile(monkeypatch):
    """What decides whether a bf16 engine makes the experts' CUDA-order copies (model.routed_experts)."""
    from k2vec.engines.gpu_triton.kernels import configs
    triton_only = [(bound, tuple({k: v for k, v in cfg.items() if k != "CUDA"} for cfg in pair))
                   for bound, pair in configs.MOE_CONFIGS]
    monkeypatch.setattr(configs, "MOE_CONFIGS", triton_only)
    assert not configs.moe_names_cuda()
    down_at_16 = [(bound, (g, dict(d, CUDA=DOWN) if bound == 16 else d)) for bound, (g, d) in triton_only]
    monkeypatch.setattr(configs, "MOE_CONFIGS", down_at_16)
    assert configs.moe_names_cuda()


# ---------------------------------------------------------------- on a GPU

@dataclass(frozen=True)
class GpuCase:
    name: str
    m: int
    gate_up: CudaTile | None     # None: the Triton launch of `triton`'s gate/up config
    down: CudaTile | None
    triton: tuple[dict, dict]    # the configs beside the CUDA keys (X_PLANES on the down one: h written plane-major)
    scales: str = "bfloat16"
    ids: str = "int64"


ROW = dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_WIDE=True, SCALE_GROUPS=True)
ROWS = (ROW, ROW)
SORTED = dict(BLOCK_M=16, SORTED=True, BLOCK_N=64, BLOCK_K=128, X_PLANES=True)
GATE_UP, DOWN = CudaTile(2, 4, 1, 8, ch=2), CudaTile(1, 6, 1, 8)     # down: one pair per K warp group
GPU_CASES = [
    GpuCase("one token, the Triton down launch summing its pairs", 1, GATE_UP, None, (ROW, dict(ROW, COMBINE=True))),
    GpuCase("5 tokens, int32 ids", 5, GATE_UP, None, ROWS, ids="int32"),
    GpuCase("16 tokens, a cluster of 2, float32 scales", 16, CudaTile(2, 2, 2, 8, ch=2), None, ROWS, "float32"),
    GpuCase("3 tokens, h plane-major for the Triton down launch", 3, CudaTile(4, 2, 1, 8, ch=4), None,
            (ROW, dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SCALE_GROUPS=True))),
    GpuCase("8 tokens, two tiles per warp, the codes' ring", 8, CudaTile(1, 4, 1, 12, ch=2, tpw=2, ring=True), None,
            ROWS),
    GpuCase("2 tokens, x's ring", 2, CudaTile(2, 4, 1, 8, ch=2, nxr=2), None, ROWS),
    GpuCase("one token, both launches", 1, GATE_UP, DOWN, ROWS),
    GpuCase("7 tokens, both, int32 ids, down in clusters of 2 (two K warp groups a pair)", 7, GATE_UP,
            CudaTile(1, 6, 2, 8), ROWS, ids="int32"),
    GpuCase("4 tokens, down after the Triton gate/up, float32 scales, the codes' ring", 4, None,
            CudaTile(2, 6, 1, 12, ring=True), ROWS, "float32"),
    GpuCase("20 tokens, down after the expert-sorted Triton gate/up", 20, None, DOWN, (SORTED, SORTED)),
]


@pytest.fixture
def moe_cuda_calls(monkeypatch):
    """The launches that reach the CUDA kernel: ("gate/up" or "down", tile)."""
    fused_moe = importlib.import_module("k2vec.engines.gpu_triton.kernels.fused_moe")
    calls = []
    for name, launch, tile_at in (("gate/up", "w4a16_cuda_gate_up", 7), ("down", "w4a16_cuda_down", 8)):
        def counted(*args, real=getattr(fused_moe, launch), name=name, tile_at=tile_at, **kwargs):
            calls.append((name, args[tile_at]))
            return real(*args, **kwargs)
        monkeypatch.setattr(fused_moe, launch, counted)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_moe_cuda_launches_match_float64(case, moe_cuda_calls):
    """fused_moe with one or both launches on the CUDA kernel against float64: 12 experts of hidden 1024 and
    intermediate 256 (2 tile pairs per 64-row gate/up block; down: 4 steps a pair), top-6 among 10 used, so that tokens
    share experts."""
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.verify import check_moe
    gate_up, down = case.triton
    config = (dict(gate_up, CUDA=case.gate_up) if case.gate_up else gate_up,
              dict(down, CUDA=case.down) if case.down else down)
    result = check_moe(case.m, 12, 1024, 256, 6, 10, 32, case.scales, "bfloat16", device=cuda_device(),
                       config=config, ids_dtype=case.ids)
    want = [(name, tile) for name, tile in (("gate/up", case.gate_up), ("down", case.down)) if tile]
    assert moe_cuda_calls == want, "the calls did not reach the CUDA kernel as the config says"
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("flip", ["low", "high"])
def test_gpu_gate_up_sees_a_flipped_nibble_in_its_own_column(flip):
    """A flipped nibble of a routed expert's gate or up row (q -> q +- 8, below the bf16 tolerance of a whole MoE
    output) moves h's column of that row in that expert's pairs, by what float64 says (up to bf16 rounding), and
    leaves every other element of h bitwise as it was."""
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4
    from k2vec.engines.gpu_triton.kernels.verify import generator, random_experts, random_routing
    device = cuda_device()
    gen = generator(device, f"gate/up flip {flip}")
    hidden, inter, tile = 1024, 256, CudaTile(2, 4, 1, 8, ch=2)
    experts = random_experts(12, hidden, inter, 32, "bfloat16", gen, device, cuda_order=True)
    ids = random_routing(4, 6, 12, 10, gen, device)[0].reshape(-1).contiguous()
    x = torch.randn(4, hidden, generator=gen, device=device).to(torch.bfloat16)

    def h_of(copy):
        h = torch.empty(ids.numel(), inter, dtype=torch.bfloat16, device=device)
        return w4a16_cuda_gate_up(x, copy, ids, 6, 2 * inter, hidden, h, tile)

    def h64(e):      # float64 silu(gate) * up of expert e for every token
        w = PackedInt4(experts.w13[e], experts.s13[e], 2 * inter, hidden, 32).dequantize().double()
        gu = x.double() @ w.T
        return torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]

    e = int(ids[0])
    pairs = (ids == e).nonzero().ravel()
    clean = h_of(experts.cuda13)
    row, before, after = flip_that_moves(experts.w13[e], gen, flip == "high", lambda: h64(e),
                                         lambda row: (pairs // 6, row % inter))
    flipped = h_of(gate_up_order_copy(experts.w13, experts.s13, hidden))
    assert_moved_alone(clean, flipped, (pairs, row % inter), before[pairs // 6, row % inter],
                       after[pairs // 6, row % inter])


def flip_that_moves(packed: torch.Tensor, gen: torch.Generator, high: bool, reference, watched,
                    tries: int = 16) -> tuple[int, torch.Tensor, torch.Tensor]:
    """flip_nibble (left in place) the first of up to `tries` draws whose flip moves the float64 `reference()` at
    `watched(row)` by more than 4 bf16 roundings somewhere: a flip inside rounding shows nothing of where the kernel
    reads it (a q +- 8 in one of K terms moves a sum by a few percent, about a bf16 rounding's size).
    Returns (the flipped row, reference before, after)."""
    from k2vec.engines.gpu_triton.kernels.verify import flip_nibble

    before = reference()
    for _ in range(tries):
        index, mask = flip_nibble(packed, gen, high)
        after = reference()
        where = watched(index[0])
        if ((after - before)[where].abs() > 4 * 2 ** -7 * (before[where].abs() + after[where].abs())).any():
            return index[0], before, after
        packed[index] ^= mask
    raise AssertionError(f"none of {tries} flips moves the output by more than 4 bf16 roundings")


def assert_moved_alone(clean: torch.Tensor, flipped: torch.Tensor, where: tuple, before: torch.Tensor,
                       after: torch.Tensor) -> None:
    """bf16 outputs before and after a flip: at `where` (an index of them) they moved by what float64 says (`before`
    and `after`, there) up to bf16 rounding, by more than rounding somewhere; everywhere else they are bitwise equal."""
    move = after - before
    moved = flipped[where].double() - clean[where].double()
    rounding = 2 ** -7 * (before.abs() + after.abs())
    assert (move.abs() > 4 * rounding).any(), "pick another seed: the flip moves the output by no more than rounding"
    assert ((moved - move).abs() <= 0.3 * move.abs() + rounding).all(), (moved, move)
    others = torch.ones_like(clean, dtype=torch.bool)
    others[where] = False
    assert torch.equal(flipped[others], clean[others])


@pytest.mark.gpu
@pytest.mark.parametrize("flip", ["low", "high"])
def test_gpu_down_sees_a_flipped_nibble_in_its_own_column(flip):
    """A flipped nibble of a routed expert's down row moves that output column of the tokens routed to the expert, by
    what float64 says (up to bf16 rounding of h and of the output), and leaves every other output bitwise as it was."""
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.fused_moe import fused_moe
    from k2vec.engines.gpu_triton.kernels.verify import generator, moe_reference, random_experts, random_routing
    device = cuda_device()
    gen = generator(device, f"down flip {flip}")
    experts = random_experts(12, 1024, 256, 32, "bfloat16", gen, device, cuda_order=True)
    ids, weights = random_routing(4, 6, 12, 10, gen, device)
    x = torch.randn(4, 1024, generator=gen, device=device).to(torch.bfloat16)
    config = (dict(ROW, CUDA=GATE_UP), dict(ROW, CUDA=DOWN))
    clean = fused_moe(x, experts, ids, weights, config=config)
    e = int(ids[0, 0])
    tokens = (ids == e).any(dim=1).nonzero().ravel()
    row, before, after = flip_that_moves(experts.w2[e], gen, flip == "high",
                                         lambda: moe_reference(x, experts, ids, weights), lambda row: (tokens, row))
    flipped_experts = dataclasses.replace(experts, cuda2=down_order_copy(experts.w2, experts.s2, 256))
    flipped = fused_moe(x, flipped_experts, ids, weights, config=config)
    assert_moved_alone(clean, flipped, (tokens, row), before[tokens, row], after[tokens, row])


# ---------------------------------------------------------------- compiled (NVRTC, no GPU)

@dataclass(frozen=True)
class CompileCase:
    name: str
    tile: CudaTile
    moe: MoeLaunch
    float32_scales: bool = False
    k: int = 0      # 0: K2's (gate/up 7168, down 8 x 2048)

    def __post_init__(self):
        if not self.k:
            object.__setattr__(self, "k", 8 * 2048 if self.moe.down else 7168)


COMPILE_CASES = [
    CompileCase("gate/up, K2 experts, int64 ids", K2_TILE, MoeLaunch(False, 8, True)),
    CompileCase("gate/up, int32 ids, h plane-major, float32 scales", K2_TILE, MoeLaunch(False, 8, False, True), True),
    CompileCase("gate/up, a cluster of 2", CudaTile(2, 4, 2, 8, ch=2), MoeLaunch(False, 8, True)),
    CompileCase("gate/up, the codes' ring", CudaTile(4, 2, 1, 12, ch=4, ring=True), MoeLaunch(False, 8, True)),
    CompileCase("gate/up, x's ring", CudaTile(2, 4, 1, 8, ch=2, nxr=2), MoeLaunch(False, 8, True)),
    CompileCase("down, K2 experts, int64 ids", K2_DOWN, MoeLaunch(True, 8, True)),
    CompileCase("down, int32 ids, float32 scales, a cluster of 4", CudaTile(2, 4, 4, 16, ch=2),
                MoeLaunch(True, 8, False), True),
    CompileCase("down, the codes' ring", CudaTile(1, 8, 2, 24, ch=2, ring=True), MoeLaunch(True, 8, True)),
]


def gpu_case_launches() -> list[CompileCase]:
    """The GPU cases' launches as compile cases (hidden 1024, intermediate 256, top-6)."""
    out = []
    for case in GPU_CASES:
        f32, ids64 = case.scales == "float32", case.ids == "int64"
        planes = bool(case.triton[1].get("X_PLANES")) and case.down is None
        if case.gate_up:
            out.append(CompileCase(f"{case.name}: gate/up", case.gate_up, MoeLaunch(False, 6, ids64, planes), f32,
                                   1024))
        if case.down:
            out.append(CompileCase(f"{case.name}: down", case.down, MoeLaunch(True, 6, ids64), f32, 6 * 256))
    return out


@pytest.mark.parametrize("case", gpu_case_launches(), ids=lambda c: c.name)
def test_gpu_cases_fit_their_launches(case):
    """Checked here, so that a GPU case that could not run shows before a GPU is at hand."""
    assert case.tile.fits_down(1024, 256, 6) if case.moe.down else case.tile.fits_gate_up(512, 1024)


@needs_nvrtc
@pytest.mark.parametrize("case", COMPILE_CASES + gpu_case_launches(), ids=lambda c: c.name)
def test_moe_kernels_compile_without_spills_and_wait_where_they_must(case):
    """The MoE's kernels compile for sm_90 without spilling. Gate/up reads nothing from global memory (the routing,
    then the weight it picks) before griddepcontrol.wait: the router's kernel, which it may overlap (PDL), writes the
    ids; the dense kernel, by contrast, loads its weights before the wait. Down reads the routing and (without the
    codes' ring) its weights before the wait, as the dense kernel does, and x (h, the gate/up launch's output) after
    it."""
    out = compile_for_sm90(case.tile, case.k, 1, case.float32_scales, case.moe)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.log)]
    assert out.cubin and spills and max(spills) == 0, out.log
    assert out.ptx.count("griddepcontrol.wait") == 1
    wait = out.ptx.index("griddepcontrol.wait")
    if not case.moe.down:
        assert wait < first_global_read(out.ptx)
        dense = compile_for_sm90(case.tile, case.k, 1, case.float32_scales).ptx
        assert first_global_read(dense) < dense.index("griddepcontrol.wait")
    else:
        assert first_global_read(out.ptx) < wait
        if not case.tile.ring:     # then every cp.async is x's
            assert wait < out.ptx.index("cp.async.cg.shared.global")


def first_global_read(ptx: str) -> int:
    """Where the PTX first reads global memory: a load, or an asynchronous copy to shared memory."""
    return re.search(r"ld\.global|cp\.async\.c[ag]\.shared\.global", ptx).start()
