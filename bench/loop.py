"""From an edit to a verdict: how long `snakemake` takes after a code edit, beside the engines' own decode time.

    python bench/loop.py WORKDIR [--cores N] [--configfile overlay.yaml] [--edits gpu,numpy,report,none] [--repeat R]
        [--no-restore]

WORKDIR is a checkout whose default run has finished (results/ complete). For each edit, a new function is
appended to one file (a real code change: its meaning, so its code digest, changes), plain `snakemake --cores N`
runs, and the file is restored (and, unless --no-restore, the results rebuilt for it, untimed). Edits:
  gpu     src/k2vec/engines/gpu_triton/kernels/w4a16.py   (a kernel: both GPU engines' runs and the report)
  numpy   src/k2vec/engines/numpy_engine.py               (the numpy engine's runs and the report)
  report  src/k2vec/report/metrics.py                     (the report only)
  none    no edit: a dry run (`snakemake -n`) of the finished workflow
Prints a Markdown table: wall seconds, the jobs Snakemake ran, the engine runs rewritten, and the sum of those
runs' own decode time (`timing.decode_s`) and of their runner wall time (`wall_s`), so the share outside decoding
shows, and the CPU seconds of the whole `snakemake` call, its processes and every one they started (on a machine
whose cores are all busy, an engine edit cannot finish before a report edit plus its engine's CPU time spread over
the cores). Works on any checkout of the project, old ones included (single-run engines).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

EDITS = {
    "gpu": "src/k2vec/engines/gpu_triton/kernels/w4a16.py",
    "numpy": "src/k2vec/engines/numpy_engine.py",
    "report": "src/k2vec/report/metrics.py",
    "none": None,
}


def rewritten_runs(workdir: Path, since: float) -> list[dict]:
    """The engine results written after `since`."""
    out = []
    for p in (workdir / "results/runs").glob("*/*.json"):
        if p.stat().st_mtime >= since:
            out.append(json.loads(p.read_text()))
    return out


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished descendants so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def snakemake(workdir: Path, args: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, CPU s, the finished process) of one `snakemake` call."""
    cpu, start = children_cpu_s(), time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True)
    return time.perf_counter() - start, children_cpu_s() - cpu, res


def jobs_run(stdout: str, stderr: str) -> int:
    m = re.search(r"(\d+) of (\d+) steps \(100%\) done", stdout + stderr)
    return int(m.group(2)) if m else 0


def measure(workdir: Path, edit: str, cores: int, overlay: str | None, probe: int, restore: bool = True) -> dict:
    args = ["--cores", str(cores)] + (["--configfile", overlay] if overlay else [])
    if edit == "none":
        wall, cpu, res = snakemake(workdir, ["-n", *args])
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        return {"edit": edit, "wall_s": wall, "cpu_s": cpu, "jobs": 0, "runs": 0, "decode_s": 0.0, "run_wall_s": 0.0}
    path = workdir / EDITS[edit]
    original = path.read_text()
    since = time.time()
    try:
        path.write_text(original + f"\n\ndef _loop_probe_{probe}():\n    return {probe}\n")
        wall, cpu, res = snakemake(workdir, args)
    finally:
        path.write_text(original)
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    runs = rewritten_runs(workdir, since)
    if restore:
        _, _, res2 = snakemake(workdir, args)   # back to the unedited code's results (not timed)
        if res2.returncode != 0:
            raise SystemExit(res2.stderr[-3000:])
    return {"edit": edit, "wall_s": wall, "cpu_s": cpu, "jobs": jobs_run(res.stdout, res.stderr), "runs": len(runs),
            "decode_s": sum((r.get("timing") or {}).get("decode_s", 0.0) for r in runs),
            "run_wall_s": sum(r.get("wall_s") or 0.0 for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--configfile", default=None)
    ap.add_argument("--edits", default="numpy,report,none")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-restore", action="store_true", help="leave the results of the last edit (a later run redoes them)")
    args = ap.parse_args()
    rows = []
    for i in range(args.repeat):
        for edit in args.edits.split(","):
            rows.append(measure(args.workdir.resolve(), edit, args.cores, args.configfile, probe=time.time_ns(),
                                restore=not args.no_restore))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| edit | wall s | CPU s | jobs | engine runs | their decode s | their runner wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['edit']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['jobs']} | {r['runs']} | {r['decode_s']:.1f} | "
              f"{r['run_wall_s']:.1f} |")


if __name__ == "__main__":
    main()
