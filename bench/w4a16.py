"""W4A16 Triton kernels on the GPU: correctness grid, timings on Kimi K2 shapes next to anchors, config sweep.

One call does everything (device time is scarce):
  * correctness (a pool of processes on the last GPU): every M in {1,2,4,8,16,32,64}, dense and fused MoE,
    G 32/64/128, float32 and bfloat16 scales, shapes that are not tile multiples, float32 activations
    (rel. err <= 1e-5 vs float64 dequantize-then-matmul) and bfloat16 (<= 1.6e-2); fresh inputs per check,
    NaN-poisoned outputs, nibble flips that must be detected; plus the dense K2 shapes and the K2 MoE at M=1;
  * timings on GPU 0, bfloat16 activations, G 32, bfloat16 scales (K2's checkpoint format): dense
    K=7168->N=2048, K=2048->N=7168, K=7168->N=4096; fused MoE over 8 routed experts of a K2 layer with 384
    experts resident (hidden 7168, intermediate 2048); anchors in the same run: torch bf16 matmul (cuBLAS),
    torch int4 weight-only matmul, a plain read of the same number of bytes, a device-to-device copy.
    Every timing is a CUDA graph of R calls over R different weight copies / routings (>= 4x L2 in total, so
    each call reads cold), median of replays, divided by R;
  * --sweep: Triton tile configs per M bucket (compiled ahead by the pool, timed on GPU 0); the tables it writes
    keep the committed CUDA keys (the CUDA tiles are --cuda-sweep's).

    python3 bench/w4a16.py --out DIR [--sweep] [--skip-correctness]
    python3 bench/w4a16.py --out DIR --trips    # the dense tiles against K trips per program (split, stages)
    python3 bench/w4a16.py --out DIR --cuda-sweep [--ms 8,16] [--experimental]   # the CUDA kernel's tiles on the K2
                                      # shapes (or only those of options no table uses), beside the committed call
                                      # and bf16 cuBLAS; writes DIR/configs.json with the winners (dense_cuda_tables)
    python3 bench/w4a16.py --out DIR --configs A/configs.json B/configs.json   # measure with the sweeps' tables
    python3 bench/w4a16.py --out DIR --moe-cuda-sweep [--ms 1,16]   # the MoE's gate/up and down launches on the
                                      # CUDA kernel's tiles, beside the committed configs and a plain read; writes
                                      # DIR/configs.json with the winners (moe_cuda_table), for --configs
    TRITON_INTERPRET=1 python bench/w4a16.py --out DIR --smoke     # CPU plumbing check on tiny shapes
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k2vec.engines.gpu_triton.kernels import fused_moe, pack_for_gpu, w4a16_linear  # noqa: E402
from k2vec.engines.gpu_triton.kernels import verify  # noqa: E402
from k2vec.engines.gpu_triton.kernels.configs import (  # noqa: E402
    CUDA_KEYS,
    DENSE_CONFIGS,
    DENSE_SHAPE_CONFIGS,
    MOE_CONFIGS,
    dense_configs,
    pick_config,
)
from k2vec.engines.gpu_triton.kernels.fused_moe import PackedExperts, moe_cuda_tiles  # noqa: E402
from k2vec.engines.gpu_triton.kernels import w4a16_cuda  # noqa: E402
from k2vec.engines.gpu_triton.kernels.w4a16 import cuda_tile  # noqa: E402
from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaTile, m_tiles  # noqa: E402

MS = (1, 2, 4, 8, 16, 32, 64)
GROUPS = (32, 64, 128)
SCALES = ("float32", "bfloat16")
DENSE_SHAPES = ((7168, 2048), (2048, 7168), (7168, 4096))     # (K, N)
HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 384, 8
L2_BYTES = 62_914_560


# ---------------------------------------------------------------- correctness (pool workers)

def correctness_jobs(smoke: bool) -> list[tuple[str, list, dict]]:
    ms = (1, 3, 16) if smoke else MS
    jobs = []
    for m in ms:
        for g in GROUPS:
            for sd in SCALES:
                for act in (("float32",) if smoke else ("float32", "bfloat16")):
                    n, k = (37, 3 * g) if smoke else (1000, 18 * g)
                    jobs.append(("check_dense", [m, n, k, g, sd, act], {}))
                    e, h, i = (8, 3 * g, g) if smoke else (40, 9 * g, 5 * g)
                    jobs.append(("check_moe", [m, e, h, i, 3 if smoke else 8, 6 if smoke else 30, g, sd, act], {}))
    for m in ((1, 16) if smoke else (1, 16, 64)):
        for flip in ("low", "high"):
            jobs.append(("check_dense", [m, 37 if smoke else 1000, 96 if smoke else 576, 32, "float32", "float32"],
                         {"flip": flip}))
            jobs.append(("check_moe", [m, 8, 96, 32, 3, 6, 32, "float32", "float32"] if smoke else
                         [m, 40, 288, 160, 8, 30, 32, "float32", "float32"], {"flip": flip}))
    # split-K on every tile path, K = 18G not a multiple of the split (empty last splits), N = 1000 (partial tiles)
    for cfg in split_configs():
        for m in ((1, 3) if smoke else (1, 3, 16, 64)):
            for act in ("float32", "float16" if smoke else "bfloat16"):    # the interpreter mishandles bf16
                n, k = (37, 9 * 32) if smoke else (1000, 18 * 32)
                if not isinstance(cfg, tuple):
                    jobs.append(("check_dense", [m, n, k, 32, "bfloat16", act], {"config": cfg}))
                else:
                    jobs.append(("check_moe", [m, 8, 18 * 32, 5 * 32, 3, 6, 32, "bfloat16", act], {"config": cfg}))
    if not smoke:   # the CUDA kernel: the generic rule ("fit") on N % 16 = 0, K % 64 = 0 (9 and 8 steps of 64), its
        # own tiles (clusters of 2 and 4, x rows in 1-8 m8 tiles), both scale dtypes, and nibble flips; bf16 x
        for m in MS:
            for (n, k), sd in itertools.product(((1008, 576), (1024, 512)), SCALES):
                jobs.append(("check_dense", [m, n, k, 32, sd, "bfloat16"], {}))
            for tile, sd in itertools.product(cuda_check_tiles(), SCALES):
                jobs.append(("check_dense", [m, 1024, 1024, 32, sd, "bfloat16"],
                             {"config": dict(mma_tile(16, 64, 4, 0), CUDA=tile)}))
        for m in (2, 16):
            for flip in ("low", "high"):
                jobs.append(("check_flip_seen", [m, 1008, 576, flip], {}))
    if not smoke:   # the real K2 shapes (their own tables, DENSE_SHAPE_CONFIGS), float32 and bf16 activations
        for k, n in DENSE_SHAPES:
            for m in MS:
                for act in ("float32", "bfloat16"):
                    jobs.append(("check_dense", [m, n, k, 32, "bfloat16", act], {}))
        for m in (1, 2):
            jobs.append(("check_moe", [m, 16, HIDDEN, INTER, TOP_K, 16, 32, "bfloat16", "float32"], {}))
            jobs.append(("check_moe", [m, 16, HIDDEN, INTER, TOP_K, 16, 32, "bfloat16", "bfloat16"], {}))
    return jobs


def cuda_check_tiles() -> list:
    return [CudaTile(2, 2, 2, 4, ch=1), CudaTile(4, 1, 4, 2, ch=2), CudaTile(1, 4, 1, 8, ch=4)]


def split_configs() -> list:
    """Explicit split-K configs for the correctness grid: dense (dicts) and MoE ((gate/up, down) pairs)."""
    tc = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, X_PLANES=True, SPLIT_K=4)
    pair = dict(tc, SORTED=False)
    wide = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, X_WIDE=True, SPLIT_K=4)     # natural-order x
    wpair = dict(wide, SORTED=False)
    # one-row GEMV with natural-order x and the next K tile prefetched; K = 18 * 32 = 4.5 tiles of 128
    row = dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, SPLIT_K=2)
    return [tc, dict(tc, PACKED=False), dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, X_PLANES=True, SCALE_GROUPS=True,
                                             SPLIT_K=3),
            (pair, pair), (dict(tc, SORTED=True), dict(tc, SORTED=True, SPLIT_K=2)),
            (pair, dict(pair, SPLIT_K=1, COMBINE=True)),
            wide, dict(wide, PACKED=False),
            dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, X_WIDE=True, SCALE_GROUPS=True, SPLIT_K=3),
            row, dict(row, SPLIT_K=3),
            (dict(wpair, SPLIT_GU=True), dict(wpair, SPLIT_K=1, COMBINE=True)),
            (dict(pair, SPLIT_GU=True), dict(pair, SPLIT_K=1, COMBINE=True)),
            (dict(pair, SPLIT_GU=True, SPLIT_K=1), pair),
            (dict(tc, SORTED=True, SPLIT_GU=True), dict(tc, SORTED=True, SPLIT_K=2)),
            (dict(row, SORTED=False, SPLIT_GU=True), dict(row, SORTED=False, SPLIT_K=1, COMBINE=True)),
            (dict(row, SORTED=False, SPLIT_GU=True, SPLIT_K=1), dict(pair, SPLIT_K=1)),
            dict(row, CODES_ASM=True), dict(row, CODES_ASM=True, SPLIT_K=1),     # GPU only (inline PTX)
            (dict(row, SORTED=False, SPLIT_GU=True, CODES_ASM=True),
             dict(row, SORTED=False, SPLIT_K=1, COMBINE=True, CODES_ASM=True)),
            # biased codes (1 + u/128, one correction per group): shift/mask and prmt
            dict(row, BIASED_CODES=True), dict(row, BIASED_CODES=True, CODES_ASM=True, SPLIT_K=3),
            dict(row, BIASED_CODES=True, CODES_ASM=True, SPLIT_K=1),
            (dict(row, SORTED=False, SPLIT_GU=True, BIASED_CODES=True, CODES_ASM=True),
             dict(row, SORTED=False, SPLIT_K=1, COMBINE=True, BIASED_CODES=True, CODES_ASM=True)),
            (dict(row, SORTED=False, SPLIT_GU=True, BIASED_CODES=True),
             dict(row, SORTED=False, BIASED_CODES=True)),
            # launched with PDL (GPU only): the one-row GEMV's weights before the wait, a tensor-core tile, MoE
            dict(row, BIASED_CODES=True, CODES_ASM=True, PDL=True), dict(tc, PDL=True),
            (dict(row, SORTED=False, SPLIT_GU=True, BIASED_CODES=True, PDL=True),
             dict(row, SORTED=False, COMBINE=True, SPLIT_K=1, BIASED_CODES=True, PDL=True)),
            (dict(tc, SORTED=True, SPLIT_GU=True, PDL=True), dict(tc, SORTED=True, PDL=True)),
            # the down launch with PDL loads its expert ids (and, one-row, its first weight tile) before the wait
            # (ROUTED): without COMBINE, split, and after a gate/up launch without PDL
            (dict(row, SORTED=False, SPLIT_GU=True, BIASED_CODES=True, CODES_ASM=True, PDL=True),
             dict(row, SORTED=False, SPLIT_K=1, BIASED_CODES=True, CODES_ASM=True, PDL=True)),
            (dict(row, SORTED=False, SPLIT_GU=True, BIASED_CODES=True, CODES_ASM=True),
             dict(row, SORTED=False, SPLIT_K=2, BIASED_CODES=True, CODES_ASM=True, PDL=True)),
            # the weight's MMA-order words (K = 576: 4.5 blocks of 128, the last padded), unsplit, split, 8 warps, PDL
            mma_tile(16, 64, 4, 0, SPLIT_K=4), mma_tile(16, 64, 4, 0, SPLIT_K=1, PACKED=False),
            mma_tile(16, 128, 8, 0, SPLIT_K=3, PDL=True), mma_tile(64, 128, 8, 0, SPLIT_K=2),
            mma_tile(32, 64, 4, 0, stages=5, SPLIT_K=1),
            # the MoE's expert-sorted tiles on natural-order x: gate and up apart, the down launch split, with PDL
            (dict(wide, SORTED=True, SPLIT_GU=True), dict(wide, SORTED=True, SPLIT_K=2, PDL=True))]


def _worker_init(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def install_configs(dense, moe, dense_shapes=None) -> None:
    """Replace the kernels' per-M config tables (in this process) with the given ones; dense_shapes: {"KxN": per-M
    table}, the per-shape tables (DENSE_SHAPE_CONFIGS) in place of the committed ones."""
    if dense:
        DENSE_CONFIGS[:] = [(bound, config_from_json(cfg)) for bound, cfg in dense]
    if moe:
        MOE_CONFIGS[:] = [(bound, tuple(config_from_json(c) for c in cfg)) for bound, cfg in moe]
    if dense_shapes is not None:
        DENSE_SHAPE_CONFIGS.clear()
        DENSE_SHAPE_CONFIGS.update({tuple(map(int, key.split("x"))): [(bound, config_from_json(cfg))
                                                                      for bound, cfg in table]
                                    for key, table in dense_shapes.items()})


def load_tables(paths: list[Path]) -> list:
    """The [dense, MoE, dense per shape] tables of configs.json files (None: the committed one), a later file's table
    over an earlier one's: a dense sweep's file and a MoE sweep's measured together."""
    tables = [None, None, None]
    for path in paths:
        saved = json.loads(path.read_text())
        given = [saved["dense_table"], saved["moe_table"], saved.get("dense_shape_table")]
        tables = [new if new is not None else old for old, new in zip(tables, given)]
    return tables


