"""Launch configs of the W4A16 kernels: the tuned tables per M bucket (dense and fused MoE, per activation dtype),
chosen by `bench/w4a16.py --sweep` on an H200 and committed here, and the rules that turn a table entry into a
launch: `tile_config` (a config valid for a group size and device, unknown keys refused), `split_k` (how far K is
split) and `launch_keys` (the kernel's constexpr keys of a config)."""
from __future__ import annotations

import torch
import triton

from k2vec.engines.gpu_triton.kernels.w4a16_cuda import CudaTile, runs_on


# Dense tile configs per M bucket (upper bound of M -> launch config); the last bucket covers any larger M.
# DENSE_CONFIGS (bfloat16/float16 activations): the winners of `bench/w4a16.py --sweep` on an H200 (bench/RESULTS.md,
# issue 27, sessions 12-14 and 21), each the fastest summed over the three K2 shapes; it serves other shapes, and a K2
# shape uses its table in DENSE_SHAPE_CONFIGS (below; dense_configs picks). SPLIT_CTAS: split K until the grid
# has about this many programs (see split_k). M = 1: the one-row GEMV with natural-order x and a prefetched next K
# tile, split to ~132 programs of several K tiles each, with the biased codes and launched with PDL (its first weight
# tile loads while the kernel before it ends). M = 2-64: tensor cores on the weight's MMA-order words (MMA_ORDER,
# session 14; their copy K-block-major since session 21, which moved M = 2 from the GEMV to them), 64 output columns
# and 4 warps per program: M = 2 in 16-row tiles split to ~528 with PDL (the first block's weights loaded before the
# wait); M = 3-4 in 128-column tiles split to ~264; M = 5-16 in 16-row tiles, 4 stages, split to ~528; M = 17-32 in
# 32-row tiles split to ~528 with PDL; M = 33-64 in 64-row tiles split to ~264. The split-K partials summed by a second
# launch (SPLIT_REDUCE) won the sums at M = 9-64 by 4-6% (session 21) but stay out of this table, which the small
# models' shapes use (a K of a few blocks, 1-2 splits), where a second launch may cost more than a sum saves: in the
# one call that had it here, the default config's GPU decode took 8-11% longer.
# CUDA (a CudaTile, or "fit" for w4a16_cuda.fit_tile's rule): the CUDA kernel (w4a16_cuda.cu) takes the call where
# it can (bf16 x, the weight's CUDA-order copy: G 32, N % 16 = 0, K % 64 = 0; not in the interpreter),
# the entry's Triton launch otherwise. Its tiles in the K2 shapes' tables below are the winners of
# bench/w4a16.py's CUDA sweep on an H200 (bench/RESULTS.md, issue 27, sessions 24, 25 and 27: two 16-row tiles per
# warp on 2048 -> 7168 at M = 5-8; session 27: the codes' shared-memory ring at M = 9-16 on 2048 -> 7168 and
# 7168 -> 4096 and at M = 17-32 on 2048 -> 7168, where the CUDA kernel overtakes Triton's tiles; x's ring and two
# blocks per SM on 7168 -> 2048 at M = 5-8); M = 2-16 elsewhere by the rule.
# The CUDA kernel is launched with PDL unless CUDA_PDL is False (the bench's PDL chain check, its reference).
_GEMV = dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=1024, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True, CODES_ASM=True,
             BIASED_CODES=True, PDL=True, SPLIT_CTAS=132, num_warps=8, num_stages=3)
