"""The W4A16 kernels' machine code for a GPU this machine does not have: registers and the instruction mix of the
K loop, per config, compiled by Triton for the target (default sm_90, the H200) without a GPU.

    python bench/sass.py [--shape K,N]         # the committed dense bf16 configs at M = 1, 2, 4, 16, 32, 64
    python bench/sass.py --config '{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "MMA_ORDER": true}'
    python bench/sass.py --moe                 # the fused MoE's gate/up and down launches at M = 1, 4, 8, 16
    python bench/sass.py --moe --m 1 --config GATE_UP_JSON --config DOWN_JSON

Counts are per warp and per trip of the longest loop (a K tile); they explain a profile, they are not timings.
Triton versions compile differently, so the first line names the one used: [test] installs 3.7.1, the one torch
2.13 pins (what `pip install '.[gpu]'` brings), while the lent H200's torch 2.11 has 3.6 (bench/RESULTS.md). Needs
Triton's bundled `nvdisasm` and `cuobjdump` (in the wheel's backends/nvidia/bin).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k2vec.engines.gpu_triton.kernels import configs, w4a16  # noqa: E402
from k2vec.engines.gpu_triton.kernels.fused_moe import _moe_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
             "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
             "stride_sn": "i32", "stride_ym": "i32"}
ALIGNED = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12)     # pointers and sizes the launches see as multiples of 16


def bf16_launch_keys(cfg: dict) -> tuple[dict, dict]:
    """A tile config's constexpr keys for bfloat16 x and scales, and its Triton options (warps, stages)."""
    keys = configs.launch_keys(cfg, torch.bfloat16, bf16_scales=True)
    keys.pop("launch_pdl", None)
    return keys, {"num_warps": keys.pop("num_warps", 4), "num_stages": keys.pop("num_stages", 3)}


def cubin(kernel, signature: dict, aligned: tuple, keys: dict, options: dict, arch: int) -> bytes:
    """`kernel` compiled for sm_`arch`, its arguments at the `aligned` positions known multiples of 16."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=kernel, signature=dict(signature, **{key: "constexpr" for key in keys}), constexprs=keys,
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]


def compile_config(config: dict, k: int, n: int, m: int, arch: int) -> bytes:
    """The cubin of _w4a16_kernel for bfloat16 x and bfloat16 scales, as w4a16_linear would launch `config`."""
    cfg = configs.tile_config(config, 32, interpret=False)
    keys, options = bf16_launch_keys(cfg)
    tiles = triton.cdiv(n, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"])
    keys.update(G=32, SPLIT_K=configs.split_k(cfg, k, tiles), BF16_SCALES=True, IEEE=False,
                EVEN_K=k % cfg["BLOCK_K"] == 0)
    return cubin(w4a16._w4a16_kernel, SIGNATURE, ALIGNED, keys, options, arch)


MOE_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16", "y_ptr": "*bf16", "pair_ids_ptr": "*i64",
                 "block_expert_ptr": "*i64", "route_w_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
                 "num_pairs": "i32", "N": "i32", "K": "i32", "E": "i32", "stride_xm": "i32", "stride_we": "i32",
                 "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_ym": "i32"}
MOE_ALIGNED = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 14, 15, 16, 17, 18)


def compile_moe(config: dict, down: bool, m: int, top_k: int, arch: int) -> bytes:
    """The cubin of _moe_kernel for K2's experts (hidden 7168, intermediate 2048) at M tokens of top_k unsorted
    pairs, bfloat16 x and scales: the gate/up launch, or (down) the down launch as fused_moe makes them."""
    cfg = configs.tile_config(config, 32, interpret=False)
    for key in ("MMA_ORDER", "PEEL", "SPLIT_REDUCE"):
        cfg.pop(key)
    sorted_ = cfg.pop("SORTED", cfg["BLOCK_M"] > 1)
    combine = bool(cfg.pop("COMBINE", False) and down)
    split_gu = bool(cfg.pop("SPLIT_GU", False) and not down)
    n, k = (7168, 2048) if down else (2048, 7168)
    pairs = m * top_k
    keys, options = bf16_launch_keys(cfg)
    halves = 2 if split_gu else 1
    splits = 1 if combine else configs.split_k(cfg, k, halves * triton.cdiv(n, cfg["BLOCK_N"]) * pairs)
    keys.update(X_ROW_DIV=1 if down else top_k, GATED=not down, WEIGHTED=down, SORTED=sorted_, G=32, SPLIT_K=splits,
                TOP_K=top_k if combine else 1, COMBINE=combine, EVEN_K=k % cfg["BLOCK_K"] == 0, OUT_PLANES=False,
                BF16_SCALES=True, IEEE=False, SPLIT_GU=split_gu, ROUTED=bool(down and cfg["PDL"]))
    return cubin(_moe_kernel, MOE_SIGNATURE, MOE_ALIGNED, keys, options, arch)


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode mix of the longest backward-branch loop of a disassembly; register copies
    (`MOV`, `IMAD.MOV`: moves the loop's carried values need when its end cannot rename them) also as "moves"."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    start, end = max(spans, key=lambda s: s[1] - s[0])
    full = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T] )?", "", line).split()[0]
            for line in lines[start:end + 1] if re.match(r"^\s+/\*[0-9a-f]+\*/", line)]
    mix = collections.Counter(op.split(".")[0] for op in full)
    mix["moves"] = sum(op in ("MOV", "IMAD.MOV") or op.startswith(("MOV.", "IMAD.MOV.")) for op in full)
    return len(full), mix


def describe(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([BIN / "nvdisasm", "-c", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    total, mix = loop_mix(sass)
    return {"registers": regs, "loop_instructions": total, "mix": dict(mix.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", type=json.loads, help="a launch config (JSON); repeatable")
    parser.add_argument("--m", type=int, default=16, help="M for --config (default 16)")
    parser.add_argument("--shape", default="7168,4096", help="K,N (default 7168,4096)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--moe", action="store_true",
                        help="the fused MoE's launches (gate/up and down, top-8) instead of the dense kernel")
    args = parser.parse_args()
    if args.moe:
        print(f"Triton {triton.__version__}, sm_{args.arch}, fused MoE, hidden 7168, intermediate 2048, top-8")
        jobs = [(args.m, tuple(args.config[:2]))] if args.config else \
            [(m, configs.pick_config(configs.MOE_CONFIGS, m)) for m in (1, 4, 8, 16)]
        for m, pair in jobs:
            for down, cfg in zip((False, True), pair):
                d = describe(compile_moe(dict(cfg), down, m, 8, args.arch))
                mix = " ".join(f"{op}:{count}" for op, count in d["mix"].items())
                print(f"M={m} {'down' if down else 'gate/up'} {json.dumps(cfg)}\n  {d['registers']} registers; "
                      f"K loop {d['loop_instructions']} instructions per warp and trip: {mix}")
        return
    k, n = map(int, args.shape.split(","))
    print(f"Triton {triton.__version__}, sm_{args.arch}, K={k} N={n}")
    jobs = [(args.m, cfg) for cfg in args.config] if args.config else \
        [(m, configs.pick_config(configs.dense_configs(k, n, torch.bfloat16), m)) for m in (1, 2, 4, 16, 32, 64)]
    for m, cfg in jobs:
        d = describe(compile_config(dict(cfg), k, n, m, args.arch))
        mix = " ".join(f"{op}:{count}" for op, count in d["mix"].items())
        print(f"M={m} {json.dumps(cfg)}\n  {d['registers']} registers; K loop {d['loop_instructions']} instructions "
              f"per warp and trip: {mix}")


if __name__ == "__main__":
    main()
