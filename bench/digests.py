"""What verifying a checkpoint shard costs: sha256 (k2vec.digests, the record checkpoints and sidecars
use) against zlib CRC-32 (what KDTR stores per tensor), over one file of about 1 GB.

    PYTHONPATH=src python bench/digests.py [--gib 1] [--repeat 3]

Writes GIB of random bytes once into a scratch directory, then, with the page cache warm (as it is
right after a stage writes a shard), times hashing the mmapped file, best of --repeat, interleaved.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.bin"
        size = int(a.gib * (1 << 30))
        with open(path, "wb") as fh:
            for start in range(0, size, 1 << 26):
                fh.write(os.urandom(min(1 << 26, size - start)))
        with open(path, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        best = {"sha256": float("inf"), "crc32": float("inf")}
        for _ in range(a.repeat):
            for name, fn in (("sha256", lambda: hashlib.sha256(mm).hexdigest()), ("crc32", lambda: zlib.crc32(mm))):
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        mm.close()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, file {size / 1e9:.3f} GB, "
          f"best of {a.repeat}:")
    for name, t in best.items():
        print(f"  {name:7s} {t:6.3f} s  {size / t / 1e9:5.2f} GB/s  ({t / (size / 1e9):.2f} s per GB)")


if __name__ == "__main__":
    main()