_MMA = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, MMA_ORDER=True, SPLIT_CTAS=264, num_warps=4, num_stages=3)
_MMA_528 = dict(_MMA, SPLIT_CTAS=528, PDL=True)
_MMA_WIDE = dict(_MMA, BLOCK_N=128)
_MMA_4_STAGES = dict(_MMA, SPLIT_CTAS=528, num_stages=4)
DENSE_CONFIGS: list[tuple[int, dict]] = [
    (1, _GEMV),
    (2, dict(_MMA_528, CUDA="fit")),
    (4, dict(_MMA_WIDE, CUDA="fit")),
    (16, dict(_MMA_4_STAGES, CUDA="fit")),
    (32, dict(_MMA_528, BLOCK_M=32)),
    (1 << 62, dict(_MMA, BLOCK_M=64)),
]
# The K2 shapes' own tables, where their winners in the sweep beat DENSE_CONFIGS by 3% or more (bench/RESULTS.md,
# sessions 17, 18 and 21): (K, N) -> a per-M table in its place. 7168 -> 2048 (K2's attention output and the dense
# layers' down projection): 64 columns per program and about 264 programs at M <= 16, so that K is split in runs of
# equal length (the default's 32-column GEMV splits its 7 K tiles 3 + 3 + 1); M = 1 on the one-row GEMV, from M = 2 on
# tensor cores, with PDL; from M = 17 the partials summed by a second launch (M = 17-32 split to ~528). 2048 -> 7168
# (the dense layers' gate and up projections): at M = 1 (Triton's GEMV there beats the CUDA kernel) 16 columns per
# program in 2 warps (448 programs, unsplit, each K = 2048 as two prefetched tiles of 1024) rather than the default's
# 32 in 8 (session 19); the Triton launches below at M >= 2 serve where the CUDA kernel cannot; at M = 2 448 programs
# (224 column tiles, one per row) already fill the machine unsplit, each reading its 2048 elements as four prefetched
# tiles of 512 in 4 warps rather than two of 1024 in 8 (session 18); M = 3-32 split to ~528 with PDL, the last
# program summing (K = 2048 splits in 4 at most: the second launch costs more than it saves), M = 33-64 split to ~132
# without PDL (session 21). 7168 -> 4096: M = 2-4 in 128-column tiles, M = 33-64 summed by a second launch
# (session 21).
_MMA_264 = dict(_MMA, PDL=True)
DENSE_SHAPE_CONFIGS: dict[tuple[int, int], list[tuple[int, dict]]] = {
    (7168, 2048): [
        (1, dict(_GEMV, BLOCK_N=64, BLOCK_K=512, SPLIT_CTAS=264, num_warps=4, CUDA=CudaTile(1, 8, 1, 8, ch=4))),
        (4, dict(_MMA_264, CUDA=CudaTile(1, 8, 1, 8, ch=4))),
        (8, dict(_MMA_264, CUDA=CudaTile(1, 8, 2, 4, ch=2, tpw=2, minb=2, nxr=4))),
        (16, dict(_MMA_264, CUDA=CudaTile(2, 4, 2, 8, ch=2))),
        (32, dict(_MMA_528, BLOCK_M=32, SPLIT_REDUCE=True)),
        (1 << 62, dict(_MMA_264, BLOCK_M=64, SPLIT_REDUCE=True)),
    ],
    (2048, 7168): [
        (1, dict(_GEMV, BLOCK_N=16, num_warps=2)),
        (2, dict(_GEMV, BLOCK_K=512, SPLIT_CTAS=264, num_warps=4, CUDA=CudaTile(7, 2, 2, 8, ch=4))),
        (4, dict(_MMA_528, CUDA=CudaTile(4, 2, 1, 8, ch=2))),
        (8, dict(_MMA_528, CUDA=CudaTile(2, 4, 1, 4, ch=2, tpw=2))),
        (16, dict(_MMA_528, CUDA=CudaTile(4, 2, 1, 12, ch=2, ring=True))),
        (32, dict(_MMA_528, BLOCK_M=32, CUDA=CudaTile(4, 2, 1, 12, ch=4, ring=True))),
        (1 << 62, dict(_MMA, BLOCK_M=64, SPLIT_CTAS=132)),
    ],
    (7168, 4096): [
        (1, dict(_GEMV, CUDA=CudaTile(2, 8, 1, 8, ch=4))),
        (2, dict(_MMA_WIDE, CUDA=CudaTile(2, 8, 1, 8, ch=4))),
        (4, dict(_MMA_WIDE, CUDA=CudaTile(2, 8, 1, 8, ch=2))),
        (8, dict(_MMA_4_STAGES, CUDA=CudaTile(2, 8, 1, 8, ch=2))),
        (16, dict(_MMA_4_STAGES, CUDA=CudaTile(4, 2, 2, 12, ch=4, ring=True))),
        (32, dict(_MMA_528, BLOCK_M=32)),
        (1 << 62, dict(_MMA, BLOCK_M=64, SPLIT_REDUCE=True)),
    ],
}
# float32 activations (the golden-matching engine): the 2026-11-30 sweep's configs, no split-K
DENSE_CONFIGS_FP32: list[tuple[int, dict]] = [
    (1, dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=1024, X_PLANES=True, SCALE_GROUPS=True, num_warps=8, num_stages=3)),
    (4, dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, X_PLANES=True, SCALE_GROUPS=True, num_warps=4, num_stages=3)),
    (32, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)),
    (1 << 62, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)),
]


