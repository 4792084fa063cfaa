"""The CUDA W4A16 kernel (w4a16_cuda.cu): its operand copy, checked on the CPU against a model of what the kernel's
lanes read, and the kernel itself on a GPU (marked `gpu`) against dequantize-then-matmul in float64.

The model (`emulate`, in support/cuda_operands.py) is written from the kernel's own rules, not from
cuda_order_copy: for K step kb and sub-step j of a 16-row tile, lane (g, t) holds words [row g group 0, row g+8 group
0, row g group 1, row g+8 group 1]; the A registers of sub-step j = 2h + jj are pairs 2jj (slots 2t, 2t+1) and 2jj + 1
(slots 2t+8, 2t+9) of words 2h (rows 0-7) and 2h + 1 (rows 8-15), a pair p being nibbles (p, p + 4) minus 8; B slot c
of column n is x[n][64 kb + 32 h + 8 (c % 8 // 2) + 4 jj + 2 (c // 8) + c % 2]; each sub-step's product is scaled by
its group's scale of the row.
"""
import re
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from support.cuda_operands import FakeX, compile_for_sm90, emulate, needs_nvrtc, reference

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import (CudaOrder, CudaTile, cuda_order_codes, cuda_order_copy,
                                                         cuda_order_scales, m_tiles)


@dataclass(frozen=True)
class Case:
    name: str
    m: int
    n: int
    k: int
    scales: str