def _run_check(job) -> dict:
    fn, args, kwargs, tables = job
    install_configs(*tables)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    try:
        result = getattr(verify, fn)(*args, device=device, **kwargs)
        row = {**asdict(result), "ok": result.ok}
    except Exception as exc:      # a compile or launch failure is a result to report, not a crash
        row = {"name": f"{fn} {args} {kwargs}", "error": f"{type(exc).__name__}: {exc}", "ok": False,
               "trace": traceback.format_exc()[-2000:]}
    row["flip"] = kwargs.get("flip")
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _warm(job) -> str:
    """Compile one sweep candidate on this worker's GPU so the timing process finds it in Triton's disk cache."""
    kind, m, cfg = job
    device = torch.device(f"cuda:{torch.cuda.current_device()}")
    try:
        gen = verify.generator(device, "warm")
        if kind == "dense":     # every shape: the split (a specialisation when 1) depends on it
            for k, n in DENSE_SHAPES:
                w = pack_for_gpu(*verify.random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device)
                w4a16_linear(torch.randn(m, k, device=device, dtype=torch.bfloat16), w, config=cfg)
        else:
            experts = verify.random_experts(16, HIDDEN, INTER, 32, "bfloat16", gen, device)
            ids, wts = verify.random_routing(m, TOP_K, 16, 16, gen, device)
            fused_moe(torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16), experts, ids, wts, config=cfg)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


# ---------------------------------------------------------------- timing helpers

