"""What the CUDA kernel's CUBIN cache saves a GPU job: the default config's variants compiled by NVRTC, then loaded.

    python bench/nvrtc_cache.py [--nvrtc LIBNVRTC.so] [--arch sm_90] [--rounds 3]

The variants are those a `gpu_bf16` job of the default config asks for (w4a16_cuda.fit_tile on each model's four
MLP shapes at M = 4 and 16, float32 scales). Each round compiles every variant through w4a16_cuda.cached_cubin into
an empty cache directory, then loads them all again as another process would (the store's listing dropped, and a
compiler that raises, so nothing is compiled twice unseen). No GPU is needed: NVRTC runs on the CPU. Without
--nvrtc, w4a16_cuda's own choice: torch's CUDA build's NVRTC, else the nvidia-cuda-nvrtc-cu12 wheel's ([test]).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from k2vec.config.expand import PRESETS  # noqa: E402
from k2vec.engines.gpu_triton.kernels import w4a16_cuda  # noqa: E402

MODELS = ("tiny", "small")
MS = (4, 16)


def variants() -> list[tuple[tuple[str, int], ...]]:
    """The distinct constants of the default models' MLP shapes (gate/up and down of the dense and shared experts)."""
    out = []
    for model in MODELS:
        p = PRESETS[model]
        h, inter, moe = p["hidden_size"], p["intermediate_size"], p["moe_intermediate_size"]
        for k, n in ((h, inter), (inter, h), (h, moe), (moe, h)):
            for m in MS:
                tile = w4a16_cuda.fit_tile(n, k, m)
                if tile is not None:
                    out.append(tuple(tile.defines(k, m, True).items()))
    return list(dict.fromkeys(out))


def refuse(source: str, arch: str) -> bytes:
    raise AssertionError("compiled although the cache holds it")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so to use instead of torch's")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.nvrtc:
        lib = ctypes.CDLL(args.nvrtc)
        w4a16_cuda._nvrtc = lambda: lib
    kernel, compiler, todo = w4a16_cuda.SOURCE.read_text(), w4a16_cuda.nvrtc_version(), variants()
    print(f"{compiler}, {args.arch}, {len(todo)} variants\n")
    print("| round | compiled, all | each | loaded from the cache, all |\n|---|---|---|---|")
    for r in range(args.rounds):
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="nvrtc-cache-")
        w4a16_cuda._cubin_store.cache_clear()
        each = []
        for defines in todo:
            t0 = time.perf_counter()
            w4a16_cuda.cached_cubin(kernel, defines, args.arch, compiler)
            each.append(time.perf_counter() - t0)
        w4a16_cuda._cubin_store.cache_clear()
        t0 = time.perf_counter()
        for defines in todo:
            w4a16_cuda.cached_cubin(kernel, defines, args.arch, compiler, compile=refuse)
        loaded = time.perf_counter() - t0
        print(f"| {r + 1} | {sum(each):.2f} s | {min(each):.2f}-{max(each):.2f} s | {1000 * loaded:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
