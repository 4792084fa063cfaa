"""The quantization path at K2 scale: one full MoE layer (preset k2layer, all 384 experts), routed experts
quantized as the real K2 checkpoint has them (scheme k2-checkpoint), written as an int4 directory.

  PYTHONPATH=src python bench/k2layer_quantize.py OUT_DIR [--experts 384] [--keep]

Why not from an fp32 checkpoint on disk: the layer's fp32 experts are 384 x 3 x 2048 x 7168 x 4 B = 67.6 GB,
more than the free disk of the shared machine. So the quantizer reads straight from the deterministic
generator (k2vec.stages.weights.make_tensor: the very values the weights stage would have written, tensor by
tensor) through the quantize stage's own writer (k2vec.model.int4_checkpoint.write_int4: quantize_packed,
.qw/.sc files, index.json, one syncfs). The generation time is measured apart and taken out; wall and CPU time are both
reported (on a shared machine CPU time is the one other jobs do not inflate).
In the same run, per tensor, np.copyto of the same fp32 bytes into a preallocated buffer gives the
plain-copy bandwidth that the quantizer's GB/s is compared with. Peak RSS: ru_maxrss of this process.
The int4 directory (~10.5 GB) is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from k2vec.model.architecture import tensor_shapes  # noqa: E402
from k2vec.model.int4_checkpoint import open_int4, write_int4  # noqa: E402
from k2vec.config.expand import resolve_model, resolve_quantization  # noqa: E402
from k2vec.stages.weights import make_tensor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="int4 directory to write (must not exist)")
    ap.add_argument("--experts", type=int, default=384, help="routed experts to quantize (default: all 384)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--scale-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--keep", action="store_true", help="keep the int4 directory")
    args = ap.parse_args()
    model = {"name": "k2layer", **resolve_model("k2layer", {"preset": "k2layer"})}
    quant = resolve_quantization({"scheme": "k2-checkpoint", "group_size": args.group_size,
                                  "scale_dtype": args.scale_dtype}, model)
    # names model.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight: keep the first --experts experts
    quant["tensors"] = {n: s for n, s in quant["tensors"].items() if int(n.split(".")[5]) < args.experts}
    shapes = tensor_shapes(model)
    unquantized = {n: {"dtype": "float32", "shape": s} for n, s in shapes.items() if n not in quant["tensors"]}
    n_tensors = len(quant["tensors"])
    assert n_tensors == 3 * args.experts, n_tensors

    timing = {"generate": 0.0, "copy": 0.0, "generate_cpu": 0.0, "copy_cpu": 0.0}
    fp32_bytes = 0
    copy_buf = np.empty(max(int(np.prod(s)) for s in quant["tensors"].values()), np.float32)

    def weight(name: str) -> np.ndarray:
        nonlocal fp32_bytes
        t0, c0 = time.perf_counter(), time.process_time()
        w = make_tensor(model, name, quant["tensors"][name])
        t1, c1 = time.perf_counter(), time.process_time()
        np.copyto(copy_buf[: w.size].reshape(w.shape), w)  # the plain copy of the same bytes
        t2, c2 = time.perf_counter(), time.process_time()
        timing["generate"] += t1 - t0
        timing["copy"] += t2 - t1
        timing["generate_cpu"] += c1 - c0
        timing["copy_cpu"] += c2 - c1
        fp32_bytes += w.nbytes
        return w

    if args.out.exists():
        raise SystemExit(f"{args.out} exists; give a new directory")
    t0, c0 = time.perf_counter(), time.process_time()
    index = write_int4(args.out, quant, weight, unquantized)
    total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    files = sum(1 for _ in args.out.iterdir())
    out_bytes = sum(p.stat().st_size for p in args.out.iterdir())
    # spot check: the last tensor reads back (sha256 checked) and is the one the writer got
    last = sorted(quant["tensors"])[-1]
    assert open_int4(args.out)[last].packed.shape[0] == quant["tensors"][last][0]
    quantize_write = total - timing["generate"] - timing["copy"]
    quantize_write_cpu = total_cpu - timing["generate_cpu"] - timing["copy_cpu"]
    result = {
        "experts": args.experts, "tensors": n_tensors, "files": files, "group_size": args.group_size,
        "scale_dtype": args.scale_dtype,
        "fp32_GB": fp32_bytes / 1e9, "int4_GB_written": out_bytes / 1e9,
        "total_s": total, "generate_s": timing["generate"], "plain_copy_s": timing["copy"],
        "quantize_and_write_s": quantize_write,
        "experts_per_s": args.experts / quantize_write,
        "quantize_GB_per_s_fp32_in": fp32_bytes / 1e9 / quantize_write,
        "plain_copy_GB_per_s": fp32_bytes / 1e9 / timing["copy"],
        # CPU time (this process): what the machine's other jobs do not inflate
        "cpu_s": {"total": total_cpu, "generate": timing["generate_cpu"], "plain_copy": timing["copy_cpu"],
                  "quantize_and_write": quantize_write_cpu},
        "experts_per_cpu_s": args.experts / quantize_write_cpu,
        "quantize_GB_per_cpu_s": fp32_bytes / 1e9 / quantize_write_cpu,
        "plain_copy_GB_per_cpu_s": fp32_bytes / 1e9 / timing["copy_cpu"],
        "peak_rss_MiB": peak_rss / 2**20,
        "largest_tensor_MiB": 4 * max(int(np.prod(s)) for s in quant["tensors"].values()) / 2**20,
        "load_avg_1min_at_end": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    assert len(index["tensors"]) == n_tensors
    if not args.keep:
        shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
