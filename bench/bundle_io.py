"""Bundle I/O benchmark: KDTR (k2vec.kdtr) vs safetensors on the same tensors.

    PYTHONPATH=src python bench/bundle_io.py [--gib 1] [--tensors 300] [--repeat 5] [--results bench/RESULTS.md]

Writes ~GIB of mixed-size tensors (f32, bf16 bits, u8, i32; 4 KiB .. 64 MiB, log-uniform) once as
a KDTR bundle and once as a safetensors file, then, in the same run and with the page cache warm,
times "open + touch every tensor" for both readers, best of --repeat, interleaved:
  sum   np.sum over every tensor (reads every byte)
  page  one element per 4 KiB page of every tensor (what a lazy loader pays for mapping)
KDTR: open_bundle(path) (no verify) + b[name]; safetensors: safe_open(framework="numpy") +
get_tensor(name). Also times KDTR verify (CRC-32 of every byte, Python threads and the C tool).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from k2vec.kdtr import bf16, open_bundle, write_bundle

REPO = Path(__file__).resolve().parents[1]
PAGE = 4096


def make_specs(total_bytes: int, count: int, seed: int = 0) -> list[tuple[str, str, tuple[int, ...]]]:
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(4 << 10), np.log(64 << 20), count))
    sizes *= total_bytes / sizes.sum()
    kinds = ["f32", "bf16", "u8", "i32"]
    specs = []
    for i, nbytes in enumerate(sizes):
        kind = kinds[i % 4]
        item = {"f32": 4, "bf16": 2, "u8": 1, "i32": 4}[kind]
        cols = 1024 // item
        rows = max(1, int(nbytes) // (cols * item))
        specs.append((f"layers.{i:03d}.{kind}", kind, (rows, cols)))
    return specs


def make_array(kind: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "f32":
        return rng.standard_normal(shape, dtype=np.float32)
    if kind == "bf16":
        return rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    if kind == "u8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.integers(-(1 << 31), 1 << 31, shape, dtype=np.int32)


def streamed(kind: str, shape: tuple[int, ...], seed: int):
    """A callable for write_bundle: the array is made only when the writer gets to it."""
    produce = lambda: make_array(kind, shape, seed)  # noqa: E731
    return bf16(produce) if kind == "bf16" else produce


def touch_sum(a: np.ndarray) -> float:
    return float(np.sum(a))


def touch_page(a: np.ndarray) -> float:
    flat = a.reshape(-1)
    return float(flat[:: max(1, PAGE // a.itemsize)].sum())


def time_kdtr(path: Path, names: list[str], touch) -> float:
    t0 = time.perf_counter()
    with open_bundle(path) as b:
        acc = 0.0
        for n in names:
            acc += touch(b[n])
    return time.perf_counter() - t0


def time_safetensors(path: Path, names: list[str], touch) -> float:
    t0 = time.perf_counter()
    with safe_open(str(path), framework="numpy") as f:
        acc = 0.0
        for n in names:
            acc += touch(f.get_tensor(n))
    return time.perf_counter() - t0


def best(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls of fn()."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def c_verify_seconds(path: Path, repeat: int) -> float | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "kdtr_tool"
        subprocess.run([gcc, "-std=c11", "-O2", "-march=native", f"-I{REPO / 'include'}",
                        str(REPO / "tools" / "kdtr_tool.c"), "-o", str(exe)], check=True)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run([str(exe), "verify", str(path)], check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
        return min(times)


def run(args) -> str:
    load_before = os.getloadavg()[0]
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="bundle_io."))
    workdir.mkdir(parents=True, exist_ok=True)
    specs = make_specs(int(args.gib * (1 << 30)), args.tensors)
    names = [n for n, _, _ in specs]
    kdtr_path, st_path = workdir / "bench.kdtr", workdir / "bench.safetensors"
    try:
        t0 = time.perf_counter()
        write_bundle(kdtr_path, [(n, streamed(k, s, i)) for i, (n, k, s) in enumerate(specs)], {"bench": "bundle_io"})
        t_write_kdtr = time.perf_counter() - t0
        kdtr_size = kdtr_path.stat().st_size
        t0 = time.perf_counter()
        save_file({n: make_array(k, s, i) for i, (n, k, s) in enumerate(specs)}, str(st_path))
        t_write_st = time.perf_counter() - t0
        data_bytes = sum(int(np.prod(s)) * {"f32": 4, "bf16": 2, "u8": 1, "i32": 4}[k] for _, k, s in specs)

        rows = []
        for label, touch in (("sum", touch_sum), ("page", touch_page)):
            tk, ts = [], []
            for _ in range(args.repeat):  # interleaved so drift hits both equally
                tk.append(time_kdtr(kdtr_path, names, touch))
                ts.append(time_safetensors(st_path, names, touch))
            rows.append((label, min(tk), min(ts)))
        t_open = best(lambda: open_bundle(kdtr_path).close(), args.repeat)
        threads = min(4, os.cpu_count() or 1)
        with open_bundle(kdtr_path) as b:
            t_verify1 = best(b.verify, args.repeat)
            t_verify = best(lambda: b.verify(workers=threads), args.repeat)
        t_c = c_verify_seconds(kdtr_path, args.repeat)
    finally:
        if not args.keep:
            kdtr_path.unlink(missing_ok=True)
            st_path.unlink(missing_ok=True)

    gb = data_bytes / 1e9
    cmd = "PYTHONPATH=src python bench/bundle_io.py " + " ".join(sys.argv[1:])
    out = [
        "## bundle_io",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"numpy {np.__version__}; page cache warm (files just written); best of {args.repeat}, interleaved; "
        f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (shared machine).  ",
        f"Data: {len(specs)} tensors (f32 / bf16 / u8 / i32, 4 KiB..64 MiB log-uniform), {data_bytes / 2**30:.2f} GiB; "
        f"KDTR file {kdtr_size} bytes.",
        "",
        "| open + touch every tensor | KDTR (no verify) | safetensors (numpy) | KDTR / safetensors |",
        "|---|---|---|---|",
    ]
    for label, tk, ts in rows:
        out.append(f"| {label} | {tk * 1e3:.1f} ms | {ts * 1e3:.1f} ms | {tk / ts:.2f}x |")
    out += [
        "",
        f"- KDTR open alone (header + directory + metadata): {t_open * 1e3:.2f} ms",
        f"- KDTR verify (zlib CRC-32 of every tensor byte + padding check), Python, 1 thread (default): "
        f"{t_verify1:.3f} s = {gb / t_verify1:.2f} GB/s; "
        f"{threads} threads: {t_verify:.3f} s = {gb / t_verify:.2f} GB/s",
    ]
    if t_c is not None:
        out.append(f"- KDTR verify, C `kdtr_tool verify` (gcc -O2, slice-by-8 CRC, 1 thread, incl. process start): "
                   f"{t_c:.3f} s = {gb / t_c:.2f} GB/s")
    out.append(f"- Write (streaming, fsync): KDTR {t_write_kdtr:.2f} s; safetensors save_file {t_write_st:.2f} s "
               f"(both include generating the random data)")
    return "\n".join(out) + "\n"


def update_results(path: Path, section: str) -> None:
    """Replace this benchmark's `## bundle_io` section in RESULTS.md, keeping every other section."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## bundle_io"), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        text = "".join(lines[:start]) + section + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    path.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", help="where to write the two files (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--results", type=Path, help="also write the section into this RESULTS.md")
    args = p.parse_args()
    section = run(args)
    print(section)
    if args.results:
        update_results(args.results, section)


if __name__ == "__main__":
    main()
