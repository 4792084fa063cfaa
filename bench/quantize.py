"""Benchmark of INT4 quantization (k2vec.model.int4): throughput, cost relative to np.copy, and peak memory.

  PYTHONPATH=src python bench/quantize.py            # 20 tensors, 1.17 GB of fp32, group 32, float32 scales

The tensors ([2048, 7168] and [7168, 2048]: Kimi K2's expert gate/up and down shapes) are generated
once, row block by row block, into a scratch directory, then read back one at a time:
  phase A  quantize_packed (the quantize stage's path) on each tensor, nothing else: gives GB/s and
           the peak RSS (ru_maxrss) over that phase, to compare with the largest tensor;
  phase B  per tensor, interleaved so that machine noise hits all alike, best of --repeats: np.copy
           of the array (a fresh output, as np.copy allocates), the fused quantize_packed, the two-step
           pack(quantize()), and a straightforward numpy version (the "before": per-group reductions
           and broadcasts, no blocking).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from k2vec.model.int4 import BLOCK_ELEMENTS, pack, quantize, quantize_packed  # noqa: E402
from k2vec.seeds import rng_for  # noqa: E402


def naive_quantize_pack(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The first, straightforward version (float32 scales): same results, about 2x slower."""
    n, k = w.shape
    groups = w.reshape(n, k // g, g)
    scales = np.abs(groups).max(axis=2) / np.float32(7.5)
    scales[scales == 0] = np.float32(2.0**-23)
    codes = np.rint(np.clip(groups / scales[:, :, None], -8, 7)).astype(np.int8).reshape(n, k)
    u = (codes + 8).view(np.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4), scales


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def generate(scratch: Path, shapes: list[tuple[int, int]]) -> list[Path]:
    paths = []
    for i, (n, k) in enumerate(shapes):
        rng = rng_for("bench-quantize", i)
        path = scratch / f"w{i:03d}.f32"
        with open(path, "wb") as fh:
            for r in range(0, n, 256):  # row blocks: generation never holds a whole tensor
                block = rng.standard_normal((min(256, n - r), k), dtype=np.float32)
                block *= np.float32(0.02)
                block.tofile(fh)
        paths.append(path)
    return paths


def load(path: Path, shape: tuple[int, int]) -> np.ndarray:
    return np.fromfile(path, dtype=np.float32).reshape(shape)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=20, help="number of tensors (alternating shapes)")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--scale-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3, help="phase B: best of this many runs per tensor")
    ap.add_argument("--scratch", type=Path, default=None, help="where to put the generated tensors (deleted after)")
    a = ap.parse_args()

    shapes = [(a.n, a.k) if i % 2 == 0 else (a.k, a.n) for i in range(a.tensors)]
    nbytes = [n * k * 4 for n, k in shapes]
    total, largest = sum(nbytes), max(nbytes)
    scratch = Path(tempfile.mkdtemp(prefix="k2vec-bench-", dir=a.scratch))
    try:
        paths = generate(scratch, shapes)
        print(f"{a.tensors} tensors {shapes[0]}/{shapes[-1]}: {total / 1e9:.3f} GB fp32 "
              f"({total / 2**30:.3f} GiB), largest {largest / 2**20:.1f} MiB; group {a.group_size}, "
              f"{a.scale_dtype} scales; block {BLOCK_ELEMENTS} elements; numpy {np.__version__}")

        # phase A: the stage's path alone, for throughput and peak memory
        base = current_rss_bytes()
        assert peak_rss_bytes() < base + largest, "generation already raised the high-water mark"
        t_fused_a = 0.0
        for path, shape in zip(paths, shapes):
            w = load(path, shape)
            dt, (packed, scales) = timed(quantize_packed, w, a.group_size, a.scale_dtype)
            t_fused_a += dt
            del w, packed, scales
        peak = peak_rss_bytes()
        print(f"phase A  quantize_packed: {t_fused_a:.3f} s, {total / t_fused_a / 1e9:.2f} GB/s of fp32 input")
        print(f"         peak RSS {peak / 2**20:.1f} MiB = {base / 2**20:.1f} MiB before the phase "
              f"+ {(peak - base) / 2**20:.1f} MiB = {(peak - base) / largest:.3f} x largest tensor")

        # phase B: interleaved comparison, best of --repeats per tensor and method (this machine is shared)
        methods = {
            "copy": lambda w: np.copy(w),
            "fused": lambda w: quantize_packed(w, a.group_size, a.scale_dtype),
            "two-step": lambda w: (lambda cs: (pack(cs[0]), cs[1]))(quantize(w, a.group_size, a.scale_dtype)),
        }
        if a.scale_dtype == "float32":
            methods["naive"] = lambda w: naive_quantize_pack(w, a.group_size)
        t = dict.fromkeys(methods, 0.0)
        for i, (path, shape) in enumerate(zip(paths, shapes)):
            w = load(path, shape)
            best = dict.fromkeys(methods, float("inf"))
            results = {}
            for _ in range(a.repeats):
                for name, fn in methods.items():
                    dt, out = timed(fn, w)
                    best[name] = min(best[name], dt)
                    if i == 0 and name != "copy":
                        results[name] = out
                    del out
            if i == 0:  # every method gives the same bytes and scales
                for name, (packed, scales) in results.items():
                    assert np.array_equal(packed, results["fused"][0]) and np.array_equal(scales, results["fused"][1])
            del w, results
            for name in methods:
                t[name] += best[name]
        print(f"phase B  (per tensor, methods interleaved, best of {a.repeats}; summed over the tensors)")
        for name, secs in t.items():
            print(f"  {name:9s} {secs:7.3f} s  {total / secs / 1e9:6.2f} GB/s  {secs / t['copy']:5.2f} x np.copy")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
