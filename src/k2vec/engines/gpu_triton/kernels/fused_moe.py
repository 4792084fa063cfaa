"""Fused MoE W4A16: all tokens of a forward with their top-k experts, two launches plus a combine.

out[m] = sum_j w[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topk_ids[m, j].

Layout (load-time transform, `pack_experts`): the E experts' packed bytes and scales are stacked, gate and
up rows concatenated per expert: w13 uint8 [E, 2I, H/2] (rows 0..I-1 gate, I..2I-1 up), w2 uint8
[E, H, I/2], scales [E, 2I, H/G] and [E, H, I/G]. The bytes are the bundle's own; only their placement
changes (one copy at load). For bf16 activations, a second copy of both in the CUDA kernel's operand order
(w4a16_cuda.gate_up_order_copy, down_order_copy), which a launch reads where its config names a CUDA tile.

Each (token, expert) pair p = m * top_k + j is one row of work. With BLOCK_M == 1 a program takes one pair
straight from `topk_ids` (no sorting: for decode each expert has about one pair). With BLOCK_M >= 16 the
pairs are sorted by expert into blocks of BLOCK_M rows padded per expert (pad id = P), each block having
one expert, so a program loads one weight tile for all its rows; the grid is sized by a bound that depends
only on M, so nothing synchronises with the host (CUDA-graph capturable).

1. gate/up: h[p] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T), t = p // top_k, h in x.dtype ([P, I]).
2. down: y[p] = w[p] * (h[p] @ down_e^T), float32 [P, H].
3. combine: out[m] = sum_j y[m * top_k + j] (a fixed-order sum, deterministic), cast to x.dtype.
Either launch may run on the CUDA kernel instead (bf16, one pair or token per block: moe_cuda_tiles); its down
launch does 2 and 3 in one, each token's pairs side by side along K, summed in j's order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k2vec.engines.gpu_triton.kernels.configs import (
    MOE_CONFIGS,
    MOE_CONFIGS_FP32,
    launch_keys,
    pick_config,
    split_k,
    tile_config,
)
from k2vec.engines.gpu_triton.kernels.int4_layout import _as_tensor, scales_tensor
from k2vec.engines.gpu_triton.kernels.sync import (
    _grid_wait,
    _k_range,
    _split_arrive,
    _split_is_last,
    _split_sum,
    split_buffers,
)
from k2vec.engines.gpu_triton.kernels.w4a16 import _int4_tile, check_activation, cuda_takes, interpreting, to_planes
from k2vec.engines.gpu_triton.kernels.w4a16_cuda import (
    CudaOrder,
    CudaTile,
    down_order_copy,
    gate_up_order_copy,
    supported,
    w4a16_cuda_down,
    w4a16_cuda_gate_up,
)


@dataclass(frozen=True)
class PackedExperts:
    """E experts' gate/up (fused) and down weights, stacked; see the module docstring for the layout."""
    w13: torch.Tensor       # uint8 [E, 2I, H/2]
    s13: torch.Tensor       # float32 | bfloat16 [E, 2I, H/G]
    w2: torch.Tensor        # uint8 [E, H, I/2]
    s2: torch.Tensor        # float32 | bfloat16 [E, H, I/G]
    num_experts: int
    hidden: int
    intermediate: int
    group_size: int
    cuda13: CudaOrder | None = None     # gate/up in the CUDA kernel's operand order (w4a16_cuda.gate_up_order_copy)
    cuda2: CudaOrder | None = None      # down in it (w4a16_cuda.down_order_copy)


