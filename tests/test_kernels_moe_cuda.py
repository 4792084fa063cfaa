"""The fused MoE's gate/up launch on the CUDA kernel (MOE): the experts' load-time copy, checked on the CPU against
the model of what the kernel's lanes read and against the kernel's own rule for pairing a gate row with its up row;
which calls reach it; the compiled kernel (waits for the routing before it reads a weight); and on a GPU (marked
`gpu`) fused_moe with a CUDA gate/up tile against float64.
"""
import importlib
import re
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from support.cuda_operands import compile_for_sm90, emulate, needs_nvrtc, reference

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import (CudaKernelError, CudaOrder, CudaTile, GateUp,
                                                         gate_up_order_copy, interleave_gate_up, w4a16_cuda_gate_up)


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


def test_gate_up_defines():
    defines = CudaTile(2, 8, 1, 8, ch=4).defines(7168, 1, False, GateUp(8, True, True))
    assert (defines["MOE"], defines["TOPK"], defines["IDS64"], defines["OUT_PLANES"], defines["MT"]) == (1, 8, 1, 1, 1)
    assert CudaTile(2, 8, 1, 8).defines(7168, 1, False, GateUp(6, False))["IDS64"] == 0


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


# ---------------------------------------------------------------- which calls reach it

@dataclass
class FakeX:
    """What gate_up_cuda_tile reads of an activation tensor, on a pretended CUDA device."""
    dtype: torch.dtype = torch.bfloat16
    ptr: int = 1 << 20
    is_cuda: bool = True

    @property
    def device(self):
        return torch.device("cuda", 0)

    def data_ptr(self):
        return self.ptr


K2_TILE = CudaTile(2, 8, 1, 8, ch=4)


@dataclass(frozen=True)
class DispatchCase:
    name: str
    x: FakeX
    with_copy: bool
    entry: dict
    want: CudaTile | None


DISPATCH = [
    DispatchCase("a gate/up config naming a tile", FakeX(), True, {"CUDA": K2_TILE}, K2_TILE),
    DispatchCase("no CUDA key: Triton", FakeX(), True, {}, None),
    DispatchCase("experts without the copy: Triton", FakeX(), False, {"CUDA": K2_TILE}, None),
    DispatchCase("float16 x: Triton", FakeX(torch.float16), True, {"CUDA": K2_TILE}, None),
    DispatchCase("x not 16-byte aligned: Triton", FakeX(ptr=(1 << 20) + 8), True, {"CUDA": K2_TILE}, None),
    DispatchCase("x on the CPU: Triton", FakeX(is_cuda=False), True, {"CUDA": K2_TILE}, None),
    DispatchCase("a tile that does not fit: Triton", FakeX(), True, {"CUDA": CudaTile(1, 8, 1, 8)}, None),
]


@pytest.mark.parametrize("case", DISPATCH, ids=lambda c: c.name)
def test_gate_up_dispatch(case, monkeypatch):
    fused_moe = importlib.import_module("k2vec.engines.gpu_triton.kernels.fused_moe")   # not the function
    monkeypatch.setattr(fused_moe, "runs_on", lambda index: True)
    monkeypatch.setattr(fused_moe, "interpreting", lambda: False)
    copy = CudaOrder(torch.zeros(0), torch.zeros(0)) if case.with_copy else None    # only its presence is read
    experts = fused_moe.PackedExperts(*[torch.zeros(0)] * 4, 384, 7168, 2048, 32, copy)
    assert fused_moe.gate_up_cuda_tile(case.entry, experts, case.x) == case.want


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
    assert random_experts(2, 128, 32, 32, "bfloat16", gen, "cpu", cuda_order=True).cuda13 is not None
    assert random_experts(2, 128, 64, 64, "bfloat16", gen, "cpu", cuda_order=True).cuda13 is None   # G 64
    assert random_experts(2, 96, 32, 32, "bfloat16", gen, "cpu", cuda_order=True).cuda13 is None    # H 96: K % 64
    assert random_experts(2, 128, 32, 32, "bfloat16", gen, "cpu").cuda13 is None


# ---------------------------------------------------------------- compiled (NVRTC, no GPU)

@dataclass(frozen=True)
class CompileCase:
    name: str
    tile: CudaTile
    gate_up: GateUp
    float32_scales: bool = False


COMPILE_CASES = [
    CompileCase("K2 experts, int64 ids", K2_TILE, GateUp(8, True)),
    CompileCase("int32 ids, h plane-major, float32 scales", K2_TILE, GateUp(8, False, True), True),
    CompileCase("a cluster of 2", CudaTile(2, 4, 2, 8, ch=2), GateUp(8, True)),
    CompileCase("the codes' ring", CudaTile(4, 2, 1, 12, ch=4, ring=True), GateUp(8, True)),
    CompileCase("x's ring", CudaTile(2, 4, 1, 8, ch=2, nxr=2), GateUp(8, True)),
]