# Fused MoE: M upper bound -> tile configs of (gate/up, down). SORTED False: one (token, expert) pair per program,
# on CUDA cores (BLOCK_M 1) or tensor cores with the pair in row 0 of 16 (BLOCK_M 16); SORTED (BLOCK_M >= 16):
# pairs grouped by expert. MOE_CONFIGS (bfloat16/float16 activations): the winners of the H200 sweep of bench/w4a16.py
# (bench/RESULTS.md, 2026-12-02, issue 27, session 12; M = 2-4's gate/up tile widened to 64 columns in session 17,
# after the chained sums): up to M = 16 both launches as one-row GEMV tiles (X_WIDE, PREFETCH, CODES_ASM,
# BIASED_CODES; one pair per program: top-8 of 384 experts gives about one pair per expert there, and at M = 16
# reading an expert once per token still beat the expert-sorted tensor-core tiles), gate and up in separate programs
# (SPLIT_GU), both launched with PDL so that the down launch, in programs of 2 warps, loads its first weight tile
# while gate/up ends (ROUTED); the down launch summing each token's rows itself (COMBINE) where the sweep picked it;
# from M = 17 the expert-sorted tensor-core tiles, gate/up with PDL (session 13), the down launch without it up to
# M = 32 and with it beyond.
_PAIR_TC = dict(BLOCK_M=16, SORTED=False, BLOCK_N=64, BLOCK_K=256, X_PLANES=True, num_warps=4, num_stages=3)
_SORTED_TC = dict(_PAIR_TC, SORTED=True)
_ROW_GEMV = dict(BLOCK_M=1, SORTED=False, BLOCK_N=64, BLOCK_K=256, X_WIDE=True, SCALE_GROUPS=True, PREFETCH=True,
                 CODES_ASM=True, BIASED_CODES=True, num_warps=4, num_stages=3)
_ROW_GATE_UP = dict(_ROW_GEMV, BLOCK_N=32, BLOCK_K=512, SPLIT_GU=True, PDL=True)
_ROW_DOWN = dict(_ROW_GEMV, BLOCK_N=32, num_warps=2, PDL=True)
MOE_CONFIGS: list[tuple[int, tuple[dict, dict]]] = [
    (1, (dict(_ROW_GATE_UP, BLOCK_N=64), dict(_ROW_DOWN, COMBINE=True))),
    (4, (dict(_ROW_GATE_UP, BLOCK_N=64), _ROW_DOWN)),
    (8, (dict(_ROW_GATE_UP, BLOCK_N=64), dict(_ROW_DOWN, COMBINE=True))),
    (16, (_ROW_GATE_UP, dict(_ROW_DOWN, BLOCK_N=64))),
    (32, (dict(_SORTED_TC, SPLIT_GU=True, PDL=True), _SORTED_TC)),
    (1 << 62, (dict(_SORTED_TC, SPLIT_GU=True, PDL=True), dict(_SORTED_TC, PDL=True))),
]
# float32 activations: the 2026-11-30 sweep's one-pair CUDA-core path at every M
_ONE_PAIR = dict(BLOCK_M=1, BLOCK_N=32, BLOCK_K=512, X_PLANES=True, SCALE_GROUPS=True, num_warps=4, num_stages=3)
MOE_CONFIGS_FP32: list[tuple[int, tuple[dict, dict]]] = [(1 << 62, (_ONE_PAIR, _ONE_PAIR))]


def moe_names_cuda() -> bool:
    """Whether a MOE_CONFIGS entry runs a launch on the CUDA kernel: only then does a bf16 engine need the experts'
    CUDA-order copies (as many bytes again as the experts)."""
    return any("CUDA" in cfg for _, pair in MOE_CONFIGS for cfg in pair)


def pick_config(configs: list[tuple[int, dict]], m: int) -> dict:
    return next(cfg for bound, cfg in configs if m <= bound)


def dense_configs(k: int, n: int, activation: torch.dtype) -> list[tuple[int, dict]]:
    """The per-M table of a K -> N weight: float32 activations DENSE_CONFIGS_FP32, else the shape's own table
    (DENSE_SHAPE_CONFIGS) or DENSE_CONFIGS."""
    if activation == torch.float32:
        return DENSE_CONFIGS_FP32
    return DENSE_SHAPE_CONFIGS.get((k, n), DENSE_CONFIGS)


# the keys a tile config may hold: the kernel's constexpr flags, Triton's launch options, the host-side split keys
# (split_k) and fused_moe's own (SORTED, SPLIT_GU, COMBINE)
CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_K", "X_PLANES", "X_WIDE", "SCALE_GROUPS", "PACKED", "PREFETCH",
                         "CODES_ASM", "BIASED_CODES", "MMA_ORDER", "PDL", "num_warps", "num_stages", "maxnreg",
                         "SPLIT_K", "SPLIT_CTAS", "SPLIT_FIT", "SPLIT_REDUCE", "SORTED", "SPLIT_GU",
                         "COMBINE", "CUDA", "CUDA_PDL"})
CUDA_KEYS = ("CUDA", "CUDA_PDL")    # the CUDA kernel's part of an entry (w4a16.cuda_tile); the rest is Triton's


