"""How a W4A16 program waits for others: the PDL grid wait (_grid_wait) and split-K's arrivals and ordered sums.

Split-K (SPLIT_K > 1): a third grid axis splits K so that small-M grids fill the machine. Each program writes its
float32 partial tile to a workspace and bumps an integer counter of its output tile; the program that arrives last
sums the SPLIT_K partials in split order (the same order whichever program is last: deterministic), writes the output
and zeroes the counter for the next launch (CUDA-graph safe). The counters are shared by every launch on the device,
so split-K launches must not run concurrently. SPLIT_REDUCE instead: the programs only write their partials, and a
second launch (_split_reduce_kernel, many programs each summing a few rows of a tile in split order: the same sums)
writes the output, so that no program waits on an arrival and no one program reads a whole tile's partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grid_wait(PDL: tl.constexpr):
    """PDL (programmatic dependent launch, GPU only): wait until the kernel launched before this one has finished
    and its writes are visible, then let the next kernel start launching. Every read of data another kernel
    writes, and every write, comes after this; only the constant weights and scales may be read before it. The
    next kernel is let go only after the wait, so when it starts, everything before this kernel has finished."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _k_range(K, pid_k, SPLIT_K, BLOCK_K: tl.constexpr):
    """K tiles [kt_lo, kt_hi) of split pid_k: the tiles dealt out in contiguous runs (the last runs may be empty)."""
    tiles = tl.cdiv(K, BLOCK_K)
    run = tl.cdiv(tiles, SPLIT_K)
    kt_lo = pid_k * run
    return kt_lo, tl.minimum(kt_lo + run, tiles)


@triton.jit
def _split_arrive(acc, ws_ptr, tile, pid_k, mask, SPLIT_K, PARTS: tl.constexpr,
                  part, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write this split's float32 partial `part` (of PARTS per split) of output tile `tile` to the workspace."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = ws_ptr + (tile.to(tl.int64) * SPLIT_K * PARTS + pid_k * PARTS + part) * (BLOCK_M * BLOCK_N)
    tl.store(base + offs, acc, mask=mask)


@triton.jit
def _split_is_last(cnt_ptr, tile, ARRIVALS):
    """Count this program's arrival at `tile`; true for the last of ARRIVALS, which then resets the counter."""
    tl.debug_barrier()      # every thread's partial is stored before the release below
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return done == ARRIVALS - 1


@triton.jit
def _split_sum(ws_ptr, tile, mask, SPLIT_K: tl.constexpr, PARTS: tl.constexpr, part: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of the SPLIT_K partials `part` of `tile`, in split order (L2 reads: other SMs wrote them). SPLIT_K is
    a compile-time constant so the loop unrolls and the SPLIT_K loads are in flight together (a runtime loop
    waited on each in turn)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return _split_sum_at(ws_ptr, tile, offs, mask, SPLIT_K, PARTS, part, BLOCK_M, BLOCK_N)


@triton.jit
def _split_sum_at(ws_ptr, tile, offs, mask, SPLIT_K: tl.constexpr, PARTS: tl.constexpr, part: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """_split_sum at the tile elements `offs` (row-major within the BLOCK_M x BLOCK_N tile): the whole tile, or the
    rows a program of _split_reduce_kernel sums."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for k in tl.static_range(SPLIT_K):
        base = ws_ptr + (tile.to(tl.int64) * SPLIT_K * PARTS + k * PARTS + part) * (BLOCK_M * BLOCK_N)
        total += tl.load(base + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _split_reduce_kernel(ws_ptr, y_ptr, M, N, stride_ym, n_tiles, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, CHUNK_M: tl.constexpr, PDL: tl.constexpr):
    """SPLIT_REDUCE: rows chunk * CHUNK_M .. of output tile `tile` (pid_m * n_tiles + pid_n, as the GEMM numbers its
    tiles) as the sum of the SPLIT_K float32 partials the GEMM's programs wrote, in split order: _split_sum's sum
    (_split_sum_at)."""
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    _grid_wait(PDL)     # launched as the GEMM's dependent: its partials are written and visible after this
    r = chunk * CHUNK_M + tl.arange(0, CHUNK_M)
    c = tl.arange(0, BLOCK_N)
    rows = (tile // n_tiles) * BLOCK_M + r
    cols = (tile % n_tiles) * BLOCK_N + c
    mask = ((r < BLOCK_M) & (rows < M))[:, None] & (cols < N)[None, :]
    total = _split_sum_at(ws_ptr, tile, r[:, None] * BLOCK_N + c[None, :], mask, SPLIT_K, 1, 0, BLOCK_M, BLOCK_N)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], total.to(y_ptr.dtype.element_ty),
             mask=mask)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_buffers(device, tiles: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 workspace of `floats`, int32 arrival counters for `tiles` tiles, all zero between launches).
    The counters are allocated once per device (keep the first call outside CUDA-graph capture)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return torch.empty(floats, dtype=torch.float32, device=device), counters
