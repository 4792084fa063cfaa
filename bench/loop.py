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
the cores); and, from Snakemake's output timed line by line, when the first job started (parse and DAG before it),
when the last one finished, how long the report job took (from Snakemake's line announcing it to its "Finished"),
and how long the process took to exit after its last line. "floor s" is the first job's start, plus the rewritten
runs' decode spread evenly over the cores, plus the report job: what the call cannot go under whatever each job's
own start-up costs, since the report starts after the last run. Works on any checkout of the
project, old ones included (single-run engines).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
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


@dataclass
class Call:
    """One finished `snakemake` call: wall and CPU seconds, exit status, and its output lines (stdout and stderr
    together) each with the seconds since the call started."""
    wall_s: float
    cpu_s: float
    returncode: int
    lines: list[tuple[float, str]]

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def snakemake(workdir: Path, args: list[str]) -> Call:
    """One `snakemake` call, its output lines timed as they arrive."""
    cpu, start = children_cpu_s(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in proc.stdout]
    returncode = proc.wait()
    return Call(time.perf_counter() - start, children_cpu_s() - cpu, returncode, lines)


def checked(call: Call) -> Call:
    """The call, if Snakemake succeeded; else exit with the end of its output."""
    if call.returncode != 0:
        raise SystemExit(call.text[-3000:])
    return call


def phases(call: Call) -> dict:
    """Where a call's wall time went, from its timed output: the first job's start (Snakemake parsed the workflow
    and built the DAG before it), the last job's end, and the time from the last line to the process's exit
    (Snakemake's teardown). None where the call ran no job."""
    starts = [t for t, line in call.lines if re.match(r"(local)?rule \w+:$", line)]
    ends = [t for t, line in call.lines if line.startswith("Finished jobid")]
    return {"first_job_s": starts[0] if starts else None, "jobs_done_s": ends[-1] if ends else None,
            "report_s": job_span(call, "report"),
            "exit_s": call.wall_s - call.lines[-1][0] if call.lines else call.wall_s}


def job_span(call: Call, rule: str) -> float | None:
    """Seconds from Snakemake's line announcing the job of `rule` to its "Finished jobid" line; None where it did not
    run."""
    for i, (t, line) in enumerate(call.lines):
        if re.match(rf"(local)?rule {rule}:$", line):
            jobid = next((m.group(1) for _, later in call.lines[i + 1:i + 12]
                          if (m := re.match(r"\s+jobid: (\d+)$", later))), None)
            done = [u for u, later in call.lines[i:] if later.startswith(f"Finished jobid: {jobid} ")]
            return done[0] - t if jobid is not None and done else None
    return None


def jobs_run(text: str) -> int:
    m = re.search(r"(\d+) of (\d+) steps \(100%\) done", text)
    return int(m.group(2)) if m else 0


def measure(workdir: Path, edit: str, cores: int, overlay: str | None, probe: int, restore: bool = True) -> dict:
    args = ["--cores", str(cores)] + (["--configfile", overlay] if overlay else [])
    if edit == "none":
        call = checked(snakemake(workdir, ["-n", *args]))
        return {"edit": edit, "wall_s": call.wall_s, "cpu_s": call.cpu_s, "jobs": 0, "runs": 0, "decode_s": 0.0,
                "run_wall_s": 0.0, **phases(call)}
    path = workdir / EDITS[edit]
    original = path.read_text()
    since = time.time()
    try:
        path.write_text(original + f"\n\ndef _loop_probe_{probe}():\n    return {probe}\n")
        call = snakemake(workdir, args)
    finally:
        path.write_text(original)
    checked(call)
    runs = rewritten_runs(workdir, since)
    if restore:
        checked(snakemake(workdir, args))   # back to the unedited code's results (not timed)
    return {"edit": edit, "wall_s": call.wall_s, "cpu_s": call.cpu_s, "jobs": jobs_run(call.text), "runs": len(runs),
            "decode_s": sum((r.get("timing") or {}).get("decode_s", 0.0) for r in runs),
            "run_wall_s": sum(r.get("wall_s") or 0.0 for r in runs), **phases(call)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--configfile", default=None)
    ap.add_argument("--edits", default="numpy,report,none")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-restore", action="store_true",
                    help="leave the results of the last edit (a later run redoes them)")
    args = ap.parse_args()
    rows = []
    for i in range(args.repeat):
        for edit in args.edits.split(","):
            rows.append(measure(args.workdir.resolve(), edit, args.cores, args.configfile, probe=time.time_ns(),
                                restore=not args.no_restore))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| edit | wall s | CPU s | jobs | engine runs | their decode s | their runner wall s | first job at s | "
          "last job done at s | report job s | exit after output s | floor s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        at = [f"{r[key]:.2f}" if r[key] is not None else "-"
              for key in ("first_job_s", "jobs_done_s", "report_s", "exit_s")]
        floor = (f"{r['first_job_s'] + r['decode_s'] / args.cores + (r['report_s'] or 0.0):.1f}"
                 if r["first_job_s"] is not None else "-")
        print(f"| {r['edit']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['jobs']} | {r['runs']} | "
              f"{r['decode_s']:.1f} | {r['run_wall_s']:.1f} | {' | '.join(at)} | {floor} |")


if __name__ == "__main__":
    main()