def graph_time_us(calls, batches: int = 5, replays: int = 4, min_calls: int = 16) -> float:
    """µs per call: a CUDA graph runs `calls` in order (cycled to at least min_calls), replayed back to back;
    median over batches. Each call reads different data, so with >= 4x L2 in rotation every call reads cold."""
    calls = [calls[i % len(calls)] for i in range(max(min_calls, len(calls)))]
    for call in calls[:len(set(map(id, calls)))]:      # compile / warm up outside the graph
        call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * len(calls)))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """How many distinct copies make R calls read >= 4x the L2 in total (at least 2, at most 64)."""
    return max(2, min(64, -(-4 * L2_BYTES // max(nbytes, 1))))


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """Plain read: sums BLOCK int32 words per program (stored, so the loads are not removed)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(words, axis=0))


def plain_read_us(nbytes: int, device) -> float:
    """A cold read of `nbytes` (as int32 words) by one Triton kernel, rotated over copies, in a CUDA graph."""
    words = -(-nbytes // 4)
    r = copies_for(nbytes)
    buf = torch.randint(-2**31, 2**31 - 1, (r, words), dtype=torch.int32, device=device)
    block = 4096
    out = torch.empty(r, triton.cdiv(words, block), dtype=torch.int32, device=device)
    calls = [lambda i=i: _read_kernel[(triton.cdiv(words, block),)](buf[i], out[i], words, BLOCK=block,
                                                                         num_warps=8) for i in range(r)]
    return graph_time_us(calls)


def copy_gbps(device, nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], min_calls=4)
    return 2 * nbytes / us / 1e3


def torch_int4_calls(x_list, w_list, group: int):
    """torch's int4 weight-only matmul on the same INT4 codes (its own tile layout); None where it refuses."""
    try:
        packed, szs = [], []
        for w in w_list:
            # torch wants even k in the high nibble: swap nibbles (a layout difference only)
            swapped = ((w.packed & 0x0F) << 4) | (w.packed >> 4)
            packed.append(torch._convert_weight_to_int4pack(swapped.contiguous(), 8))
            scales = w.scales.to(torch.bfloat16).t().contiguous()                       # [K/G, N]
            szs.append(torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous())  # zero 0: (q-8)*s
        calls = [lambda x=x, p=p, s=s: torch._weight_int4pack_mm(x, p, group, s)
                 for x, p, s in zip(x_list, packed, szs)]
        calls[0]()
        return calls
    except Exception as exc:
        print(f"  torch int4 matmul unavailable: {type(exc).__name__}: {str(exc)[:200]}")
        return None


# ---------------------------------------------------------------- timings

def dense_weights(device, k: int, n: int, name: str) -> tuple[list, int]:
    """Random K -> N weights in K2's format (G 32, bfloat16 scales), as many copies as a graph of calls needs to read
    cold (copies_for), and the bytes each holds."""
    gen = verify.generator(device, name, k, n)
    one = pack_for_gpu(*verify.random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device, cuda_order=True)
    nbytes = one.packed.numel() + one.scales.numel() * 2
    return [one] + [pack_for_gpu(*verify.random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device,
                                 cuda_order=True)
                    for _ in range(copies_for(nbytes) - 1)], nbytes


def committed_us(xs, weights, outs) -> float:
    """µs per call of w4a16_linear on the committed tables (whichever kernel they pick)."""
    return graph_time_us([lambda x=x, w=w, o=o: w4a16_linear(x, w, out=o) for x, w, o in zip(xs, weights, outs)])


def bf16_us(xs, w_bf16) -> float:
    """µs per call of the bf16 anchor: torch's linear (cuBLAS) on the same shape, over copies read cold."""
    return graph_time_us([lambda x=x, w=w: torch.nn.functional.linear(x, w) for x, w in zip(xs, w_bf16)])


def time_dense(device, log) -> list[dict]:
    rows = []
    for k, n in DENSE_SHAPES:
        weights, nbytes = dense_weights(device, k, n, "bench dense")
        r = len(weights)
        read = plain_read_us(nbytes, device)
        w_bf16 = [w.dequantize().to(torch.bfloat16) for w in weights[:copies_for(n * k * 2)]]
        for m in MS:
            xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(r)]
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(r)]
            ours = committed_us(xs, weights, outs)
            bf16 = bf16_us(xs, w_bf16)
            int4_calls = torch_int4_calls(xs, weights, 32)
            int4 = graph_time_us(int4_calls) if int4_calls else None
            entry = pick_config(dense_configs(k, n, torch.bfloat16), m)
            row = dict(k=k, n=n, m=m, ours_us=ours, bf16_us=bf16, torch_int4_us=int4, read_us=read,
                       weight_bytes=nbytes, gbps=nbytes / ours / 1e3, read_frac=read / ours,
                       speedup_bf16=bf16 / ours, speedup_int4=(int4 / ours) if int4 else None,
                       kernel="CUDA" if cuda_tile(entry, weights[0], xs[0]) else "Triton", config=entry)
            rows.append(row)
            int4_text = "n/a" if int4 is None else f"{int4:.1f} us ({row['speedup_int4']:.2f}x)"
            log(f"dense K={k} N={n} M={m}: ours {ours:.1f} us ({row['gbps']:.0f} GB/s, {row['read_frac']:.0%} of "
                f"read {read:.1f} us) bf16 {bf16:.1f} us ({row['speedup_bf16']:.2f}x) int4 {int4_text}")
        del weights, w_bf16
    return rows


class K2Layer:
    """384 experts of one K2 MoE layer resident: INT4 (G 32, bf16 scales) and, for the baseline, bf16."""

    def __init__(self, device, with_bf16: bool = True, cuda_order: bool = True):
        gen = verify.generator(device, "bench moe")
        e, h, i = EXPERTS, HIDDEN, INTER
        w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen, device=device)
        s13 = (torch.rand(e, 2 * i, h // 32, generator=gen, device=device) * 0.01 + 0.005).to(torch.bfloat16)
        self.experts = PackedExperts(
            w13, s13, torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=gen, device=device),
            (torch.rand(e, h, i // 32, generator=gen, device=device) * 0.01 + 0.005).to(torch.bfloat16),
            e, h, i, 32)
        if cuda_order:     # the CUDA kernel's copies, as pack_experts makes them for the engine under bf16
            self.experts = dataclasses.replace(
                self.experts, cuda13=w4a16_cuda.gate_up_order_copy(w13, s13, h),
                cuda2=w4a16_cuda.down_order_copy(self.experts.w2, self.experts.s2, i))
        # bf16 weights of the same shapes (random values: timing only)
        if with_bf16:
            self.w13_bf16 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16)
            self.w2_bf16 = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16)
        self.gen = gen
        self.expert_bytes = (2 * i * h // 2 + h * i // 2) + 2 * (2 * i * h // 32 + h * i // 32)

    def routing(self, m: int):
        ids, w = verify.random_routing(m, TOP_K, EXPERTS, EXPERTS, self.gen, self.experts.w13.device)
        return ids, w

    def bf16_call(self, x, ids, w):
        """The same work in bf16: per used expert, its tokens through gate/up, SiLU*mul, down, weighted sum.
        Grouping is done on the host at capture time (free for the baseline); the graph holds only GPU work."""
        ids_cpu = ids.cpu()
        groups = []
        for e in torch.unique(ids_cpu).tolist():
            rows, slots = (ids_cpu == e).nonzero(as_tuple=True)
            groups.append((e, rows.to(x.device), slots.to(x.device)))
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)

        def call():
            out.zero_()
            for e, rows, slots in groups:
                gu = x[rows] @ self.w13_bf16[e].t()
                act = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
                y = (act @ self.w2_bf16[e].t()).float() * w[rows, slots, None]
                out.index_add_(0, rows, y)
            return out
        return call, len(groups)

    def grouped_call(self, x, ids, w):
        """The same work as two `torch._grouped_mm` calls over all E experts (CUTLASS grouped GEMM), with the
        sorting by expert on the device: what a bf16 engine would run. Weights are the [E, K, N] views of the
        [E, N, K] tensors (column-major B)."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(EXPERTS, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = order // TOP_K
        gu = torch._grouped_mm(x[rows], self.w13_bf16.transpose(1, 2), offs=offs)
        act = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
        y = torch._grouped_mm(act, self.w2_bf16.transpose(1, 2), offs=offs).float() * w.reshape(-1)[order, None]
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(x.shape[0], TOP_K, HIDDEN).sum(dim=1)

    def grouped_available(self, log) -> bool:
        """torch._grouped_mm runs here and matches the per-expert bf16 graph (M = 4)."""
        try:
            x = torch.randn(4, HIDDEN, device=self.w13_bf16.device, dtype=torch.bfloat16)
            ids, w = self.routing(4)
            got = self.grouped_call(x, ids, w)
            want = self.bf16_call(x, ids, w)[0]()
            err = float((got.float() - want).norm() / want.norm())
            log(f"bf16 baseline: torch._grouped_mm vs per-expert graph, rel. err {err:.2e}")
            return err < 2e-2
        except Exception as exc:
            log(f"bf16 baseline: torch._grouped_mm unavailable ({type(exc).__name__}: {str(exc)[:300]}); "
                "using the per-expert graph")
            return False


def time_moe(device, log, layer: K2Layer, configs=None) -> list[dict]:
    rows = []
    grouped = layer.grouped_available(log)
    for m in MS:
        cfg = None
        routings = [layer.routing(m) for _ in range(8)]
        used = [int(torch.unique(ids).numel()) for ids, _ in routings]
        nbytes = statistics.mean(used) * layer.expert_bytes
        r = max(2, min(8, copies_for(int(nbytes))))
        xs = [torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(r)]
        outs = [torch.empty(m, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(r)]
        ours = graph_time_us([lambda x=x, rw=rw, o=o: fused_moe(x, layer.experts, rw[0], rw[1], out=o, config=cfg)
                              for x, rw, o in zip(xs, routings, outs)])
        if grouped:
            bf16 = graph_time_us([lambda x=x, rw=rw: layer.grouped_call(x, *rw) for x, rw in zip(xs, routings)])
        else:
            bf16_calls = [layer.bf16_call(x, *rw)[0] for x, rw in zip(xs[:2], routings[:2])]
            bf16 = graph_time_us(bf16_calls, batches=3, replays=1, min_calls=4)
        read = plain_read_us(int(nbytes), device)
        tiles = moe_cuda_tiles(cfg or pick_config(MOE_CONFIGS, m), layer.experts, xs[0], outs[0], TOP_K)
        kernel = " + ".join(f"CUDA {name}" for name, tile in zip(("gate/up", "down"), tiles) if tile) or "Triton"
        row = dict(m=m, kernel=kernel, used_experts=statistics.mean(used[:r]), ours_us=ours, bf16_us=bf16, read_us=read,
                   bf16_kind="torch._grouped_mm" if grouped else "per-expert graph",
                   weight_bytes=nbytes, gbps=nbytes / ours / 1e3, read_frac=read / ours, speedup_bf16=bf16 / ours,
                   config=cfg or pick_config(MOE_CONFIGS, m))
        rows.append(row)
        log(f"moe M={m} (~{row['used_experts']:.0f} experts, {nbytes / 1e6:.0f} MB): {kernel} {ours:.1f} us "
            f"({row['gbps']:.0f} GB/s, {row['read_frac']:.0%} of read {read:.1f} us) bf16 {bf16:.1f} us "
            f"({row['speedup_bf16']:.2f}x)")
    return rows


def pdl_chain_check(device, log, layer) -> list[dict]:
    """Launches that overlap through PDL compute bit for bit what the same configs compute without it: pairs of
    dependent dense calls (7168->2048 then 2048->7168 on its output) and of fused MoE calls (the second on the
    first's output), 8 pairs back to back, eagerly and replayed from a CUDA graph, at every M of the timings; the
    dense weights with their CUDA-order copy, so that the CUDA kernel's tiles (always PDL) are chained too."""
    gen = verify.generator(device, "pdl-chain")
    wa = pack_for_gpu(*verify.random_int4(2048, 7168, 32, "bfloat16", gen, device), 32, "bfloat16", device,
                      cuda_order=True)
    wb = pack_for_gpu(*verify.random_int4(7168, 2048, 32, "bfloat16", gen, device), 32, "bfloat16", device,
                      cuda_order=True)
    rows = []
    for kind in ("dense", "moe"):
        for m in MS:
            xs = [torch.randn(m, 7168, device=device, dtype=torch.bfloat16) for _ in range(8)]
            routes = [layer.routing(m) for _ in xs] if kind == "moe" else None
            if kind == "dense":     # each weight's own config (its shape's table)
                base = (pick_config(dense_configs(7168, 2048, torch.bfloat16), m),
                        pick_config(dense_configs(2048, 7168, torch.bfloat16), m))
                plain = tuple(dict(c, PDL=False, CUDA_PDL=False) for c in base)     # the CUDA kernel's too

                def chain(cfg):
                    return [w4a16_linear(w4a16_linear(x, wa, config=cfg[0]), wb, config=cfg[1]) for x in xs]
            else:
                base = pick_config(MOE_CONFIGS, m)
                plain = tuple(dict(c, PDL=False) for c in base)

                def chain(cfg):
                    return [fused_moe(fused_moe(x, layer.experts, *r, config=cfg), layer.experts, *r, config=cfg)
                            for x, r in zip(xs, routes)]
            want = chain(plain)
            eager = chain(base)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = chain(base)
            graph.replay()
            torch.cuda.synchronize()
            same = sum(torch.equal(a, b) for a, b in zip(want, eager)) + sum(
                torch.equal(a, b) for a, b in zip(want, captured))
            pdl = any(c.get("PDL") or (c.get("CUDA") and kind == "dense") for c in base)
            rows.append(dict(kind=kind, m=m, pdl=pdl, identical=same, of=2 * len(xs)))
    log("PDL chains bit-identical to the same configs without PDL: " + ", ".join(
        f"{r['kind']} M={r['m']}{'' if r['pdl'] else ' (no PDL)'} {r['identical']}/{r['of']}" for r in rows))
    return rows


# ---------------------------------------------------------------- sweep

def one_row(bn, bk, planes=True, groups=True, warps=4, split=0, wide=False):
    return dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, X_PLANES=planes and not wide, SCALE_GROUPS=groups,
                num_warps=warps, num_stages=3, SPLIT_CTAS=split, **({"X_WIDE": True} if wide else {}))


def triton_only(cfg: dict) -> dict:
    """A config without the CUDA kernel's keys: what the Triton sweep times (its weights have no CUDA-order copy)."""
    return {key: value for key, value in cfg.items() if key not in CUDA_KEYS}


def cuda_keys(cfg: dict) -> dict:
    return {key: cfg[key] for key in CUDA_KEYS if key in cfg}


# the committed configs (the previous sweep's winners), timed beside the candidates as references; their CUDA keys
# apart, put back into the swept tables by with_cuda_keys (the CUDA tiles are --cuda-sweep's)
OLD_DENSE = {m: triton_only(pick_config(DENSE_CONFIGS, m)) for m in MS}
OLD_SHAPES = {shape: {m: triton_only(pick_config(table, m)) for m in MS}
              for shape, table in DENSE_SHAPE_CONFIGS.items()}
OLD_CUDA = {shape: {m: cuda_keys(pick_config(table, m)) for m in MS}
            for shape, table in [(None, DENSE_CONFIGS), *DENSE_SHAPE_CONFIGS.items()]}


def with_cuda_keys(table: list, shape: tuple[int, int] | None = None) -> list:
    """A swept per-M table with the committed CUDA keys of each bound's M (the shape's own committed table, else the
    generic one), so that installing it (--configs) keeps the CUDA kernel where the committed tables run it."""
    old = OLD_CUDA.get(shape, OLD_CUDA[None])
    return [[bound, {**triton_only(cfg), **old[min(bound, MS[-1])]}] for bound, cfg in table]


def config_json(value):
    """json.dumps's default for the tables: a CudaTile as {"CudaTile": its fields} (install_configs reads it back)."""
    if isinstance(value, CudaTile):
        return {"CudaTile": asdict(value)}
    raise TypeError(f"not JSON serializable: {value!r}")


def config_from_json(cfg: dict) -> dict:
    cuda = cfg.get("CUDA")
    return dict(cfg, CUDA=CudaTile(**cuda["CudaTile"])) if isinstance(cuda, dict) else cfg


# a shape's own winner goes into its table (DENSE_SHAPE_CONFIGS) where it beats the winner summed over the shapes by
# this much on that shape
SHAPE_GAIN = 0.05


def mma_tile(bm, bn, warps, split, stages=3, **extra):
    """A tensor-core tile on the weight's MMA-order words (mma._mma_order_tile), K blocks of 128."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, MMA_ORDER=True, num_warps=warps, num_stages=stages,
                SPLIT_CTAS=split, **extra)


def prefetch_row(bn, bk, warps=4, split=0, **extra):
    return dict(one_row(bn, bk, warps=warps, split=split, wide=True), PREFETCH=True, **extra)


def dense_candidates(m: int) -> list[dict]:
    """The committed config of each M, the same with PDL flipped (launched as a programmatic dependent of the
    kernel before it: the next call's launch, and for the one-row GEMV its first weight tile, overlap this call's
    end), at M = 1-4 one-row GEMV tiles (from M = 2 one row per program), and from M = 2 the tensor-core tiles on the
    weight's MMA-order words (MMA_ORDER: tile shapes, splits, stages, warps, PDL). Session 13's defaults at M = 3-64
    (weight as the A operand, one dot per K tile on the bundle's order) lost to them in session 14 and were removed in
    session 15. Measured and dropped in issue 27's session 11 (bench/RESULTS.md): the GEMV over 2-8 rows with the
    biased codes, as 3-D tiles and as a two-row variant of the one-row 2-D tiles, 1.1-3x slower than the tensor-core
    tiles at M = 2-8 (removed from the kernel in session 15); register caps (maxnreg 64-128) on every committed tile,
    0-100% slower; tensor-core K tiles of 512 and other splits at M = 16-64. Earlier: X_WIDE on the tensor-core tiles,
    1.3-2x slower at every M. Session 15: M = 1
    GEMV tiles 16 x 1024 of 4 warps and 64 x 512 of 8 warps, 1.0-2.2x slower. Session 16: at M = 32 and 64 tiles of
    half and a quarter of the rows (two or four programs per column tile, each dequantizing the whole weight
    again), 528-1056 splits, 1.1-1.6x slower. Session 18: M = 1 GEMV tiles 32 x 512 of 8 warps split to ~132 and
    ~264 (K = 7168's 14 tiles in two even runs, where the 32 x 1024 tile splits its 7 as 4 + 3), no shape's best.
    Session 19: MMA_ORDER tiles of 1 and 2 warps (16, 32 and 64 columns: Triton's mma.sync path instead of wgmma),
    1.3-2.1x slower at M = 2-16; the committed tiles with 6-12 pipeline stages (`--trips`), no faster at any split;
    at M = 1 on 2048->7168 GEMV tiles 16 x 1024 of 4 and 8 warps, 16 x 2048 and 32 x 2048 and 64 x 2048 of 8, 16 x 512
    of 4, 1.0-1.4x the committed 32 x 1024 of 8 (16 x 1024 of 2 warps, 6% faster, was adopted and is a candidate).
    Session 20: the GEMV over 2, 4 and 8 rows per program again, on today's one-row loop (3-D tiles, each word's codes
    decoded once for all rows): at M = 2 16 x 512 tiles of 2-4 warps 0-8% faster than the committed tiles (2048->7168
    6.0 us against 6.5), at M = 4 and 8 slower than the tensor-core tiles; its 3-D form cost the committed one-row
    tiles 2-15% (2048->7168 at M = 1 4.7 us against 4.1, the MoE at M = 1 2%), so it was not kept; M = 1 GEMV tiles
    16 x 512 of 2 warps split to ~264 and ~528 and 16 x 1024 of 2 split to ~528, and in a second sweep 16 x 2048 of
    4, 8 x 1024 and 8 x 512 and 16 x 512 of 1 warp: no shape's best (7168->4096's own best, 16 x 2048 of 4, 8.0 us
    like the committed tile). The MMA_ORDER tiles with the next block's words, scales and x loaded into registers
    before this block's arithmetic (plain loads, one stage, instead of the cp.async pipeline; 199 instructions per
    trip against 223, 96 registers), at SPLIT_CTAS 264 and 528 with and without PDL: best only on 2048->7168 at
    M = 4 and 8, 8.9 and 9.0 us against 9.3 and 9.4, elsewhere slower; not kept. Session 21: the MMA-order copy made
    K-block-major (5-20% faster at M = 2-64, adopted) and re-swept with these candidates; a copy contiguous per 64-row
    tile over all its K blocks instead, within 1% of it, not kept."""
    cands = [OLD_DENSE[m], dict(OLD_DENSE[m], PDL=not OLD_DENSE[m].get("PDL"))]
    cands += [OLD_SHAPES[shape][m] for shape in sorted(OLD_SHAPES)]      # each shape's committed config
    if m >= 2:     # tensor cores on the MMA-order words: other tiles, splits, stages, warps and PDL
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        cands += [mma_tile(bm, 64, 4, sp) for sp in (132, 264, 396, 528, 792)]
        cands += [mma_tile(bm, 64, 4, 528, stages=st) for st in (2, 4, 6)]
        cands += [mma_tile(bm, 64, 4, sp, stages=4) for sp in (264, 396, 792)] + [mma_tile(bm, 64, 4, 528, stages=4,
                                                                                            PDL=True)]
        cands += [mma_tile(bm, 64, 4, 528, PDL=True), mma_tile(bm, 64, 4, 264, PDL=True),
                  mma_tile(bm, 128, 8, 264), mma_tile(bm, 128, 8, 528), mma_tile(bm, 128, 4, 264),
                  mma_tile(bm, 32, 4, 528) if bm <= 16 else mma_tile(bm, 64, 8, 264)]
        # the split-K partials summed by a second launch (SPLIT_REDUCE) rather than by the last program
        cands += [mma_tile(bm, 64, 4, sp, SPLIT_REDUCE=True, **pdl) for sp in (264, 528)
                  for pdl in ({}, {"PDL": True})]
    if m <= 4:     # one-row GEMV tiles (at M = 2 and 4 run once per row: the second row's weight reads mostly from L2)
        cands += [prefetch_row(bn, bk, warps=w, split=sp, CODES_ASM=True, BIASED_CODES=True, PDL=True)
                  for bn, bk, w, sp in ((32, 1024, 8, 132), (32, 1024, 8, 264), (32, 512, 4, 264), (64, 1024, 8, 264),
                                        (64, 1024, 8, 132), (64, 512, 4, 264), (16, 1024, 2, 132))]
    unique = {}
    for cfg in cands:   # the first of equal configs (the committed one is found by identity); a flag set to False
        # is the flag left out
        unique.setdefault(json.dumps({k: v for k, v in cfg.items() if v is not False}, sort_keys=True), cfg)
    return list(unique.values())


SWEEP_MOE_MS = (1, 4, 8, 16, 32, 64)
# the committed (gate/up, down) configs without their CUDA keys, and those keys apart (put back into the swept table,
# as with_cuda_keys does for the dense ones: the CUDA tiles are --moe-cuda-sweep's)
OLD_MOE = {m: tuple(triton_only(c) for c in pick_config(MOE_CONFIGS, m)) for m in SWEEP_MOE_MS}
OLD_MOE_CUDA = {m: tuple(cuda_keys(c) for c in pick_config(MOE_CONFIGS, m)) for m in SWEEP_MOE_MS}


def with_moe_cuda_keys(pair, m: int) -> list[dict]:
    """A swept (gate/up, down) pair with the committed CUDA keys of sweep bucket m in place of any it carries."""
    return [{**triton_only(c), **cuda} for c, cuda in zip(pair, OLD_MOE_CUDA[m])]


def moe_gate_up_candidates(m: int) -> list[dict]:
    """The committed gate/up tile with PDL flipped (session 11 also measured the biased codes, adopted, and
    register caps on the GEMV and sorted tiles, 5-100% slower; bench/RESULTS.md). Other GEMV tile shapes: see
    moe_pair_candidates (session 12: 16-wide tiles, 1-warp down tiles of 256 and gate/up K tiles of 1024 1.5-3x slower;
    session 15: gate/up 128 x 256 of 4 and 8 warps, 5-30% slower, a down tile 32 x 512 of 2 warps 2x slower)."""
    return [dict(OLD_MOE[m][0], PDL=not OLD_MOE[m][0].get("PDL"))]


def moe_down_candidates(m: int, sorted_: bool) -> list[dict]:
    """The committed down tile with PDL flipped."""
    return [dict(OLD_MOE[m][1], PDL=not OLD_MOE[m][1].get("PDL"))]


def moe_pair_candidates(m: int) -> list[tuple[dict, dict]]:
    """Whole (gate/up, down) pairs: from M = 16 expert-sorted tensor-core tiles of other shapes and stages (session
    13's with one dot per K tile, slower, were removed in session 15); on the GEMV launches (M <= 16) both with PDL,
    so the down launch loads its first weight tile while gate/up ends (ROUTED), with down and gate/up tiles of other
    shapes."""
    old13, old2 = OLD_MOE[m]
    pairs = []
    if m >= 16:     # expert-sorted tensor-core tiles
        tc = dict(BLOCK_M=16, SORTED=True, BLOCK_N=64, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)
        pairs += [(dict(tc, SPLIT_GU=True, PDL=True), dict(tc, PDL=True)),
                  (dict(tc, SPLIT_GU=True, PDL=True, BLOCK_N=32), dict(tc, BLOCK_N=32, PDL=True)),
                  (dict(tc, SPLIT_GU=True, PDL=True, BLOCK_K=128), dict(tc, BLOCK_K=128, PDL=True)),
                  (dict(tc, SPLIT_GU=True, PDL=True, num_stages=4), dict(tc, num_stages=4, PDL=True))]
    if old13["BLOCK_M"] != 1:
        return pairs
    gu, down = dict(old13, PDL=True), dict(old2, PDL=True)
    pairs += [(gu, down)]
    downs = [dict(down, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
             for bn, bk, w in ((32, 256, 2), (64, 256, 2), (32, 128, 1), (64, 128, 2), (32, 128, 2),
                               (32, 512, 4), (64, 512, 4), (32, 1024, 8))]
    pairs += [(gu, d) for d in downs]
    small_down = downs[0]
    pairs += [(dict(gu, BLOCK_N=bn, BLOCK_K=bk, num_warps=w), small_down)
              for bn, bk, w in ((32, 512, 4), (32, 256, 2), (64, 512, 4), (64, 256, 4), (64, 1024, 8), (32, 1024, 8),
                                 (64, 512, 8))]
    # gate/up split over K in two (twice the programs, each half as long; partials meet in the workspace)
    pairs += [(dict(gu, BLOCK_N=bn, SPLIT_K=2), small_down) for bn in (32, 64)]
    return pairs


def down_reference(m: int, sorted_: bool) -> dict:
    """The down tile paired with every gate/up candidate: the committed one."""
    return dict(OLD_MOE[m][1], SORTED=sorted_)


def moe_candidates(m: int) -> list[tuple[dict, dict]]:
    """Every (gate/up, down) pair the warm-up compiles: gate/up candidates with the committed down tile, down
    candidates with the committed gate/up tile (the sweep times gate/up first, then down with the best gate/up)."""
    old13, old2 = OLD_MOE[m]
    sorted_ = old13.get("SORTED", old13["BLOCK_M"] > 1)
    cands = [(old13, old2)]
    cands += [(gu, down_reference(m, sorted_)) for gu in moe_gate_up_candidates(m)]
    cands += [(old13, d) for d in moe_down_candidates(m, sorted_)]
    return cands + moe_pair_candidates(m)


def warm_jobs(moe: bool = True):
    """One compile job per distinct kernel (SPLIT_K is a compile-time constant: the warm-up runs every shape)."""
    jobs, seen = [], set()
    for kind, m, cfg in ([("dense", m, c) for m in MS for c in dense_candidates(m)]
                         + [("moe", m, c) for m in SWEEP_MOE_MS for c in moe_candidates(m) if moe]):
        key = json.dumps([kind, m if (kind == "moe" or m > 16) else 0, cfg], sort_keys=True)
        if key not in seen:
            seen.add(key)
            jobs.append((kind, m, cfg))
    return jobs


def run_sweep(device, log, layer: K2Layer, moe: bool = True) -> dict:
    """Best config per M: dense by the sum of its times over the three K2 shapes, and a shape's own table where its
    own best beats that by SHAPE_GAIN at some M (the summed winner at the other M); MoE on the K2 layer, gate/up
    tiles first (with the reference down tile), then down tiles with the best gate/up tile (not moe: the committed
    MoE configs, untimed)."""
    rows = []
    weights = {}
    for k, n in DENSE_SHAPES:
        gen = verify.generator(device, "sweep", k, n)
        nbytes = n * k // 2 + n * k // 32 * 2
        weights[(k, n)] = [pack_for_gpu(*verify.random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16",
                                        device) for _ in range(copies_for(nbytes))]
    dense_table = []
    shape_best = {shape: [] for shape in DENSE_SHAPES}    # per M: (bound, the shape's config, its own winner taken)
    for m in MS:
        scores = []
        for cfg in dense_candidates(m):
            try:
                times = []
                for (k, n), ws in weights.items():
                    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in ws]
                    times.append(graph_time_us([lambda x=x, w=w: w4a16_linear(x, w, config=cfg)
                                                for x, w in zip(xs, ws)], batches=3, replays=2))
            except Exception as exc:
                log(f"sweep dense M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append(dict(kind="dense", m=m, config=cfg, us=times))
            scores.append((sum(times), times, cfg))
        total, times, cfg = min(scores, key=lambda t: t[0])
        ref = next(t for s, t, c in scores if c is OLD_DENSE[m]) if any(c is OLD_DENSE[m] for *_, c in scores) else []
        log(f"sweep dense M={m}: best {cfg} " + " ".join(f"{t:.1f}" for t in times) + " us; reference "
            + " ".join(f"{t:.1f}" for t in ref))
        bound = m if m < MS[-1] else 1 << 62
        dense_table.append([bound, cfg])
        for i, shape in enumerate(DENSE_SHAPES):
            own = min(scores, key=lambda t: t[1][i])
            committed = [t[i] for _, t, c in scores if shape in OLD_SHAPES and c == OLD_SHAPES[shape][m]]
            log(f"sweep dense M={m} {shape[0]}->{shape[1]}: own best {own[2]} {own[1][i]:.1f} us, summed winner "
                f"{times[i]:.1f} us" + (f", committed {committed[0]:.1f} us" if committed else ""))
            gained = own[1][i] < (1 - SHAPE_GAIN) * times[i]
            shape_best[shape].append((bound, own[2] if gained else cfg, gained))
    dense_shape_table = {f"{k}x{n}": with_cuda_keys([[bound, cfg] for bound, cfg, _ in best], (k, n))
                         for (k, n), best in shape_best.items() if any(gain for *_, gain in best)}
    dense_table = with_cuda_keys(dense_table)
    del weights
    moe_table = []

    def time_moe_cfg(m, cfg, xs, routings):
        try:
            us = graph_time_us([lambda x=x, rw=rw: fused_moe(x, layer.experts, rw[0], rw[1], config=cfg)
                                for x, rw in zip(xs, routings)], batches=3, replays=1, min_calls=8)
        except Exception as exc:
            log(f"sweep moe M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
            return None
        rows.append(dict(kind="moe", m=m, config=cfg, us=us))
        return us

    for m in SWEEP_MOE_MS if moe else ():
        routings = [layer.routing(m) for _ in range(8)]
        xs = [torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16) for _ in routings]
        old13, old2 = OLD_MOE[m]
        ref = time_moe_cfg(m, (old13, old2), xs, routings)
        scores = [(ref, (old13, old2))] if ref else []
        for gu in moe_gate_up_candidates(m):
            cfg = (gu, down_reference(m, gu["SORTED"]))
            us = time_moe_cfg(m, cfg, xs, routings)
            if us:
                scores.append((us, cfg))
        us, (best13, _) = min(scores, key=lambda t: t[0])
        for down in moe_down_candidates(m, best13.get("SORTED", best13["BLOCK_M"] > 1)):
            cfg = (best13, down)
            t = time_moe_cfg(m, cfg, xs, routings)
            if t:
                scores.append((t, cfg))
        for cfg in moe_pair_candidates(m):
            t = time_moe_cfg(m, cfg, xs, routings)
            if t:
                scores.append((t, cfg))
        us, cfg = min(scores, key=lambda t: t[0])
        log(f"sweep moe M={m}: best {cfg} {us:.1f} us (reference {ref:.1f} us)" if ref else
            f"sweep moe M={m}: best {cfg} {us:.1f} us")
        moe_table.append([m if m < SWEEP_MOE_MS[-1] else 1 << 62, with_moe_cuda_keys(cfg, m)])
    return {"rows": rows, "dense_table": dense_table, "moe_table": moe_table, "dense_shape_table": dense_shape_table}


# ---------------------------------------------------------------- report

def cuda_candidates(n: int, k: int, m: int) -> list:
    """CUDA tiles for the sweep: 4-16 warps per block, 100-264 blocks per SM's worth of blocks, every cluster size that
    splits K evenly; two tiles per warp (half the B reads, twice the codes in flight per step) from M = 8 on, with 4
    or 8 steps in flight; from M = 16 on, the scales folded into the weights too (FOLD), and four tiles per warp with
    them (2 or 4 steps in flight; at 64 rows only with the codes' ring, whose registers they need). Then the
    shared-memory rings, in clusters of 1-2 (larger ones do not all fit at once) of 2-8 K warps: the steps in flight
    in a ring per warp (RING: deeper, and no registers held), x in a ring of 2 or 4 chunks of 2 steps (NXR: a few KB
    where the whole slice took up to 200), each in one or two blocks per SM. From M = 4 on, x multicast to 2 or 4
    blocks along N (XMC), in clusters of at most 4 blocks. At M <= 4, x's rows in shared memory fitted to M (fit_x),
    in one block per SM or two (the next call's block beside this one's). Not: more accumulators than the registers
    hold (a float32 per MMA output, twice without FOLD: at most 64 a thread up to 256 threads an SM's worth, 16
    beyond; of the 2417 experimental variants at M = 1-64 ptxas spilled 78, 52 of them among the 136 this leaves
    out)."""
    out = []
    for nwn, nwk, cl, pf, ch, tpw, fold, ring, nxr, minb, xmc, fit_x in itertools.product(
            (1, 2, 4, 7, 8, 14), (1, 2, 4, 8), (1, 2, 4, 8), (2, 4, 8, 12, 16, 24), (1, 2, 4), (1, 2, 4),
            (False, True), (False, True), (0, 2, 4), (1, 2), (1, 2, 4), (False, True)):
        tile = CudaTile(nwn, nwk, cl, pf, ch, tpw, fold, ring, minb, nxr, xmc, fit_x)
        steps = tile.steps(k)
        in_flight = ({1: (12, 24), 2: (8, 12), 4: (4,)} if ring else {1: (8, 16), 2: (4, 8), 4: (2, 4)})[tpw]
        if (tile.fits(n, k, m) and 100 <= n // tile.rows * cl <= 264 * minb and 4 <= nwn * nwk <= 16
                and (pf == max(in_flight) or pf <= steps) and (ch == 1 or ch <= steps) and pf in in_flight
                and (tpw == 1 or m >= 8) and (not fold or m >= 16) and (tpw < 4 or fold and (ring or m <= 32))
                and (minb == 1 or (ring or nxr or fit_x) and nwn * nwk <= 8 and tpw * m_tiles(m) <= 2)
                and (not fit_x or not nxr and xmc == 1)
                and (not (ring or nxr) or cl <= 2 and nwk >= 2 and nwn * nwk in (4, 8) and (not fold or m >= 32))
                and (not ring or nxr or ch >= 2) and (not nxr or ch == 2)
                and (xmc == 1 or m >= 4 and minb == 1 and cl * xmc <= 4)
                and tpw * m_tiles(m) * (1 if fold else 2) <= (16 if nwn * nwk * minb <= 8 else 4)):
            out.append(tile)
    return out


def options(tile: CudaTile) -> set[str]:
    """The kernel options a tile turns on beyond the plain kernel."""
    return {name for name, on in (("fold", tile.fold), ("ring", tile.ring), ("nxr", tile.nxr), ("minb", tile.minb > 1),
                                  ("xmc", tile.xmc > 1), ("fit_x", tile.fit_x)) if on}


def experimental(tile: CudaTile) -> bool:
    """A tile with an option no committed table's tile uses (DENSE_SHAPE_CONFIGS)."""
    committed = {o for table in DENSE_SHAPE_CONFIGS.values() for _, entry in table
                 if isinstance(entry.get("CUDA"), CudaTile) for o in options(entry["CUDA"])}
    return bool(options(tile) - committed)


def cuda_sweep(device, log, ms: tuple[int, ...] = MS,
               only_experimental: bool = False) -> tuple[list[dict], list[dict]]:
    """Every CUDA tile on the three K2 shapes at each of `ms` (compiled in threads first, or loaded from the CUBIN
    cache: w4a16_cuda.cached_cubin), or only the experimental ones, timed as time_dense times, checked against
    float64; logs the best per M beside the anchors timed in the same run (the committed tables' call, whichever
    kernel they pick, and bf16 cuBLAS), and the best per M bucket (summed over its M)."""
    def candidates(n, k, m):
        return [t for t in cuda_candidates(n, k, m) if experimental(t) or not only_experimental]

    major, minor = torch.cuda.get_device_capability(device)
    source = w4a16_cuda.SOURCE.read_text()
    variants = {tuple(t.defines(k, m, False).items()) for k, n in DENSE_SHAPES for m in ms
                for t in candidates(n, k, m)}
    t0 = time.perf_counter()
    compiler = w4a16_cuda.nvrtc_version()
    with ThreadPoolExecutor(16) as pool:     # NVRTC releases the GIL
        cubins = dict(zip(variants, pool.map(
            lambda d: w4a16_cuda.cached_cubin(source, d, w4a16_cuda.target(d, major, minor), compiler), variants)))
    for defines, cubin in cubins.items():
        w4a16_cuda.load(defines, device.index, cubin)
    log(f"cuda sweep: {len(cubins)} variants compiled or loaded in {time.perf_counter() - t0:.0f} s")
    rows, anchors = [], []
    for k, n in DENSE_SHAPES:
        weights, _ = dense_weights(device, k, n, "bench dense")
        w64 = weights[0].dequantize().double()
        w_bf16 = [w.dequantize().to(torch.bfloat16) for w in weights[:copies_for(n * k * 2)]]
        for m in ms:
            xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in weights]
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in weights]
            ref = xs[0].double() @ w64.T
            entry = pick_config(dense_configs(k, n, torch.bfloat16), m)
            anchor = dict(k=k, n=n, m=m, kernel="CUDA" if cuda_tile(entry, weights[0], xs[0]) else "Triton",
                          committed_us=committed_us(xs, weights, outs), bf16_us=bf16_us(xs, w_bf16))
            anchors.append(anchor)
            for tile in candidates(n, k, m):
                out = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
                w4a16_cuda.w4a16_cuda_linear(xs[0], weights[0].cuda, n, k, out, tile)
                us = graph_time_us([lambda x=x, w=w, o=o, t=tile: w4a16_cuda.w4a16_cuda_linear(x, w.cuda, n, k, o, t)
                                    for x, w, o in zip(xs, weights, outs)])
                rows.append(dict(k=k, n=n, m=m, tile=asdict(tile), us=us, rel_err=verify.rel_err(out, ref)))
            here = [r for r in rows if (r["k"], r["n"], r["m"]) == (k, n, m)]
            best = min(here, key=lambda r: r["us"])
            old = min((r["us"] for r in here if not experimental(CudaTile(**r["tile"]))), default=float("nan"))
            log(f"cuda sweep {k}->{n} M={m}: best {best['us']:.2f} us {best['tile']} (rel err {best['rel_err']:.1e}, "
                f"{anchor['bf16_us'] / best['us']:.2f}x bf16); best without the experimental options {old:.2f} us; "
                f"committed {anchor['kernel']} {anchor['committed_us']:.2f} us; bf16 {anchor['bf16_us']:.2f} us")
        del weights, w_bf16
        torch.cuda.empty_cache()
    for k, n in DENSE_SHAPES:
        for bucket in ((1,), (2,), (2, 4), (4, 8), (8,), (8, 16), (16,), (32,), (64,)):
            sums = {}
            for r in rows:
                if (r["k"], r["n"]) == (k, n) and r["m"] in bucket:
                    sums.setdefault(json.dumps(r["tile"]), []).append(r["us"])
            whole = {t: sum(v) for t, v in sums.items() if len(v) == len(bucket)}
            if whole:
                tile = min(whole, key=whole.get)
                log(f"cuda sweep {k}->{n} M in {bucket}: {whole[tile]:.2f} us summed, {tile}")
    bad = [r for r in rows if not r["rel_err"] <= verify.TOLERANCE[torch.bfloat16]]
    log(f"cuda sweep: {len(rows)} timings, {len(bad)} over the bf16 tolerance")
    return rows, anchors


def moe_cuda_candidates(m: int) -> list[CudaTile]:
    """CUDA tiles for the MoE's gate/up launch on K2's experts (K = 7168, 4096 gate and up rows an expert, one row of
    x per pair): blocks of 32-64 rows (one tile per warp, or two for 2 warps along N) of 8 warps (and three tiles
    of 16 warps), clusters of 1-4
    along K (M * 8 pairs of 4096 / rows blocks each: 1-16 waves at M = 1), the steps in flight in registers (8 or 16)
    or in the codes' ring (12, 16 or 24: 12 won every M on the H100, session 30), x whole, or in a ring of 2 chunks
    of 2 steps with 8 steps in flight."""
    out = []
    for nwn, nwk, cl, pf, ch, tpw, ring in itertools.product(
            (2, 4), (2, 4), (1, 2, 4), (8, 12, 16, 24), (2, 4), (1, 2), (False, True)):
        tile = CudaTile(nwn, nwk, cl, pf, ch, tpw, ring=ring)
        in_flight = (12, 16, 24) if ring else (8, 16)
        if (tile.fits_gate_up(2 * INTER, HIDDEN) and nwn * nwk == 8 and pf in in_flight and tile.rows <= 64
                and (tpw == 1 or nwn == 2 and not ring)):
            out.append(tile)
    out += [CudaTile(nwn, 8 // nwn, cl, 8, 2, nxr=2) for nwn in (2, 4) for cl in (1, 2)
            if CudaTile(nwn, 8 // nwn, cl, 8, 2, nxr=2).fits_gate_up(2 * INTER, HIDDEN)]
    # and 16 warps, as the dense 7168 -> 4096 tile at M = 1-8 (configs.py)
    return out + [CudaTile(2, 8, 1, 8, ch=4), CudaTile(2, 8, 2, 8, ch=2), CudaTile(4, 4, 1, 8, ch=4)]


def moe_down_cuda_candidates(m: int) -> list[CudaTile]:
    """CUDA tiles for the MoE's down launch on K2's experts (7168 rows, a token's 8 rows of h side by side: K = 16384,
    each K warp group's slice within one pair): 4-16 warps, blocks of 16-64 rows, clusters of 1-8 along K (M * 7168 /
    rows * cl blocks: 448 at M = 1 with 16-row blocks and no cluster), the steps in flight in registers (8 or 16) or in
    the codes' ring (12 or 24; with 16 warps 8 in registers: 16 spilled); x (one row) in chunks of 2 steps."""
    out = []
    for nwn, nwk, cl, pf, ring in itertools.product((1, 2, 4), (2, 4, 8), (1, 2, 4, 8), (8, 12, 16, 24), (False, True)):
        tile = CudaTile(nwn, nwk, cl, pf, 2, ring=ring)
        if (tile.fits_down(HIDDEN, INTER, TOP_K) and 4 <= nwn * nwk <= 16 and pf in ((12, 24) if ring else (8, 16))
                and pf <= tile.steps(TOP_K * INTER) and (not ring or nwk >= 2)
                and (ring or pf == 8 or nwn * nwk <= 8)):     # 16 warps: 128 registers, 16 steps in them spill
            out.append(tile)
    return out


def moe_cuda_sweep(device, log, ms: tuple[int, ...]) -> list[dict]:
    """The committed MoE configs with one launch on the CUDA kernel at a time, on the K2 layer, timed as time_moe
    times, beside the committed configs and a plain read of the same bytes timed in the same run: each gate/up tile of
    moe_cuda_candidates with the committed down config, then each down tile of moe_down_cuda_candidates after the
    faster gate/up (the best CUDA tile's or the committed); each output against the committed configs' (bf16
    tolerance)."""
    major, minor = torch.cuda.get_device_capability(device)
    source, compiler = w4a16_cuda.SOURCE.read_text(), w4a16_cuda.nvrtc_version()
    layer = K2Layer(device, with_bf16=False)
    rows = []
    for m in ms:
        old13, old2 = pick_config(MOE_CONFIGS, m)
        routings = [layer.routing(m) for _ in range(8)]
        ids64 = routings[0][0].dtype == torch.int64
        gate_ups, downs = moe_cuda_candidates(m), moe_down_cuda_candidates(m)
        h_planes = bool(old2.get("X_PLANES")) and not old2.get("X_WIDE")
        variants = {tuple(t.defines(HIDDEN, 1, False, w4a16_cuda.MoeLaunch(False, TOP_K, ids64, planes)).items())
                    for t in gate_ups for planes in {h_planes, False}}
        variants |= {tuple(t.defines(TOP_K * INTER, 1, False, w4a16_cuda.MoeLaunch(True, TOP_K, ids64)).items())
                     for t in downs}
        with ThreadPoolExecutor(16) as pool:
            cubins = dict(zip(variants, pool.map(lambda d: w4a16_cuda.cached_cubin(
                source, d, w4a16_cuda.target(d, major, minor), compiler), variants)))
        for defines, cubin in cubins.items():
            w4a16_cuda.load(defines, device.index, cubin)
        used = [int(torch.unique(ids).numel()) for ids, _ in routings]
        nbytes = statistics.mean(used) * layer.expert_bytes
        r = max(2, min(8, copies_for(int(nbytes))))
        xs = [torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(r)]
        outs = [torch.empty(m, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(r)]

        def timed(cfg):
            return graph_time_us([lambda x=x, rw=rw, o=o: fused_moe(x, layer.experts, rw[0], rw[1], out=o, config=cfg)
                                  for x, rw, o in zip(xs, routings, outs)])
        want = fused_moe(xs[0], layer.experts, *routings[0], config=(old13, old2)).double()
        committed, read = timed((old13, old2)), plain_read_us(int(nbytes), device)

        def run(launch, tile, cfg):
            got = fused_moe(xs[0], layer.experts, *routings[0], config=cfg)
            rows.append(dict(m=m, launch=launch, tile=asdict(tile), us=timed(cfg), rel_err=verify.rel_err(got, want),
                             committed_us=committed, read_us=read))
            return rows[-1]
        best13 = min((run("gate/up", t, (dict(old13, CUDA=t), old2)) for t in gate_ups), key=lambda row: row["us"])
        cfg13 = dict(old13, CUDA=CudaTile(**best13["tile"])) if best13["us"] < committed else old13
        best2 = min((run("down", t, (cfg13, dict(old2, CUDA=t))) for t in downs), key=lambda row: row["us"])
        for launch, best, n in (("gate/up", best13, len(gate_ups)), ("down", best2, len(downs))):
            log(f"moe cuda sweep M={m} {launch}: {n} tiles; best {best['us']:.1f} us ({read / best['us']:.0%} of read "
                f"{read:.1f} us) {best['tile']} (rel err vs committed {best['rel_err']:.1e}); committed "
                f"{committed:.1f} us ({read / committed:.0%})")
    bad = [row for row in rows if not row["rel_err"] <= verify.TOLERANCE[torch.bfloat16]]
    log(f"moe cuda sweep: {len(rows)} timings, {len(bad)} over the bf16 tolerance")
    return rows


# a CUDA tile goes into a table where it is this much ahead of the committed call timed in the same run
CUDA_GAIN = 0.03


def dense_cuda_tables(rows: list[dict], anchors: list[dict]) -> dict[str, list]:
    """DENSE_SHAPE_CONFIGS ({"KxN": table}, configs.json's form) with --cuda-sweep's winners (rows within the bf16
    tolerance; only an M that is a bound of the shape's table, the last one read as MS's last M, decides that bound's
    entry): the best tile where it is CUDA_GAIN ahead of the committed call timed beside it (whichever kernel that
    ran), the entry's Triton keys kept for the calls the CUDA kernel cannot take."""
    ok = [r for r in rows if r["rel_err"] <= verify.TOLERANCE[torch.bfloat16]]
    tables = {}
    for (k, n), table in DENSE_SHAPE_CONFIGS.items():
        out = []
        for bound, cfg in table:
            m = min(bound, MS[-1])
            anchor = next((a for a in anchors if (a["k"], a["n"], a["m"]) == (k, n, m)), None)
            best = min((r for r in ok if (r["k"], r["n"], r["m"]) == (k, n, m)), key=lambda r: r["us"], default=None)
            if anchor and best and best["us"] <= (1 - CUDA_GAIN) * anchor["committed_us"]:
                cfg = dict(cfg, CUDA=CudaTile(**best["tile"]))
            out.append((bound, cfg))
        tables[f"{k}x{n}"] = out
    return tables


def moe_cuda_table(rows: list[dict]) -> list[tuple[int, tuple[dict, dict]]]:
    """MOE_CONFIGS with --moe-cuda-sweep's winners (rows within the bf16 tolerance; only an M that is a bound of the
    table decides that bound's entry): the best gate/up tile where it is CUDA_GAIN ahead of the committed configs; the
    best down tile where it is CUDA_GAIN ahead of that, together with the gate/up tile it was timed after (the sweep
    times the down tiles after its best gate/up tile wherever that one was ahead at all)."""
    ok = [r for r in rows if r["rel_err"] <= verify.TOLERANCE[torch.bfloat16]]
    table = []
    for bound, (cfg13, cfg2) in MOE_CONFIGS:
        mine = [r for r in ok if r["m"] == bound]
        gate_up = min((r for r in mine if r["launch"] == "gate/up"), key=lambda r: r["us"], default=None)
        down = min((r for r in mine if r["launch"] == "down"), key=lambda r: r["us"], default=None)
        if mine:
            committed = mine[0]["committed_us"]
            alone = gate_up["us"] if gate_up and gate_up["us"] <= (1 - CUDA_GAIN) * committed else committed
            if down and down["us"] <= (1 - CUDA_GAIN) * alone:
                if gate_up and gate_up["us"] < committed:
                    cfg13 = dict(cfg13, CUDA=CudaTile(**gate_up["tile"]))
                cfg2 = dict(cfg2, CUDA=CudaTile(**down["tile"]))
            elif alone < committed:
                cfg13 = dict(cfg13, CUDA=CudaTile(**gate_up["tile"]))
        table.append((bound, (cfg13, cfg2)))
    return table


def markdown(dense, moe, copy, correctness) -> str:
    lines = []
    if correctness:
        fails = [r for r in correctness if not r["ok"] and not r.get("flip")]
        flips = [r for r in correctness if r.get("flip")]
        flips_missed = [r for r in flips if r["ok"] or not r.get("all_written") or r.get("error")]
        worst = {}
        seen = [r for r in correctness if r["name"].startswith("flip seen")]     # verify.check_flip_seen
        for r in correctness:
            if r.get("flip") or "rel_err" not in r or r in seen:
                continue
            act = r["name"].split()[-1]
            worst[act] = max(worst.get(act, 0.0), r["rel_err"])
        lines += [f"Correctness: {len(correctness) - len(flips)} checks, {len(fails)} failed; "
                  f"worst rel. err " + ", ".join(f"{a} {v:.2e}" for a, v in sorted(worst.items()))
                  + f"; nibble flips detected {len(flips) - len(flips_missed)}/{len(flips)}"
                  + (f", seen in their own column under bf16 {sum(r['ok'] for r in seen)}/{len(seen)}" if seen else "")
                  + ".", ""]
        for r in fails[:20]:
            lines.append(f"- FAIL {r['name']}: {r.get('rel_err', r.get('error'))}")
    if copy:
        lines += [f"Device-to-device copy (2 GiB, read+write): {copy:.0f} GB/s", ""]
    if dense:
        lines += ["| K→N | M | kernel | ours µs | GB/s | % of read | bf16 µs | × bf16 | torch int4 µs | × int4 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in dense:
            int4 = "n/a" if r["torch_int4_us"] is None else f"{r['torch_int4_us']:.1f}"
            sp4 = "n/a" if r["speedup_int4"] is None else f"{r['speedup_int4']:.2f}"
            lines.append(f"| {r['k']}→{r['n']} | {r['m']} | {r['kernel']} | {r['ours_us']:.1f} | {r['gbps']:.0f} | "
                         f"{r['read_frac']:.0%} | {r['bf16_us']:.1f} | {r['speedup_bf16']:.2f} | {int4} | {sp4} |")
        lines.append("")
    if moe:
        lines += [f"bf16 baseline: {moe[0].get('bf16_kind')}", "",
                  "| M | kernel | experts used | MB read | ours µs | GB/s | plain read µs | % of read | bf16 µs "
                  "| × bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in moe:
            lines.append(f"| {r['m']} | {r.get('kernel', 'Triton')} | {r['used_experts']:.0f} | "
                         f"{r['weight_bytes'] / 1e6:.0f} | {r['ours_us']:.1f} | {r['gbps']:.0f} | {r['read_us']:.1f} | "
                         f"{r['read_frac']:.0%} | {r['bf16_us']:.1f} | {r['speedup_bf16']:.2f} |")
    return "\n".join(lines)


def gpu_state() -> str:
    """GPU 0's clocks, temperature, power and what else runs on it, as nvidia-smi reports them: a table's timings
    are read beside them (a throttled clock or another process explains a slow cell that the code does not)."""
    query = "clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu"
    try:
        state = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={query}", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20).stdout.strip()
        apps = subprocess.run(["nvidia-smi", "-i", "0", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi unavailable ({exc})"
    return f"{query}: {state}; compute processes: {len([a for a in apps if a.strip()])}"


def guarded(log, what, fn, *args):
    try:
        return fn(*args)
    except Exception:
        log(f"{what} FAILED:\n{traceback.format_exc()[-3000:]}")
        return None


def profile(device, log) -> None:
    """The dense K2 shapes at every M (shape by shape; the CUDA kernel where the tables pick it), then the fused MoE
    on the K2 layer at M = 1 and 16, each call twice, for ncu."""
    gen = verify.generator(device, "profile")
    layer = K2Layer(device, with_bf16=False)
    calls = []
    for k, n in DENSE_SHAPES:
        w = pack_for_gpu(*verify.random_int4(n, k, 32, "bfloat16", gen, device), 32, "bfloat16", device,
                         cuda_order=True)
        for m in MS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            calls.append(lambda x=x, w=w: w4a16_linear(x, w))
    for m in (1, 16):
        ids, wts = layer.routing(m)
        xm = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)
        calls.append(lambda xm=xm, ids=ids, wts=wts: fused_moe(xm, layer.experts, ids, wts))
    for _ in range(2):
        for call in calls:
            call()
    torch.cuda.synchronize()
    log("profile calls done")


def trip_scan(device, log) -> None:
    """Each dense K2 shape's committed tensor-core tile at M = 4, 16 and 64 with K split in 1, 2, 4 (and 8 where K =
    7168) runs and 4, 6, 8 and 12 pipeline stages, and the same grid over one K block of 128 (one trip per program):
    a call's time against the trips each program makes, so its fixed part and its cost per trip show."""
    for k, n in DENSE_SHAPES:
        weights, nbytes = dense_weights(device, k, n, "trips")
        r = len(weights)
        short, _ = dense_weights(device, 128, n, "trips")
        log(f"K={k} N={n}: plain read {plain_read_us(nbytes, device):.1f} us")
        for m in (4, 16, 64):
            base = {key: v for key, v in pick_config(dense_configs(k, n, torch.bfloat16), m).items()
                    if key != "SPLIT_CTAS"}
            xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(r)]
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(r)]
            cells = []
            for split in (1, 2, 4, 8) if k > 2048 else (1, 2, 4):
                for stages in (4, 6, 8, 12):
                    cfg = dict(base, SPLIT_K=split, num_stages=stages)
                    try:
                        us = graph_time_us([lambda x=x, w=w, o=o, c=cfg: w4a16_linear(x, w, out=o, config=c)
                                            for x, w, o in zip(xs, weights, outs)])
                        cells.append(f"{k // 128 // split} trips, {stages} stages {us:.1f}")
                    except triton.runtime.errors.OutOfResources:
                        cells.append(f"{k // 128 // split} trips, {stages} stages: no fit")
            xs1 = [x[:, :128].contiguous() for x in xs[:4]]
            one_trip = graph_time_us([lambda x=x, w=w: w4a16_linear(x, w, config=dict(base, SPLIT_K=1))
                                      for x, w in zip(xs1, short)])
            log(f"  M={m} {base['BLOCK_M']}x{base['BLOCK_N']}: " + " | ".join(cells) + f" | K=128 {one_trip:.1f}")
        del weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="pick configs per M first, then measure with them")
    parser.add_argument("--dense-only", action="store_true", help="--sweep: the dense configs only (the MoE keeps "
                        "its committed configs)")
    parser.add_argument("--configs", type=Path, nargs="+",
                        help="configs.json of earlier sweeps to use (a later file's tables over an earlier one's)")
    parser.add_argument("--profile", action="store_true", help="only the calls to profile (run under ncu)")
    parser.add_argument("--trips", action="store_true", help="only the dense tiles' time against K trips per program")
    parser.add_argument("--cuda-sweep", action="store_true", help="only the CUDA kernel's tiles on the K2 shapes")
    parser.add_argument("--moe-cuda-sweep", action="store_true",
                        help="only the MoE's launches on the CUDA kernel's tiles (K2 layer, M = 1, 4, 8, 16, the "
                        "table's bounds), and configs.json with the winners")
    parser.add_argument("--ms", type=lambda text: tuple(int(m) for m in text.split(",")), default=None,
                        help="--cuda-sweep, --moe-cuda-sweep: these M only (comma-separated)")
    parser.add_argument("--experimental", action="store_true",
                        help="--cuda-sweep: only the tiles of options no committed table uses (experimental())")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny correctness only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / ("profile.log" if args.profile else "trips.log" if args.trips
                                else "cuda_sweep.log" if args.cuda_sweep else "moe_cuda_sweep.log"
                                if args.moe_cuda_sweep else "bench.log"), "w")

    def log(text: str) -> None:
        print(text, flush=True)
        log_file.write(text + "\n")
        log_file.flush()

    gpus = torch.cuda.device_count()
    log(f"torch {torch.__version__} triton {triton.__version__} GPUs {gpus} "
        f"{torch.cuda.get_device_name(0) if gpus else 'none'}")
    log(f"GPU 0 at the start: {gpu_state()}")
    tables = [None, None, None]     # dense, MoE, dense per shape (install_configs); None: the committed ones
    if args.configs:
        tables = load_tables(args.configs)
        install_configs(*tables)
    if args.profile:
        profile(torch.device("cuda:0"), log)
        return
    if args.trips:
        trip_scan(torch.device("cuda:0"), log)
        return
    if args.cuda_sweep:
        rows, anchors = cuda_sweep(torch.device("cuda:0"), log, args.ms or MS, args.experimental)
        (args.out / "cuda_sweep.json").write_text(json.dumps({"tiles": rows, "anchors": anchors}, indent=1))
        shapes = dense_cuda_tables(rows, anchors)
        for (k, n), table in DENSE_SHAPE_CONFIGS.items():
            for (bound, old), (_, new) in zip(table, shapes[f"{k}x{n}"]):
                if new is not old:
                    log(f"cuda sweep takes {k}->{n} at M <= {bound}: {new['CUDA']} (was {old.get('CUDA')})")
        (args.out / "configs.json").write_text(json.dumps(
            {"dense_table": None, "moe_table": None, "dense_shape_table": shapes}, indent=1, default=config_json))
        log(f"GPU 0 at the end: {gpu_state()}")
        return
    if args.moe_cuda_sweep:
        rows = moe_cuda_sweep(torch.device("cuda:0"), log, args.ms or (1, 4, 8, 16))
        (args.out / "moe_cuda_sweep.json").write_text(json.dumps(rows, indent=1))
        table = moe_cuda_table(rows)
        for (bound, (old13, old2)), (_, (new13, new2)) in zip(MOE_CONFIGS, table):
            if (new13, new2) != (old13, old2):
                log(f"moe cuda sweep takes at M <= {bound}: gate/up {new13.get('CUDA')}, down {new2.get('CUDA')}")
        (args.out / "configs.json").write_text(json.dumps(
            {"dense_table": None, "moe_table": table, "dense_shape_table": None}, indent=1, default=config_json))
        log(f"GPU 0 at the end: {gpu_state()}")
        return
    check_device = f"cuda:{gpus - 1}" if gpus else "cpu"
    pool = mp.get_context("spawn").Pool(args.workers, initializer=_worker_init, initargs=(check_device,))
    warm_async = pool.map_async(_warm, warm_jobs(not args.dense_only), chunksize=1) if args.sweep else None
    t0 = time.perf_counter()
    results = {}
    device = torch.device("cuda:0") if gpus else None
    layer = None
    if device is not None and not args.skip_timing:
        torch.cuda.set_device(device)
        results["copy_gbps"] = copy_gbps(device)
        log(f"d2d copy 2 GiB: {results['copy_gbps']:.0f} GB/s (read+write)")
        layer = guarded(log, "K2 layer", K2Layer, device)
        if args.sweep and layer is not None:
            warm = warm_async.get()
            log(f"sweep compiles: {sum(w == 'ok' for w in warm)}/{len(warm)} ok; "
                + "; ".join(sorted({w for w in warm if w != 'ok'}))[:800])
            sweep = guarded(log, "sweep", run_sweep, device, log, layer, not args.dense_only)
            if sweep:
                results["sweep"] = sweep
                tables = [sweep["dense_table"], sweep["moe_table"], sweep["dense_shape_table"]]
                install_configs(*tables)
                (args.out / "configs.json").write_text(json.dumps(
                    {"dense_table": tables[0], "moe_table": tables[1], "dense_shape_table": tables[2]}, indent=1,
                    default=config_json))
                log(f"sweep took {time.perf_counter() - t0:.0f} s")
    correctness_async = None
    jobs = [(*job, tables) for job in correctness_jobs(args.smoke)]
    if not args.skip_correctness and gpus != 1:     # beside the timings only on a GPU of its own
        correctness_async = pool.map_async(_run_check, jobs, chunksize=1)
    if device is not None and not args.skip_timing:
        results["dense"] = guarded(log, "dense timing", time_dense, device, log) or []
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        results["moe"] = (guarded(log, "moe timing", time_moe, device, log, layer) or []) if layer else []
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        log(f"timings took {time.perf_counter() - t0:.0f} s")
        if layer:
            results["pdl_chain"] = guarded(log, "PDL chains", pdl_chain_check, device, log, layer)
        del layer
        torch.cuda.empty_cache()
    if not args.skip_correctness and gpus == 1:
        correctness_async = pool.map_async(_run_check, jobs, chunksize=1)
    if correctness_async is not None:
        results["correctness"] = correctness_async.get()
        log(f"correctness took {time.perf_counter() - t0:.0f} s")
        for r in results["correctness"]:
            bad = (not r["ok"]) != bool(r.get("flip"))
            if bad or r.get("error"):
                log(f"  {'UNEXPECTED' if bad else ''} {r}")
    pool.close()
    pool.join()
    results["tables"] = {"dense": DENSE_CONFIGS, "moe": MOE_CONFIGS,
                         "dense_shapes": {f"{k}x{n}": t for (k, n), t in DENSE_SHAPE_CONFIGS.items()}}
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    log(f"GPU 0 at the end: {gpu_state()}")
    summary = markdown(results.get("dense"), results.get("moe"), results.get("copy_gbps"), results.get("correctness"))
    (args.out / "summary.md").write_text(summary + "\n")
    log(summary)


if __name__ == "__main__":
    main()