def _stack(pairs: Sequence, what: str, scale_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    qws = [_as_tensor(qw) for qw, _ in pairs]
    scs = [scales_tensor(sc, scale_dtype, f"{what}[{e}].sc") for e, (_, sc) in enumerate(pairs)]
    for e, (qw, sc) in enumerate(zip(qws, scs)):
        if qw.dtype != torch.uint8 or qw.shape != qws[0].shape or sc.shape != scs[0].shape:
            raise ValueError(f"{what}[{e}]: expected uint8 .qw {tuple(qws[0].shape)} and .sc {tuple(scs[0].shape)} "
                             f"like expert 0, got {qw.dtype} {tuple(qw.shape)} and {tuple(sc.shape)}")
    return torch.stack(qws), torch.stack(scs)


def pack_experts(gate: Sequence, up: Sequence, down: Sequence, group_size: int, scale_dtype: str,
                 device, cuda_order: bool = False) -> PackedExperts:
    """Stack E experts' bundle weights: each list holds E (qw, sc) pairs as `pack_for_gpu` takes them.

    gate/up: W [I, H] (qw [I, H/2], sc [I, H/G]); down: W [H, I] (qw [H, I/2], sc [H, I/G]). cuda_order: with
    the CUDA kernel's copies (as many bytes again) where its format allows (w4a16_cuda.supported).
    """
    if not (len(gate) == len(up) == len(down) and len(gate) > 0):
        raise ValueError(f"pack_experts: gate/up/down need the same non-zero number of experts, "
                         f"got {len(gate)}/{len(up)}/{len(down)}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"pack_experts: group_size must be 32, 64 or 128, got {group_size}")
    wg, sg = _stack(gate, "gate", scale_dtype)
    wu, su = _stack(up, "up", scale_dtype)
    w2, s2 = _stack(down, "down", scale_dtype)
    e, inter, half_h = wg.shape
    hidden = half_h * 2
    expected = {"gate": (wg.shape, sg.shape), "up": (wu.shape, su.shape), "down": (w2.shape, s2.shape)}
    wanted = {"gate": ((e, inter, hidden // 2), (e, inter, hidden // group_size)),
              "up": ((e, inter, hidden // 2), (e, inter, hidden // group_size)),
              "down": ((e, hidden, inter // 2), (e, hidden, inter // group_size))}
    for what, shapes in expected.items():
        if tuple(map(tuple, shapes)) != wanted[what] or hidden % group_size or inter % group_size:
            raise ValueError(f"pack_experts: {what} .qw/.sc shapes {tuple(map(tuple, shapes))} do not fit "
                             f"hidden {hidden}, intermediate {inter}, group_size {group_size}: want {wanted[what]}")
    w13, s13 = torch.cat([wg, wu], dim=1).to(device).contiguous(), torch.cat([sg, su], dim=1).to(device).contiguous()
    w2, s2 = w2.to(device).contiguous(), s2.to(device).contiguous()
    # (I is a multiple of G, so with G 32 gate and up are whole 16-row tiles each)
    return PackedExperts(w13, s13, w2, s2, e, hidden, inter, group_size,
                         gate_up_order_copy(w13, s13, hidden)
                         if cuda_order and supported(2 * inter, hidden, group_size, s13.dtype) else None,
                         down_order_copy(w2, s2, inter)
                         if cuda_order and supported(hidden, inter, group_size, s2.dtype) else None)


@triton.jit
def _moe_epilogue(acc, up, y_ptr, pairs, row_mask, offs_n, n_mask, route_w_ptr, N, stride_ym,
                  GATED: tl.constexpr, WEIGHTED: tl.constexpr, OUT_PLANES: tl.constexpr):
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if WEIGHTED:
        acc = acc * tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    if OUT_PLANES:
        cols = (offs_n % 8) * (N // 8) + offs_n // 8
    else:
        cols = offs_n
    y_ptrs = y_ptr + pairs[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_kernel(x_ptr, w_ptr, s_ptr, y_ptr, pair_ids_ptr, block_expert_ptr, route_w_ptr, ws_ptr, cnt_ptr,
                num_pairs, N, K, E, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                X_ROW_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, SORTED: tl.constexpr,
                G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, BF16_SCALES: tl.constexpr, IEEE: tl.constexpr,
                X_PLANES: tl.constexpr, SCALE_GROUPS: tl.constexpr, PACKED: tl.constexpr, EVEN_K: tl.constexpr,
                OUT_PLANES: tl.constexpr, COMBINE: tl.constexpr, X_WIDE: tl.constexpr, SPLIT_GU: tl.constexpr,
                PREFETCH: tl.constexpr, CODES_ASM: tl.constexpr, BIASED_CODES: tl.constexpr, PDL: tl.constexpr,
                ROUTED: tl.constexpr):
    """y[p, n] for the pairs p of one block: x row p // X_ROW_DIV; GATED: silu(W[n]) * W[N + n]; WEIGHTED: * w[p].
    OUT_PLANES: y rows written plane-major (column n at (n % 8) * N/8 + n // 8), the next GEMM's X_PLANES input.
    SPLIT_K > 1: K split over the grid's third axis, partials (gate and up apart) reduced as in w4a16.
    COMBINE (down, one pair per program, no split): y is the output [M, N]; the weighted rows of a token's TOP_K
    pairs are summed in j order by the last of them to arrive (the split-K reduction with j as the split).
    SPLIT_GU (GATED): gate and up columns in separate programs (grid axis 0 twice the N tiles), each with half the
    registers of a program doing both; their partials meet in the workspace like split-K partials (2 * SPLIT_K
    arrivals per tile) and the last to arrive sums each in split order and applies SiLU * up.
    ROUTED (the down launch): the routing was complete before the kernel this one follows began (that kernel read
    it after its own wait), so with PDL the expert ids and, on the one-row PREFETCH path, the first K tile's weights
    and scales load before the wait, while that kernel ends; x (h), the route weights and every write after it."""
    if not ROUTED:
        _grid_wait(PDL)     # PDL: the routing and x may come from the kernel just before, so wait before every load
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    if SPLIT_GU:
        half = pid_n // n_tiles     # 0: gate rows, 1: up rows
        pid_n = pid_n % n_tiles
    # block b's expert: from the sorted layout, or (unsorted: one pair per program) pair b's own top-k id
    expert = tl.load(block_expert_ptr + pid_b)
    if expert >= E:     # a spare block of the sorted layout
        return
    if SORTED:
        pairs = tl.load(pair_ids_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < num_pairs
    else:   # pair b in row 0; with BLOCK_M >= 16 (tensor cores) the other rows are masked padding
        pairs = pid_b + tl.zeros([BLOCK_M], dtype=tl.int32)
        row_mask = tl.arange(0, BLOCK_M) == 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    x_rows = pairs // X_ROW_DIV
    kt_lo, kt_hi = _k_range(K, pid_k, SPLIT_K, BLOCK_K)
    if SPLIT_GU:
        w_e += half.to(tl.int64) * N * stride_wn
        s_e += half.to(tl.int64) * N * stride_sn
    acc = _int4_tile(x_ptr, x_rows, row_mask, stride_xm, w_e, stride_wn, s_e, stride_sn, offs_n, n_mask, K,
                     kt_lo, kt_hi, G, BLOCK_M, BLOCK_N, BLOCK_K, BF16_SCALES, IEEE, X_PLANES, SCALE_GROUPS, PACKED,
                     EVEN_K, X_WIDE, PREFETCH, CODES_ASM, BIASED_CODES, False, False, PDL and ROUTED)
    if GATED and not SPLIT_GU:
        up = _int4_tile(x_ptr, x_rows, row_mask, stride_xm, w_e + N * stride_wn, stride_wn,
                        s_e + N * stride_sn, stride_sn, offs_n, n_mask, K, kt_lo, kt_hi,
                        G, BLOCK_M, BLOCK_N, BLOCK_K, BF16_SCALES, IEEE, X_PLANES, SCALE_GROUPS, PACKED,
                        EVEN_K, X_WIDE, PREFETCH, CODES_ASM, BIASED_CODES, False, False, False)
    else:
        up = acc
    if COMBINE:
        acc = acc * tl.load(route_w_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        token = pid_b // TOP_K
        tile = token * n_tiles + pid_n
        mask = row_mask[:, None] & n_mask[None, :]
        _split_arrive(acc, ws_ptr, tile, pid_b % TOP_K, mask, TOP_K, 1, 0, BLOCK_M, BLOCK_N)
        if _split_is_last(cnt_ptr, tile, TOP_K):
            total = _split_sum(ws_ptr, tile, mask, TOP_K, 1, 0, BLOCK_M, BLOCK_N)
            y_ptrs = y_ptr + (token.to(tl.int64) * stride_ym + offs_n)[None, :] + tl.zeros([BLOCK_M, 1], tl.int64)
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile, 0)
    elif SPLIT_K == 1 and not SPLIT_GU:
        _moe_epilogue(acc, up, y_ptr, pairs, row_mask, offs_n, n_mask, route_w_ptr, N, stride_ym,
                      GATED, WEIGHTED, OUT_PLANES)
    else:
        PARTS: tl.constexpr = 2 if GATED else 1
        ARRIVALS: tl.constexpr = 2 * SPLIT_K if SPLIT_GU else SPLIT_K
        tile = pid_b * n_tiles + pid_n
        mask = row_mask[:, None] & n_mask[None, :]
        if SPLIT_GU:
            _split_arrive(acc, ws_ptr, tile, pid_k, mask, SPLIT_K, PARTS, half, BLOCK_M, BLOCK_N)
        else:
            _split_arrive(acc, ws_ptr, tile, pid_k, mask, SPLIT_K, PARTS, 0, BLOCK_M, BLOCK_N)
            if GATED:
                _split_arrive(up, ws_ptr, tile, pid_k, mask, SPLIT_K, PARTS, 1, BLOCK_M, BLOCK_N)
        if _split_is_last(cnt_ptr, tile, ARRIVALS):
            acc = _split_sum(ws_ptr, tile, mask, SPLIT_K, PARTS, 0, BLOCK_M, BLOCK_N)
            if GATED:
                up = _split_sum(ws_ptr, tile, mask, SPLIT_K, PARTS, 1, BLOCK_M, BLOCK_N)
            _moe_epilogue(acc, up, y_ptr, pairs, row_mask, offs_n, n_mask, route_w_ptr, N, stride_ym,
                          GATED, WEIGHTED, OUT_PLANES)
            tl.store(cnt_ptr + tile, 0)


def sort_pairs_by_expert(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids grouped by expert, each expert padded to a multiple of block_m (pad id P), and each block's expert.

    Sized by a bound that depends on P only: sum_e ceil(c_e / B) <= (P + min(E, P) * (B - 1)) / B; blocks past the
    real ones get expert id E (skipped by the kernel). No host synchronisation.
    """
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    # scatter_add, not bincount: CUDA bincount reads the max id back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    order = torch.argsort(flat_ids, stable=True)
    sorted_e = flat_ids[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_e]
    slot = (block_end - blocks)[sorted_e] * block_m + rank
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pair_ids[slot] = order.to(torch.int32)
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    return pair_ids, block_expert.to(torch.int32)


def _launch(x, w, s, y, pair_ids, block_expert, route_w, num_pairs, num_blocks, n, k, num_experts,
            x_row_div, gated, weighted, sorted_, group_size, cfg, out_planes, combine_top_k=0, routed=False):
    """One MoE GEMM launch; combine_top_k > 0: the down launch writes the output rows itself (COMBINE); routed: the
    launch follows the gate/up launch, which read the routing after its own wait (ROUTED)."""
    bf16_scales = s.dtype == torch.bfloat16
    s = s.view(torch.int16) if bf16_scales else s
    w = w.view(torch.int32)     # the packed bytes as words (see w4a16._int4_tile)
    n_tiles = triton.cdiv(n, cfg["BLOCK_N"])
    split_gu = bool(gated and cfg.get("SPLIT_GU"))     # gate and up in separate programs
    halves = 2 if split_gu else 1
    # the split is sized on the pairs (the real work); spare sorted blocks return at once
    splits = 1 if combine_top_k else split_k(cfg, k, halves * n_tiles * min(num_blocks, num_pairs))
    parts = combine_top_k or splits * (2 if gated else 1)
    tiles = n_tiles * (num_pairs // combine_top_k if combine_top_k else num_blocks)
    floats = tiles * parts * cfg["BLOCK_M"] * cfg["BLOCK_N"]
    ws, counters = split_buffers(x.device, tiles, floats if parts > 1 else 1)
    _moe_kernel[(halves * n_tiles, num_blocks, splits)](
        x, w, s, y, pair_ids, block_expert, route_w, ws, counters, num_pairs, n, k, num_experts,
        x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), y.stride(0),
        X_ROW_DIV=x_row_div, GATED=gated, WEIGHTED=weighted, SORTED=sorted_, G=group_size, SPLIT_K=splits,
        TOP_K=max(combine_top_k, 1), COMBINE=combine_top_k > 0, EVEN_K=k % cfg["BLOCK_K"] == 0,
        OUT_PLANES=out_planes, BF16_SCALES=bf16_scales, IEEE=x.dtype == torch.float32, SPLIT_GU=split_gu,
        ROUTED=bool(routed and cfg["PDL"]),
        **launch_keys({key: v for key, v in cfg.items() if key not in ("COMBINE", "SPLIT_GU")}, x.dtype,
                      bf16_scales))


MAX_GRID_Z = 65535     # the CUDA launches' pairs (gate/up) or tokens (down) along the grid's z


def moe_cuda_tiles(entries: tuple[dict, dict], experts: PackedExperts, x: torch.Tensor, out: torch.Tensor,
                   top_k: int) -> tuple[CudaTile | None, CudaTile | None]:
    """The CUDA kernel's tiles for the (gate/up, down) configs' "CUDA" keys, each where the kernel can take that
    launch: x it can read (w4a16.cuda_takes), the launch's CUDA-order copy of the experts, a tile that fits; for the
    down launch a bf16 contiguous `out` too, which it writes; at most MAX_GRID_Z pairs. None: that launch's Triton
    config."""
    if not cuda_takes(x) or x.shape[0] * top_k > MAX_GRID_Z:
        return None, None
    gate_up, down = entries[0].get("CUDA"), entries[1].get("CUDA")
    if gate_up is not None and not (experts.cuda13 is not None
                                    and gate_up.fits_gate_up(2 * experts.intermediate, experts.hidden)):
        gate_up = None
    if down is not None and not (experts.cuda2 is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
                                 and down.fits_down(experts.hidden, experts.intermediate, top_k)):
        down = None
    return gate_up, down


def fused_moe(x: torch.Tensor, experts: PackedExperts, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              out: torch.Tensor | None = None, config: tuple[dict, dict] | None = None) -> torch.Tensor:
    """out [M, H] in x.dtype; routed_scaling_factor is not applied (fold it into topk_weights); topk_ids int64 (as
    torch's topk and sort give them) or int32."""
    check_activation(x, experts.hidden, "fused_moe")
    m, top_k = topk_ids.shape
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [M={x.shape[0]}, k]")
    if out is None:
        out = torch.empty((m, experts.hidden), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x.contiguous()
    flat_ids = topk_ids.reshape(-1)
    if flat_ids.dtype != torch.int64:   # int64 ids (torch's topk and sort) are read as they are: no cast launch
        flat_ids = flat_ids.to(torch.int32)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_pairs = flat_ids.numel()
    cfg13, cfg2 = config or pick_config(MOE_CONFIGS_FP32 if x.dtype == torch.float32 else MOE_CONFIGS, m)
    cuda_named, cuda_pdl = cfg13.get("CUDA") is not None, (cfg13.get("CUDA_PDL", True), cfg2.get("CUDA_PDL", True))
    cuda13, cuda2 = moe_cuda_tiles((cfg13, cfg2), experts, x, out, top_k)
    interpret = interpreting()
    cfg13 = tile_config(cfg13, experts.group_size, interpret, x.device)
    cfg2 = tile_config(cfg2, experts.group_size, interpret, x.device)
    if cfg13.pop("MMA_ORDER") | cfg2.pop("MMA_ORDER") | cfg13.pop("PEEL") | cfg2.pop("PEEL"):
        raise ValueError("fused_moe: MMA_ORDER is a dense tile (the experts keep only the bundle's byte order)")
    if cfg13.pop("SPLIT_REDUCE") | cfg2.pop("SPLIT_REDUCE"):
        raise ValueError("fused_moe: SPLIT_REDUCE is a dense tile's option (the MoE sums its splits itself)")
    sorted_ = cfg13.pop("SORTED", cfg13["BLOCK_M"] > 1)
    if cfg2.pop("SORTED", cfg2["BLOCK_M"] > 1) != sorted_ or (sorted_ and cfg13["BLOCK_M"] != cfg2["BLOCK_M"]):
        raise ValueError("fused_moe: gate/up and down configs must share SORTED and, sorted, BLOCK_M (one layout)")
    if cuda_named and sorted_:
        raise ValueError("fused_moe: the CUDA gate/up launch takes one pair per block (SORTED False)")
    if cfg13["X_PLANES"] and cuda13 is None:
        x = to_planes(x)
    h_planes = cfg2["X_PLANES"] and cuda2 is None     # the CUDA down launch reads h as it is
    block_m = cfg13["BLOCK_M"]
    if not sorted_:
        pair_ids, block_expert, num_blocks = flat_ids, flat_ids, num_pairs
    else:
        pair_ids, block_expert = sort_pairs_by_expert(flat_ids.long(), experts.num_experts, block_m)
        num_blocks = block_expert.numel()
    inter, hidden = experts.intermediate, experts.hidden
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    if cuda13 is not None:
        w4a16_cuda_gate_up(x, experts.cuda13, flat_ids, top_k, 2 * inter, hidden, h, cuda13, h_planes, cuda_pdl[0])
    else:
        _launch(x, experts.w13, experts.s13, h, pair_ids, block_expert, route_w, num_pairs, num_blocks, inter, hidden,
                experts.num_experts, top_k, True, False, sorted_, experts.group_size, cfg13, h_planes)
    if cuda2 is not None:     # each token's pairs summed in the launch, into `out`
        return w4a16_cuda_down(h, experts.cuda2, flat_ids, route_w, top_k, hidden, inter, out, cuda2, cuda_pdl[1])
    if cfg2.get("COMBINE") and not sorted_ and out.dtype == x.dtype and out.stride(1) == 1:
        # the down launch sums each token's pairs into `out` itself
        _launch(h, experts.w2, experts.s2, out, pair_ids, block_expert, route_w, num_pairs, num_blocks, hidden,
                inter, experts.num_experts, 1, False, True, sorted_, experts.group_size, cfg2, False, top_k, True)
        return out
    y = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _launch(h, experts.w2, experts.s2, y, pair_ids, block_expert, route_w, num_pairs, num_blocks, hidden, inter,
            experts.num_experts, 1, False, True, sorted_, experts.group_size, cfg2, False, routed=True)
    torch.sum(y.view(m, top_k, hidden), dim=1, out=out) if out.dtype == torch.float32 else \
        out.copy_(y.view(m, top_k, hidden).sum(dim=1))
    return out