def tile_config(config: dict, group_size: int, interpret: bool, device=None) -> dict:
    """A launch config valid for `group_size`: BLOCK_K a multiple of G; tensor-core BLOCK_M at least 16.
    Keeps the host-side keys SPLIT_K / SPLIT_CTAS / SPLIT_FIT (see split_k) and PACKED (False: float32
    dequantization). MMA_ORDER reads the weight's `mma` words (int4_layout.mma_order_words). PDL (launch as a
    programmatic dependent, see _grid_wait) is dropped in the interpreter and on a `device` older than sm_90."""
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"tile config {config}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(CONFIG_KEYS))}")
    cfg = {"X_PLANES": False, "X_WIDE": False, "SCALE_GROUPS": False, "PACKED": True, "PREFETCH": False,
           "CODES_ASM": False, "BIASED_CODES": False, "MMA_ORDER": False, "PDL": False, "SPLIT_REDUCE": False,
           **config}
    for key in CUDA_KEYS:   # what remains is the Triton launch in the CUDA kernel's stead
        cfg.pop(key, None)
    if cfg["MMA_ORDER"]:    # tensor cores on the MMA-order words, x as it is, one 128-element block per step
        if cfg["BLOCK_M"] < 2 or cfg["PREFETCH"] or cfg.get("BLOCK_K", 128) != 128:
            raise ValueError(f"MMA_ORDER is a tensor-core tile of BLOCK_K 128 without PREFETCH, got {config}")
        cfg["BLOCK_K"], cfg["X_PLANES"] = 128, False
    cfg["PEEL"] = bool(cfg["MMA_ORDER"] and cfg["PDL"])     # before the interpreter drops PDL: its peel runs there too
    if cfg["X_WIDE"]:   # natural-order x, split into planes in registers: no plane-major copy
        cfg["X_PLANES"] = False
    if cfg["PREFETCH"] and not (cfg["X_WIDE"] and cfg["SCALE_GROUPS"] and cfg["BLOCK_M"] == 1):
        raise ValueError(f"PREFETCH (the one-row CUDA-core GEMV) needs BLOCK_M 1, X_WIDE and SCALE_GROUPS, "
                         f"got {config}")
    if cfg["CODES_ASM"] and not cfg["PREFETCH"]:
        raise ValueError(f"CODES_ASM is an option of the PREFETCH one-row path, got {config}")
    if cfg["BIASED_CODES"] and not cfg["PREFETCH"]:
        raise ValueError(f"BIASED_CODES is an option of the PREFETCH one-row path, got {config}")
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group_size)
    if cfg["BLOCK_M"] > 1:    # tl.dot needs 16 rows and a K of 16 words (128 elements)
        cfg["BLOCK_M"] = max(cfg["BLOCK_M"], 16)
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 128)
    if interpret:    # the interpreter ignores warps, stages and register caps, and runs no inline PTX
        cfg.pop("num_warps", None), cfg.pop("num_stages", None), cfg.pop("maxnreg", None)
        cfg["PACKED"] = False
        cfg["CODES_ASM"] = False
        cfg["PDL"] = False
    elif cfg["PDL"] and device is not None and not has_pdl(device):
        cfg["PDL"] = False
    return cfg


def has_pdl(device) -> bool:
    """Programmatic dependent launch on this CUDA device: griddepcontrol needs sm_90, as the CUDA kernel does."""
    index = device if isinstance(device, int) else torch.device(device).index
    return runs_on(torch.cuda.current_device() if index is None else index)


def split_k(cfg: dict, k: int, tiles: int) -> int:
    """Splits of K for a grid of `tiles` output tiles: SPLIT_K if given, else enough to reach SPLIT_CTAS programs
    (SPLIT_FIT: as many as keep the grid within SPLIT_CTAS programs, so that a tile resident once per SM's worth of
    slots runs in one wave), rounded down so that no split is left empty (the K tiles dealt out in runs of equal
    length but the last); at most one split per BLOCK_K tile."""
    k_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    if cfg.get("SPLIT_K"):
        return max(1, min(cfg["SPLIT_K"], k_tiles))
    ctas = cfg.get("SPLIT_CTAS", 0)
    want = max(1, min(ctas // tiles if cfg.get("SPLIT_FIT") else triton.cdiv(ctas, tiles), k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, want))


def launch_keys(cfg: dict, activation: torch.dtype, bf16_scales: bool) -> dict:
    """The kernel's constexpr/launch keys of a tile config (host-side keys dropped); PACKED only where it applies."""
    out = {key: value for key, value in cfg.items() if key not in ("SPLIT_K", "SPLIT_CTAS", "SPLIT_FIT")}
    out["PACKED"] = bool(cfg["PACKED"] and cfg["BLOCK_M"] > 1 and activation == torch.bfloat16 and bf16_scales)
    if cfg["PDL"]:      # launched as a programmatic dependent of the kernel before it (see _grid_wait)
        out["launch_pdl"] = True
    return out