CASES = [Case("one tile one step", 1, 16, 64, "bfloat16"), Case("rows over two m8 tiles", 11, 48, 192, "bfloat16"),
         Case("K2-like ratio", 16, 32, 448, "bfloat16"), Case("float32 scales", 5, 32, 192, "float32")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_operand_copy_is_what_the_lanes_read(case):
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    packed = rng.integers(0, 256, (case.n, case.k // 2), dtype=np.uint8)
    if case.scales == "float32":
        scales = rng.uniform(0.002, 0.03, (case.n, case.k // 32)).astype(np.float32)
        scale_tensor = torch.from_numpy(scales)
    else:
        scales = (rng.integers(0x3b00, 0x3d00, (case.n, case.k // 32))).astype(np.uint16)   # bf16 ~0.002-0.03
        scale_tensor = torch.from_numpy(scales.view(np.int16)).view(torch.bfloat16)
    x = rng.standard_normal((case.m, case.k)).astype(np.float32).astype(np.float64)
    copy = cuda_order_copy(torch.from_numpy(packed), scale_tensor, case.k)
    got = emulate(x, copy.codes.numpy(), copy.scales.numpy())
    np.testing.assert_allclose(got, reference(x, packed, scales), rtol=1e-12, atol=1e-12)


def test_a_swapped_nibble_pair_is_seen():
    """The model is sharp: the copy with two nibbles of one lane's word swapped gives another product."""
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (16, 32), dtype=np.uint8)
    bits = rng.integers(0x3b00, 0x3d00, (16, 2)).astype(np.uint16)
    x = rng.standard_normal((2, 64))
    codes = cuda_order_codes(torch.from_numpy(packed), 64).numpy().view(np.uint32).copy()
    word = codes[0, 0, 5, 1]
    low, high = word & 0xF, (word >> 4) & 0xF
    assert low != high, "pick another seed: the swap would change nothing"
    codes[0, 0, 5, 1] = (word & ~np.uint32(0xFF)) | (low << 4) | high
    scales = cuda_order_scales(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), 64).numpy()
    assert not np.allclose(emulate(x, codes.view(np.int32), scales), reference(x, packed, bits))


@dataclass(frozen=True)
class TileCase:
    name: str
    tile: CudaTile
    n: int
    k: int
    m: int
    fits: bool


TILE_CASES = [
    TileCase("7168->2048, 4 blocks of 2 K warps", CudaTile(4, 2, 4, 8), 2048, 7168, 16, True),
    TileCase("K not in whole steps per warp", CudaTile(4, 2, 4, 8), 2048, 7104, 16, False),
    TileCase("N not in whole blocks", CudaTile(4, 2, 4, 8), 2000, 7168, 16, False),
    TileCase("cluster over 8", CudaTile(4, 1, 16, 8), 2048, 7168, 16, False),
    TileCase("64 rows of x too large for one block's K slice", CudaTile(4, 2, 2, 8), 4096, 7168, 64, False),
    TileCase("64 rows of x on a shorter slice", CudaTile(4, 2, 8, 8), 4096, 7168, 64, True),
    TileCase("65 rows", CudaTile(4, 2, 8, 8), 4096, 7168, 65, False),
    TileCase("two tiles per warp: 128-row blocks", CudaTile(4, 2, 2, 4, tpw=2), 7168, 2048, 64, True),
    TileCase("two tiles per warp: N not in whole 128-row blocks", CudaTile(4, 2, 2, 4, tpw=2), 4160, 2048, 16, False),
    TileCase("three tiles per warp", CudaTile(1, 2, 2, 4, tpw=3), 2048, 7168, 16, False),
    TileCase("four tiles per warp", CudaTile(1, 4, 2, 4, tpw=4), 7168, 2048, 64, True),
    # 14 steps a warp: a ring of 15 slots x 640 bytes per warp, 76,800 bytes beside x's 116,736 and the partials' 4,096
    TileCase("steps in flight in shared memory", CudaTile(1, 8, 1, 24, ring=True), 2048, 7168, 4, True),
    TileCase("a ring past the shared memory", CudaTile(2, 8, 1, 24, ring=True), 2048, 7168, 4, False),
    TileCase("two blocks per SM", CudaTile(2, 2, 2, 12, ring=True, minb=2), 2048, 7168, 4, True),
    TileCase("two blocks per SM that do not both fit", CudaTile(1, 8, 1, 24, ring=True, minb=2), 2048, 7168, 4, False),
    TileCase("three blocks per SM", CudaTile(2, 2, 2, 12, ring=True, minb=3), 2048, 7168, 4, False),
    TileCase("64 rows of x in a ring of chunks", CudaTile(4, 2, 2, 8, nxr=4), 4096, 7168, 64, True),
    TileCase("a ring of one chunk", CudaTile(4, 2, 2, 8, nxr=1), 4096, 7168, 16, False),
    TileCase("x multicast to 2 blocks along N in clusters of 4", CudaTile(2, 4, 2, 8, xmc=2), 2048, 7168, 16, True),
    TileCase("x multicast: N blocks not in whole clusters", CudaTile(2, 4, 2, 8, xmc=4), 2080, 7168, 16, False),
    TileCase("x multicast: a cluster of 16", CudaTile(2, 4, 2, 8, xmc=8), 2048, 7168, 16, False),
    TileCase("x multicast to 3 blocks", CudaTile(2, 4, 1, 8, xmc=3), 2016, 7168, 16, False),
    TileCase("x multicast with x's ring", CudaTile(2, 4, 1, 8, nxr=2, xmc=2), 2048, 7168, 16, False),
    TileCase("x's rows fitted to M = 1", CudaTile(1, 8, 1, 8, fit_x=True), 2048, 7168, 1, True),
    TileCase("x's rows fitted to M = 4", CudaTile(1, 8, 1, 8, fit_x=True), 2048, 7168, 4, True),
    TileCase("x's rows fitted to M = 5", CudaTile(1, 8, 1, 8, fit_x=True), 2048, 7168, 5, False),
]


@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: c.name)
def test_tile_fits(case):
    assert case.tile.fits(case.n, case.k, case.m) is case.fits


def test_m_tiles_and_defines():
    assert [m_tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert CudaTile(4, 2, 4, 32).defines(7168, 5, True) == dict(NWN=4, TPW=1, NWK=2, CL=4, STEPS=14, MT=1, PF=14, CH=2,
                                                                SF32=1, FOLD=0, RING=0, MINB=1, NXR=0, XMC=1,
                                                                MOE=0, TOPK=1, IDS64=0, OUT_PLANES=0, XROWS=8)
    assert CudaTile(2, 4, 2, 4, tpw=2).rows == 64
    # the ring: PF + 1 slots per warp of 32 lanes x 16 bytes of codes and 8 lane groups x 16 bytes of scales
    plain, ring = CudaTile(1, 8, 1, 24), CudaTile(1, 8, 1, 24, ring=True)
    assert ring.shared_bytes(7168, 4) - plain.shared_bytes(7168, 4) == 8 * 15 * (32 * 16 + 8 * 16)    # 14 steps
    assert ring.shared_bytes(2048, 4) - plain.shared_bytes(2048, 4) == 8 * 5 * (32 * 16 + 8 * 16)   # 4 steps a warp
    # x's ring: 14 steps a warp in chunks of 4 (4 chunks), a ring of 3 of them (or of all 4 where 6 are asked for)
    chunks = CudaTile(1, 8, 1, 8, ch=4, nxr=3)
    assert chunks.defines(7168, 4, False)["NXR"] == 3 and CudaTile(1, 8, 1, 8, ch=4, nxr=6).x_chunks(7168) == 4
    x_whole, x_ring = 8 * 8 * (14 * 64 + 32) * 2, 8 * 3 * 8 * (4 * 64 + 32) * 2    # bytes: 8 K warps x 8 rows
    assert plain.shared_bytes(7168, 4) - chunks.shared_bytes(7168, 4) == x_whole - x_ring
    # x's rows fitted to M (fit_x): 1, 2 or 4 of them, 7, 6 or 4 fewer in each K warp group's slice
    fitted = CudaTile(1, 8, 1, 24, fit_x=True)
    assert [fitted.defines(7168, m, False)["XROWS"] for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert plain.defines(7168, 1, False)["XROWS"] == 8
    assert plain.shared_bytes(7168, 1) - fitted.shared_bytes(7168, 1) == 8 * 7 * (14 * 64 + 32) * 2
    assert plain.shared_bytes(7168, 3) - fitted.shared_bytes(7168, 3) == 8 * 4 * (14 * 64 + 32) * 2
    # x multicast: 8 K warps x 4 chunks of mbarriers (8 bytes each) in one 256-byte run ahead of x
    assert CudaTile(1, 8, 1, 24, ch=4, xmc=2).shared_bytes(7168, 4) - plain.shared_bytes(7168, 4) == 256


@dataclass(frozen=True)
class RefusalCase:
    name: str
    x: torch.Tensor
    tile: CudaTile
    says: str       # what the error names


REFUSALS = [
    RefusalCase("a tile whose cluster does not split K", torch.zeros(2, 1024, dtype=torch.bfloat16),
                CudaTile(1, 4, 8, 8), "does not fit K=1024 N=64 M=2"),
    RefusalCase("65 rows of x", torch.zeros(65, 1024, dtype=torch.bfloat16), CudaTile(1, 4, 1, 8), "M=65"),
    RefusalCase("float16 x", torch.zeros(2, 1024, dtype=torch.float16), CudaTile(1, 4, 1, 8), "torch.float16"),
    RefusalCase("x not contiguous", torch.zeros(1024, 2, dtype=torch.bfloat16).T, CudaTile(1, 4, 1, 8), "contiguous"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.name)
def test_cuda_linear_refuses_before_launching(case):
    """w4a16_cuda_linear checks the call before it reaches the driver (this runs without a GPU): an error naming what
    is wrong, in the project's error tree."""
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaKernelError, w4a16_cuda_linear
    from k2vec.errors import K2VecError
    weight = CudaOrder(torch.zeros(4, 16, 32, 4, dtype=torch.int32), torch.zeros(4, 16, 8, 2, dtype=torch.int32))
    with pytest.raises(CudaKernelError, match=case.says) as raised:
        w4a16_cuda_linear(case.x, weight, 64, 1024, torch.empty(case.x.shape[0], 64, dtype=torch.bfloat16), case.tile)
    assert isinstance(raised.value, K2VecError)


# ---------------------------------------------------------------- on a GPU

@dataclass(frozen=True)
class GpuCase:
    name: str
    m: int
    n: int
    k: int
    tile: CudaTile | None     # None: the committed tables pick (configs.py)
    scales: str = "bfloat16"


GPU_CASES = [
    GpuCase("K2 7168->2048 at M=2, its table", 2, 2048, 7168, None),
    GpuCase("K2 2048->7168 at M=16, its table", 16, 7168, 2048, None),
    GpuCase("K2 7168->4096 at M=5, its table", 5, 4096, 7168, None),
    GpuCase("the fit rule, 9 steps of one warp", 3, 1008, 576, None),
    GpuCase("the fit rule, two m8 tiles", 12, 1024, 512, None),
    GpuCase("the fit rule, float32 scales", 7, 1024, 512, None, "float32"),
    GpuCase("a cluster of 2, x in eight m8 tiles", 64, 1024, 1024, CudaTile(2, 2, 2, 4, ch=1)),
    GpuCase("a cluster of 4, 33 rows", 33, 1024, 1024, CudaTile(4, 1, 4, 2, ch=2)),
    GpuCase("two tiles per warp, 32 rows, a cluster of 2", 32, 1024, 1024, CudaTile(2, 2, 2, 4, ch=2, tpw=2)),
    GpuCase("two tiles per warp, 9 rows, float32 scales", 9, 1024, 1536, CudaTile(1, 4, 2, 8, ch=4, tpw=2),
            "float32"),
    GpuCase("scales folded, four tiles per warp, 32 rows", 32, 2048, 1024,
            CudaTile(2, 2, 2, 4, ch=2, tpw=4, fold=True)),
    GpuCase("scales folded, float32 scales, 20 rows", 20, 1024, 1024, CudaTile(2, 2, 1, 8, ch=4, tpw=2, fold=True),
            "float32"),
    # the ring: refilled (16 steps a warp, 12 in flight), never refilled (8 steps, 12 asked for), x in chunks of 1
    # step (the most cp.async groups pending), two blocks per SM, two tiles per warp in a cluster, folded scales
    GpuCase("ring, 12 of 16 steps in flight, 3 rows", 3, 1024, 2048, CudaTile(2, 2, 1, 12, ch=2, ring=True)),
    GpuCase("ring, all 8 steps in flight, float32 scales", 5, 1024, 1024, CudaTile(2, 2, 1, 12, ch=4, ring=True),
            "float32"),
    GpuCase("ring, x a step at a time, 16 rows", 16, 512, 4096, CudaTile(1, 4, 1, 12, ch=1, ring=True)),
    GpuCase("ring, two blocks per SM", 8, 2048, 2048, CudaTile(2, 2, 1, 24, ch=2, ring=True, minb=2)),
    GpuCase("ring, two tiles per warp, a cluster of 2, 9 rows, float32 scales", 9, 1024, 2048,
            CudaTile(2, 2, 2, 8, ch=2, tpw=2, ring=True), "float32"),
    GpuCase("ring, scales folded, four tiles per warp, 64 rows", 64, 1024, 1024,
            CudaTile(2, 2, 2, 4, ch=2, tpw=4, fold=True, ring=True)),
    # x in a ring of chunks: refilled (16 steps a warp in 8 chunks, 3 slots), with the codes' ring, a chunk a step,
    # a last chunk shorter than the others (14 steps in chunks of 4), 64 rows
    GpuCase("x's ring, 3 of 8 chunks, 6 rows", 6, 1024, 2048, CudaTile(2, 2, 1, 8, ch=2, nxr=3)),
    GpuCase("x's ring with the codes' ring, two blocks per SM", 8, 1024, 2048,
            CudaTile(2, 2, 1, 12, ch=2, ring=True, minb=2, nxr=2)),
    GpuCase("x's ring, a chunk a step, float32 scales, 16 rows", 16, 512, 4096, CudaTile(1, 4, 1, 8, ch=1, nxr=4),
            "float32"),
    GpuCase("x's ring, a short last chunk, a cluster of 2", 12, 512, 3584, CudaTile(1, 2, 2, 12, ch=4, ring=True,
                                                                                   nxr=2)),
    GpuCase("x's ring, 64 rows, scales folded", 64, 1024, 2048, CudaTile(2, 2, 1, 8, ch=2, tpw=2, fold=True, nxr=3)),
    # x multicast along N: to 2 blocks (rows split 8 / 8), to 4 with fewer rows than blocks (some copy nothing), in a
    # cluster that also splits K (the partials' peers at other N places), with the codes' ring, a short last chunk,
    # 64 rows, float32 scales
    GpuCase("x multicast to 2 blocks, 16 rows", 16, 1024, 2048, CudaTile(2, 2, 1, 8, ch=2, xmc=2)),
    GpuCase("x multicast to 4 blocks, 3 rows", 3, 1024, 2048, CudaTile(1, 2, 1, 8, ch=4, xmc=4)),
    GpuCase("x multicast to 2 blocks, a cluster of 2 along K, 9 rows, float32 scales", 9, 1024, 2048,
            CudaTile(2, 2, 2, 8, ch=2, xmc=2), "float32"),
    GpuCase("x multicast with the codes' ring, a short last chunk, 12 rows", 12, 512, 3584,
            CudaTile(1, 2, 2, 12, ch=4, ring=True, xmc=2)),
    GpuCase("x multicast, 64 rows, scales folded, two tiles per warp", 64, 1024, 1024,
            CudaTile(2, 2, 2, 4, ch=2, tpw=2, fold=True, xmc=2)),
    GpuCase("x multicast, one row of x", 1, 2048, 2048, CudaTile(2, 2, 1, 8, ch=2, xmc=4)),
    # x's rows in shared memory fitted to M (fit_x), the other B columns reading them again
    GpuCase("x's one row, two blocks per SM", 1, 2048, 7168, CudaTile(1, 8, 1, 8, ch=4, minb=2, fit_x=True)),
    GpuCase("x's two rows, a cluster of 2, float32 scales", 2, 1024, 2048, CudaTile(2, 4, 2, 8, ch=2, fit_x=True),
            "float32"),
    GpuCase("x's four rows for three, the codes' ring", 3, 1024, 2048, CudaTile(2, 2, 1, 12, ch=2, ring=True,
                                                                                 fit_x=True)),
]


@pytest.fixture
def cuda_calls(monkeypatch):
    """Counts the calls that reach the CUDA kernel (a config's Triton launch would serve the others)."""
    from k2vec.engines.gpu_triton.kernels import w4a16
    calls = []
    real = w4a16.w4a16_cuda_launch

    def counted(*args, **kwargs):
        calls.append(args[5])    # the tile
        return real(*args, **kwargs)
    monkeypatch.setattr(w4a16, "w4a16_cuda_launch", counted)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_cuda_kernel_matches_float64(case, cuda_calls):
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.verify import check_dense
    config = None if case.tile is None else dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True, CUDA=case.tile)
    result = check_dense(case.m, case.n, case.k, 32, case.scales, "bfloat16", device=cuda_device(), config=config)
    assert len(cuda_calls) == 1, "the call did not reach the CUDA kernel"
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("m,flip", [(2, "low"), (16, "high")])
def test_gpu_cuda_kernel_sees_a_flipped_nibble(m, flip, cuda_calls):
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.verify import check_flip_seen
    result = check_flip_seen(m, 1008, 576, flip, device=cuda_device())
    assert len(cuda_calls) == 2      # the clean weight, then the flipped one
    assert result.ok, result


# ---------------------------------------------------------------- which calls reach it

@dataclass(frozen=True)
class DispatchCase:
    name: str
    x: FakeX
    with_copy: bool
    entry_m: int          # the K2 7168 -> 2048 table's entry for this M
    config: dict | None   # in place of the table's entry
    want: CudaTile | str | None    # "fit": fit_tile's pick


DISPATCH = [
    DispatchCase("the table's tile at M = 2", FakeX(2), True, 2, None, CudaTile(1, 8, 1, 8, ch=4)),
    DispatchCase("the table's tile at M = 16", FakeX(16), True, 16, None, CudaTile(2, 4, 2, 8, ch=2)),
    DispatchCase("no CUDA key at M = 32: Triton", FakeX(32), True, 32, None, None),
    DispatchCase("float16 x: Triton", FakeX(2, torch.float16), True, 2, None, None),
    DispatchCase("weight without the copy: Triton", FakeX(2), False, 2, None, None),
    DispatchCase("x not 16-byte aligned: Triton", FakeX(2, ptr=(1 << 20) + 8), True, 2, None, None),
    DispatchCase("x on the CPU: Triton", FakeX(2, is_cuda=False), True, 2, None, None),
    DispatchCase("the fit rule", FakeX(12), True, 0, {"CUDA": "fit"}, "fit"),
    DispatchCase("a tile that does not fit K: Triton", FakeX(2), True, 0, {"CUDA": CudaTile(4, 8, 8, 8)}, None),
]


@pytest.mark.parametrize("case", DISPATCH, ids=lambda c: c.name)
def test_cuda_tile_dispatch(case, monkeypatch):
    from k2vec.engines.gpu_triton.kernels import w4a16
    from k2vec.engines.gpu_triton.kernels.configs import dense_configs, pick_config
    from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import fit_tile
    monkeypatch.setattr(w4a16, "runs_on", lambda index: True)
    monkeypatch.setattr(w4a16, "interpreting", lambda: False)
    copy = CudaOrder(torch.zeros(0), torch.zeros(0)) if case.with_copy else None    # only its presence is read
    weight = PackedInt4(torch.zeros(0), torch.zeros(0), 2048, 7168, 32, None, copy)
    entry = case.config or pick_config(dense_configs(7168, 2048, torch.bfloat16), case.entry_m)
    want = fit_tile(2048, 7168, case.x.rows) if case.want == "fit" else case.want
    assert w4a16.cuda_tile(entry, weight, case.x) == want


# ------------------------------------------------------------------ the CUBIN cache (CPU: a stand-in compiler)

KERNEL = "extern \"C\" __global__ void w4a16_mma() {}\n"
DEFINES = (("NWN", 2), ("MT", 1))


@dataclass(frozen=True)
class CacheCase:
    name: str
    second: dict          # cached_cubin's arguments for the second call (the first: KERNEL, DEFINES, sm_90, v1)
    compiles: int         # compiles over both calls


CACHE_CASES = [
    CacheCase("the same kernel again: loaded", {}, 1),
    CacheCase("other constants", dict(defines=(("NWN", 4), ("MT", 1))), 2),
    CacheCase("another arch", dict(arch="sm_100"), 2),
    CacheCase("another compiler", dict(compiler="nvrtc 13.0"), 2),
    CacheCase("an edited kernel", dict(kernel=KERNEL + "// faster now\n"), 2),
]


class StandIn:
    """A compiler that records its calls and returns bytes that name what it compiled."""

    def __init__(self):
        self.calls = []

    def __call__(self, source, arch):
        self.calls.append((source, arch))
        return f"cubin of {arch}\n{source}".encode()


def cubin(compile, kernel=KERNEL, defines=DEFINES, arch="sm_90", compiler="nvrtc 12.9"):
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import cached_cubin
    return cached_cubin(kernel, defines, arch, compiler, compile)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    from k2vec.engines.gpu_triton.kernels import w4a16_cuda
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    w4a16_cuda._cubin_store.cache_clear()    # each process lists the directory once: a new process here
    yield tmp_path / w4a16_cuda.CUBIN_CACHE
    w4a16_cuda._cubin_store.cache_clear()
    w4a16_cuda._PRUNED.clear()


@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: c.name)
def test_cubin_cache_compiles_what_it_has_not_seen(case, cache_home):
    from k2vec.engines.gpu_triton.kernels import w4a16_cuda
    compile = StandIn()
    cubin(compile)
    w4a16_cuda._cubin_store.cache_clear()    # the second call as another process
    second = cubin(compile, **case.second)
    assert len(compile.calls) == case.compiles
    assert second == StandIn()(*compile.calls[-1])    # what the compiler made of the second call's source
    assert b"#define NWN" in second and second.endswith((case.second.get("kernel") or KERNEL).encode())


def test_cubin_cache_keeps_one_version_of_the_kernel(cache_home):
    compile = StandIn()
    cubin(compile)
    cubin(compile, defines=(("NWN", 4), ("MT", 1)))
    assert len(list(cache_home.glob("*.cubin"))) == 2
    cubin(compile, kernel=KERNEL + "// faster now\n")
    assert len(list(cache_home.glob("*.cubin"))) == 1     # the old kernel's two entries removed


def test_cubin_cache_recompiles_a_damaged_entry(cache_home):
    from k2vec.engines.gpu_triton.kernels import w4a16_cuda
    compile = StandIn()
    good = cubin(compile)
    (entry,) = cache_home.glob("*.cubin")
    entry.write_bytes(good[:-2] + b"!\n")     # same size, other bytes: its name's digest no longer holds
    w4a16_cuda._cubin_store.cache_clear()
    assert cubin(compile) == good and len(compile.calls) == 2


def test_cubin_cache_unwritable_compiles_every_time(tmp_path, monkeypatch):
    from k2vec.engines.gpu_triton.kernels import w4a16_cuda
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    compile = StandIn()
    assert cubin(compile) == cubin(compile) and len(compile.calls) == 2
    assert w4a16_cuda.cache_dir(w4a16_cuda.CUBIN_CACHE) is None


# ------------------------------------------------------------------ compiled by NVRTC on the CPU (no GPU needed)

@dataclass(frozen=True)
class CompileCase:
    name: str
    tile: CudaTile
    k: int
    m: int
    float32_scales: bool


def compile_cases() -> list[CompileCase]:
    """Every tile a committed table names, at its bucket's largest M, both scale dtypes; the fit rule on the default
    models' MLP shapes at 4 and 16 rows; the GPU cases' tiles."""
    from k2vec.config.expand import PRESETS
    from k2vec.engines.gpu_triton.kernels.configs import DENSE_SHAPE_CONFIGS
    from k2vec.engines.gpu_triton.kernels.w4a16_cuda import fit_tile
    cases = []
    for (k, n), table in DENSE_SHAPE_CONFIGS.items():
        for bound, entry in table:
            if isinstance(entry.get("CUDA"), CudaTile):
                cases += [CompileCase(f"{k}->{n} M<={bound} {'f32' if f32 else 'bf16'} scales", entry["CUDA"], k, bound,
                                      f32) for f32 in (False, True)]
    for model in ("tiny", "small"):
        p = PRESETS[model]
        h, inter, moe = p["hidden_size"], p["intermediate_size"], p["moe_intermediate_size"]
        for k, n in ((h, inter), (inter, h), (h, moe), (moe, h)):
            cases += [CompileCase(f"{model} fit {k}->{n} M={m}", fit_tile(n, k, m), k, m, True) for m in (4, 16)]
    cases += [CompileCase(f"GPU case: {c.name}", c.tile, c.k, c.m, c.scales == "float32") for c in GPU_CASES
              if c.tile is not None]
    return cases


@needs_nvrtc
@pytest.mark.parametrize("case", compile_cases(), ids=lambda c: c.name)
def test_kernel_compiles_for_sm90_without_spills(case):
    """The kernel as the engine and the committed tables compile it, checked on any machine: a kernel edit that
    does not compile, or that spills registers to local memory, fails here before it reaches a GPU."""
    out = compile_for_sm90(case.tile, case.k, case.m, case.float32_scales)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.log)]
    # float32 scales hold two more registers per step in flight than the bf16 ones the sweep times; at 512 threads
    # (128 registers a thread) ptxas may spill a few bytes of them (7168->4096's M <= 16 tile: bench/RESULTS.md)
    allowed = 16 if case.float32_scales and case.tile.nwn * case.tile.nwk == 16 else 0
    assert out.cubin and spills and max(spills) <= allowed, out.log


@dataclass(frozen=True)
class WaitCase:
    name: str
    tile: CudaTile
    k: int


WAIT_CASES = [
    WaitCase("14 steps a warp, x in 4 chunks", CudaTile(1, 8, 1, 8, ch=4), 7168),
    WaitCase("16 steps a warp, x in 8 chunks", CudaTile(4, 2, 1, 8, ch=2), 2048),
    WaitCase("56 steps a warp, a chunk a step: waits past 63 clamped", CudaTile(1, 2, 1, 8, ch=1), 7168),
    WaitCase("x in one chunk", CudaTile(2, 4, 1, 8, ch=16), 2048),
    WaitCase("codes' ring, 12 of 14 steps in flight", CudaTile(1, 8, 1, 12, ch=2, ring=True), 7168),
    WaitCase("codes' ring, all steps in flight", CudaTile(1, 8, 1, 24, ch=4, ring=True), 7168),
    WaitCase("codes' ring, 24 of 28, a chunk a step", CudaTile(1, 4, 1, 24, ch=1, ring=True), 7168),
    WaitCase("x's ring of 3 of 7 chunks", CudaTile(1, 8, 1, 8, ch=2, nxr=3), 7168),
    WaitCase("x's ring of 2, the codes' ring", CudaTile(2, 4, 1, 12, ch=2, ring=True, nxr=2), 7168),
    WaitCase("x's ring of 4, a short last chunk, the codes' ring", CudaTile(1, 8, 1, 8, ch=4, ring=True, nxr=4), 7168),
    WaitCase("x's ring of 2, a chunk a step", CudaTile(2, 4, 1, 8, ch=1, nxr=2), 2048),
    WaitCase("x multicast: no cp.async groups", CudaTile(1, 8, 1, 8, ch=4, xmc=2), 7168),
    WaitCase("x multicast, the codes' ring", CudaTile(2, 4, 1, 12, ch=2, ring=True, xmc=2), 7168),
    WaitCase("x multicast, the codes' ring, all steps in flight", CudaTile(1, 8, 1, 24, ch=4, ring=True, xmc=4), 7168),
]


def protocol_waits(tile: CudaTile, k: int) -> list[int]:
    """The copy protocol the kernel's source states, simulated: the cp.async groups in commit order (with `ring`
    steps 0 .. PF - 1 of codes; x's chunks, all of them or the ring's first NXR; then per step s, with `ring` step
    s + PF before the step's wait, and at the start of chunk c >= 1, after the wait, chunk c - 1 + NXR into the
    ring), and at each wait (every step with `ring`, else where a chunk starts) the groups it may leave in flight:
    those committed after the last it needs (the step's codes, its x chunk); cp.async.wait_group takes up to 63. With
    `xmc` x is not among the groups (bulk copies, an mbarrier per chunk): the waits are the codes' ring's alone."""
    d = tile.defines(k, 4, False)
    steps, pf, ch, nxr, ring, multicast = d["STEPS"], d["PF"], d["CH"], d["NXR"], d["RING"], d["XMC"] > 1
    nch = -(-steps // ch)
    groups = [("c", s) for s in range(pf)] if ring else []
    groups += [] if multicast else [("x", c) for c in range(nxr or nch)]
    waits = []
    for s in range(steps):
        c = s // ch
        if ring and s + pf < steps:
            groups.append(("c", s + pf))
        if ring or s % ch == 0 and not multicast:
            need = ({("c", s)} if ring else set()) | (set() if multicast else {("x", c)})
            last = max(i for i, group in enumerate(groups) if group in need)
            waits.append(min(len(groups) - 1 - last, 63))
        if nxr and s % ch == 0 and c >= 1 and c - 1 + nxr < nch:
            groups.append(("x", c - 1 + nxr))
    return waits


@needs_nvrtc
@pytest.mark.parametrize("case", WAIT_CASES, ids=lambda c: c.name)
def test_kernel_waits_for_exactly_the_data_it_reads(case):
    """The cp.async.wait_group counts in the compiled kernel (its PTX, the K loop unrolled) against the protocol: a
    count too high reads codes or x before they land, one too low waits for copies not yet needed."""
    out = compile_for_sm90(case.tile, case.k, 4, False)
    assert [int(n) for n in re.findall(r"cp\.async\.wait_group (\d+);", out.ptx)] == protocol_waits(case.tile, case.k)


@needs_nvrtc
@pytest.mark.parametrize("case", [c for c in WAIT_CASES if c.tile.xmc > 1], ids=lambda c: c.name)
def test_multicast_kernel_waits_once_per_chunk_of_x(case):
    """With x multicast, each chunk of x is waited for on its own mbarrier where the K loop reaches it (one wait per
    chunk in the unrolled loop), and x arrives by multicast bulk copies, not cp.async."""
    out = compile_for_sm90(case.tile, case.k, 4, False)
    d = case.tile.defines(case.k, 4, False)
    assert len(re.findall(r"mbarrier\.try_wait\.parity", out.ptx)) == -(-d["STEPS"] // d["CH"])
    assert "multicast::cluster" in out.ptx
    assert d["RING"] or "cp.async.cg" not in out.ptx     # without the codes' ring no cp.async at all