@needs_nvrtc
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: c.name)
def test_gate_up_kernel_compiles_without_spills_and_waits_for_the_routing(case):
    """The gate/up kernel compiles for sm_90 without spilling, and reads nothing from global memory (the routing, then
    the weight it picks) before griddepcontrol.wait: the router's kernel, which it may overlap (PDL), writes the ids.
    The dense kernel, by contrast, loads its weights before the wait."""
    out = compile_for_sm90(case.tile, 7168, 1, case.float32_scales, case.gate_up)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", out.log)]
    assert out.cubin and spills and max(spills) == 0, out.log
    assert out.ptx.count("griddepcontrol.wait") == 1
    assert out.ptx.index("griddepcontrol.wait") < first_global_read(out.ptx)
    dense = compile_for_sm90(case.tile, 7168, 1, case.float32_scales).ptx
    assert first_global_read(dense) < dense.index("griddepcontrol.wait")


def first_global_read(ptx: str) -> int:
    """Where the PTX first reads global memory: a load, or an asynchronous copy to shared memory."""
    return re.search(r"ld\.global|cp\.async\.c[ag]\.shared\.global", ptx).start()


# ---------------------------------------------------------------- on a GPU

@dataclass(frozen=True)
class GpuCase:
    name: str
    m: int
    tile: CudaTile
    down: dict              # the down launch's config (X_PLANES: h written plane-major by the gate/up kernel)
    scales: str = "bfloat16"
    ids: str = "int64"


ROW = dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_WIDE=True, SCALE_GROUPS=True)
GPU_CASES = [
    GpuCase("one token, the down launch summing its pairs", 1, CudaTile(2, 4, 1, 8, ch=2), dict(ROW, COMBINE=True)),
    GpuCase("5 tokens, int32 ids", 5, CudaTile(2, 4, 1, 8, ch=2), ROW, ids="int32"),
    GpuCase("16 tokens, a cluster of 2, float32 scales", 16, CudaTile(2, 2, 2, 8, ch=2), ROW, "float32"),
    GpuCase("3 tokens, h plane-major for the down launch", 3, CudaTile(4, 2, 1, 8, ch=4),
            dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SCALE_GROUPS=True)),
    GpuCase("8 tokens, two tiles per warp, the codes' ring", 8, CudaTile(1, 4, 1, 12, ch=2, tpw=2, ring=True), ROW),
    GpuCase("2 tokens, x's ring", 2, CudaTile(2, 4, 1, 8, ch=2, nxr=2), ROW),
]


@pytest.fixture
def gate_up_calls(monkeypatch):
    """Counts the launches that reach the CUDA gate/up kernel."""
    fused_moe = importlib.import_module("k2vec.engines.gpu_triton.kernels.fused_moe")
    calls = []
    real = fused_moe.w4a16_cuda_gate_up

    def counted(*args, **kwargs):
        calls.append(args[7])    # the tile
        return real(*args, **kwargs)
    monkeypatch.setattr(fused_moe, "w4a16_cuda_gate_up", counted)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_gate_up_matches_float64(case, gate_up_calls):
    """fused_moe with the gate/up launch on the CUDA kernel against float64: 12 experts of hidden 1024 and
    intermediate 256 (2 tile pairs per 64-row block), top-6 among 10 used, so that tokens share experts."""
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.verify import check_moe
    config = (dict(ROW, CUDA=case.tile), case.down)
    result = check_moe(case.m, 12, 1024, 256, 6, 10, 32, case.scales, "bfloat16", device=cuda_device(),
                       config=config, ids_dtype=case.ids)
    assert gate_up_calls == [case.tile], "the call did not reach the CUDA kernel"
    assert result.ok, result


@pytest.mark.gpu
@pytest.mark.parametrize("flip", ["low", "high"])
def test_gpu_gate_up_sees_a_flipped_nibble_in_its_own_column(flip):
    """A flipped nibble of a routed expert's gate or up row (q -> q +- 8, below the bf16 tolerance of a whole MoE
    output) moves h's column of that row in that expert's pairs, by what float64 says (up to bf16 rounding), and
    leaves every other element of h bitwise as it was."""
    from support.kernel_checks import cuda_device

    from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4
    from k2vec.engines.gpu_triton.kernels.verify import flip_nibble, generator, random_experts, random_routing
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
    before, clean = h64(e), h_of(experts.cuda13)
    (row, _), _ = flip_nibble(experts.w13[e], gen, flip == "high")
    after, flipped = h64(e), h_of(gate_up_order_copy(experts.w13, experts.s13, hidden))
    col, pairs = row % inter, (ids == e).nonzero().ravel()
    tokens = pairs // 6
    move = (after - before)[tokens, col]
    moved = flipped[pairs, col].double() - clean[pairs, col].double()
    rounding = 2 ** -7 * (before[tokens, col].abs() + after[tokens, col].abs())
    assert (move.abs() > 4 * rounding).any(), "pick another seed: the flip moves h by no more than bf16 rounding"
    assert ((moved - move).abs() <= 0.3 * move.abs() + rounding).all(), (moved, move)
    others = torch.ones_like(clean, dtype=torch.bool)
    others[pairs, col] = False
    assert torch.equal(flipped[others], clean[others])
