"""Correctness checks of the W4A16 kernels against dequantize-then-matmul in float64.

Shared by the tests (CPU under TRITON_INTERPRET=1, and CUDA) and bench/w4a16.py. Every check draws fresh
random inputs from a seed derived from its own name, fills the output with NaN before the launch, and
reports the relative error ||out - ref|| / ||ref|| (NaN if any element was left unwritten).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from k2vec.engines.gpu_triton.kernels.fused_moe import PackedExperts, fused_moe, pack_experts
from k2vec.engines.gpu_triton.kernels.int4_layout import PackedInt4, pack_for_gpu
from k2vec.engines.gpu_triton.kernels.w4a16 import w4a16_linear
from k2vec.engines.gpu_triton.kernels.w4a16_cuda import gate_up_order_copy
from k2vec.seeds import seed_for

# relative-error bounds per activation dtype: float32 is the golden-matching contract; fp16/bf16 round the
# dequantized weight to the activation dtype before the tensor-core product (2^-11 / 2^-8 per element)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CheckResult:
    name: str
    rel_err: float
    tolerance: float
    all_written: bool

    @property
    def ok(self) -> bool:
        return self.all_written and self.rel_err <= self.tolerance


def generator(device, *name) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed_for("kernel-check", *name) % (1 << 63))


def random_int4(n: int, k: int, group_size: int, scale_dtype: str, gen: torch.Generator, device):
    """(qw uint8 [n, k/2] with all 16 codes, scales [n, k/G] positive, float32 or bfloat16) as a bundle stores them."""
    qw = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=device)
    sc = torch.exp(torch.randn(n, k // group_size, generator=gen, device=device) * 0.5) * 0.02
    return qw, (sc.to(torch.bfloat16) if scale_dtype == "bfloat16" else sc)


def flip_nibble(packed: torch.Tensor, gen: torch.Generator, high: bool) -> tuple[tuple[int, ...], int]:
    """XOR one random element's code with 8 in place (q -> q +- 8); returns (byte index, mask) to undo it."""
    index = tuple(int(torch.randint(0, d, (1,), generator=gen, device=packed.device)) for d in packed.shape)
    mask = 0x80 if high else 0x08
    packed[index] ^= mask
    return index, mask


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def check_dense(m: int, n: int, k: int, group_size: int, scale_dtype: str, act: str, device,
                flip: str | None = None, config: dict | None = None) -> CheckResult:
    """w4a16_linear vs float64; flip 'low'/'high' corrupts one nibble after the reference is taken."""
    name = f"dense m{m} n{n} k{k} g{group_size} {scale_dtype} {act}" + (f" flip-{flip}" if flip else "")
    gen = generator(device, name)
    weight = pack_for_gpu(*random_int4(n, k, group_size, scale_dtype, gen, device), group_size, scale_dtype, device,
                          cuda_order=act == "bfloat16")
    x = torch.randn(m, k, generator=gen, device=device).to(DTYPES[act])
    ref = x.double() @ weight.dequantize().double().T
    if flip:    # a corrupt bundle byte: the load-time copies are made from the corrupt bytes
        flip_nibble(weight.packed, gen, flip == "high")
        weight = weight.recopied()
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=device)
    w4a16_linear(x, weight, out=out, config=config)
    return CheckResult(name, rel_err(out, ref), TOLERANCE[x.dtype], bool(torch.isfinite(out).all()))


def check_flip_seen(m: int, n: int, k: int, flip: str, device) -> CheckResult:
    """A flipped nibble under bf16 activations, where its effect is below check_dense's tolerance: it must move its
    own output column, by (q' - q) * scale * x over the rows (up to the bf16 rounding of both outputs), and leave
    every other column bitwise as it was. rel_err: the moved column's largest deviation from that move, relative to
    the move's largest element (1.0 where another column moved). K2's format, the copies made from the flipped
    bytes."""
    name = f"flip seen m{m} n{n} k{k} {flip}"
    gen = generator(device, name)
    weight = pack_for_gpu(*random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device, cuda_order=True)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    clean = w4a16_linear(x, weight)
    (row, byte), mask = flip_nibble(weight.packed, gen, flip == "high")
    col = 2 * byte + (flip == "high")
    q_new = int(weight.packed[row, byte] >> 4 if flip == "high" else weight.packed[row, byte] & 0x0F)
    flipped = weight.recopied()
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=device)
    w4a16_linear(x, flipped, out=out)
    move = (q_new - (q_new ^ 8)) * weight.scales[row, col // 32].double() * x[:, col].double()
    moved = out[:, row].double() - clean[:, row].double()
    others = torch.ones(n, dtype=torch.bool, device=device)
    others[row] = False
    err = 1.0 if not torch.equal(out[:, others], clean[:, others]) else \
        float((moved - move).abs().max() / move.abs().max())
    return CheckResult(name, err, 0.3, bool(torch.isfinite(out).all()))


def check_split_sums(m: int, n: int, k: int, device, config: dict) -> CheckResult:
    """A split-K config with its partials summed by the last program of each tile and by a second launch
    (SPLIT_REDUCE): the same sums in the same order, so rel_err is 0 when the outputs are bitwise equal, else 1.
    float32 activations, so that the output keeps the sums' last bits (a bfloat16 output rounds most orders alike)."""
    name = f"split sums m{m} n{n} k{k}"
    gen = generator(device, name)
    weight = pack_for_gpu(*random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device)
    x = torch.randn(m, k, generator=gen, device=device)
    last = w4a16_linear(x, weight, config=dict(config, SPLIT_REDUCE=False))
    second = torch.full((m, n), float("nan"), dtype=x.dtype, device=device)
    w4a16_linear(x, weight, out=second, config=dict(config, SPLIT_REDUCE=True))
    return CheckResult(name, 0.0 if torch.equal(last, second) else 1.0, 0.0, bool(torch.isfinite(second).all()))


def random_experts(num_experts: int, hidden: int, inter: int, group_size: int, scale_dtype: str,
                   gen: torch.Generator, device, cuda_order: bool = False) -> PackedExperts:
    def weights(n, k):
        return [random_int4(n, k, group_size, scale_dtype, gen, device) for _ in range(num_experts)]
    return pack_experts(weights(inter, hidden), weights(inter, hidden), weights(hidden, inter),
                        group_size, scale_dtype, device, cuda_order)


def random_routing(m: int, top_k: int, num_experts: int, used_experts: int, gen: torch.Generator, device):
    """top-k distinct experts per token among the first `used_experts` of a random permutation (the rest get
    no token; tokens share experts when m * top_k > used_experts); weights positive, not normalised."""
    pool = torch.randperm(num_experts, generator=gen, device=device)[:used_experts]
    choice = torch.rand(m, used_experts, generator=gen, device=device).argsort(dim=1)[:, :top_k]
    return pool[choice], torch.rand(m, top_k, generator=gen, device=device) + 0.1


def moe_reference(x: torch.Tensor, experts: PackedExperts, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """float64 out [M, H], computing only the experts that are used (vectorised over them)."""
    used, slot = torch.unique(topk_ids, return_inverse=True)
    e, i, h, g = len(used), experts.intermediate, experts.hidden, experts.group_size

    def dequant(packed, scales, n, k):
        return PackedInt4(packed.reshape(e * n, k // 2), scales.reshape(e * n, k // g), e * n, k, g) \
            .dequantize().double().reshape(e, n, k)
    w13 = dequant(experts.w13[used], experts.s13[used], 2 * i, h)
    w2 = dequant(experts.w2[used], experts.s2[used], h, i)
    xd = x.double()
    gate_up = torch.einsum("mh,enh->emn", xd, w13)                 # [E_used, M, 2I]
    act = torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:]
    y = torch.einsum("emi,ehi->emh", act, w2)                      # [E_used, M, H]
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return (y[slot, rows] * topk_weights.double()[..., None]).sum(dim=1)


def check_moe(m: int, num_experts: int, hidden: int, inter: int, top_k: int, used_experts: int, group_size: int,
              scale_dtype: str, act: str, device, flip: str | None = None,
              config: tuple[dict, dict] | None = None, experts: PackedExperts | None = None,
              ids_dtype: str = "int64") -> CheckResult:
    """fused_moe vs float64; flip corrupts one nibble of a used expert's gate/up weight after the reference (in the
    bundle's order and, under bf16, in the CUDA kernel's copy made from it); ids_dtype: the expert ids as torch's
    topk gives them (int64) or as int32."""
    name = (f"moe m{m} e{num_experts} h{hidden} i{inter} top{top_k} used{used_experts} g{group_size} "
            f"{scale_dtype} {act}" + (f" flip-{flip}" if flip else "")
            + ("" if ids_dtype == "int64" else f" {ids_dtype}"))
    gen = generator(device, name)
    if experts is None:     # with the CUDA kernel's copy under bf16, as the engine loads them
        experts = random_experts(num_experts, hidden, inter, group_size, scale_dtype, gen, device, act == "bfloat16")
    ids, weights = random_routing(m, top_k, num_experts, used_experts, gen, device)
    ids = ids.to(getattr(torch, ids_dtype))
    x = torch.randn(m, hidden, generator=gen, device=device).to(DTYPES[act])
    ref = moe_reference(x, experts, ids, weights)
    run = experts
    if flip:
        flipped = experts.w13[int(ids[0, 0])]
        index, mask = flip_nibble(flipped, gen, flip == "high")
        if experts.cuda13 is not None:     # the corrupt bytes as the loader would have copied them
            run = replace(experts, cuda13=gate_up_order_copy(experts.w13, experts.s13, hidden))
    out = torch.full((m, hidden), float("nan"), dtype=x.dtype, device=device)
    try:
        fused_moe(x, run, ids, weights, out=out, config=config)
    finally:
        if flip:    # undo, so a shared `experts` stays clean for the next check
            flipped[index] ^= mask
    return CheckResult(name, rel_err(out, ref), TOLERANCE[x.dtype], bool(torch.isfinite(out).all()))
