"""Dispatch of GPU-engine runs over a node's GPUs, from the run results alone.

    python bench/dispatch.py RUNS_DIR [--engines gpu_fp32,gpu_bf16] [--compare OTHER_RUNS_DIR]

For every result JSON under RUNS_DIR/<engine>/ it takes the physical GPU (the runner's `gpu_devices`
UUID, else the engine's own `gpu.uuid`) and the start/end epoch times (the runner's `started_at` /
`ended_at`, else the engine's `timing.started_at` / `ended_at`), and prints a markdown table: per GPU the
runs and busy seconds; the number of overlapping pairs on one GPU (two runs at once on a device: must be
0); the wall time from the first start to the last end. With --compare, the same for a second set of
runs and the ratio of the two wall times. Exit status 1 when a run lacks its GPU or times, or overlaps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_runs(runs_dir: Path, engines: list[str]) -> list[dict]:
    runs = []
    for engine in engines:
        for path in sorted((runs_dir / engine).glob("*.json")):
            r = json.loads(path.read_text())
            devices = r.get("gpu_devices") or []
            uuid = devices[0].get("uuid") if devices else None
            uuid = uuid or (r.get("gpu") or {}).get("uuid")
            timing = r.get("timing") or {}
            start, end = r.get("started_at", timing.get("started_at")), r.get("ended_at", timing.get("ended_at"))
            runs.append({"run": f"{engine}/{path.stem}", "status": r.get("status"), "uuid": uuid,
                         "start": start, "end": end})
    return runs


def summarize(runs: list[dict]) -> tuple[dict, list[str]]:
    problems = [f"{r['run']}: status {r['status']}" for r in runs if r["status"] != "ok"]
    problems += [f"{r['run']}: no GPU UUID or start/end time" for r in runs
                 if r["uuid"] is None or r["start"] is None or r["end"] is None]
    timed = [r for r in runs if r["uuid"] and r["start"] is not None and r["end"] is not None]
    per_gpu: dict[str, dict] = {}
    for r in timed:
        g = per_gpu.setdefault(r["uuid"], {"runs": 0, "busy_s": 0.0})
        g["runs"] += 1
        g["busy_s"] += r["end"] - r["start"]
    overlaps = [(a["run"], b["run"]) for i, a in enumerate(timed) for b in timed[i + 1:]
                if a["uuid"] == b["uuid"] and a["start"] < b["end"] and b["start"] < a["end"]]
    problems += [f"{a} and {b} overlap on one GPU" for a, b in overlaps]
    wall = max(r["end"] for r in timed) - min(r["start"] for r in timed) if timed else 0.0
    return {"runs": len(runs), "per_gpu": per_gpu, "overlaps": len(overlaps), "wall_s": wall}, problems


def table(label: str, s: dict) -> str:
    lines = [f"**{label}**: {s['runs']} runs on {len(s['per_gpu'])} GPU(s), overlapping pairs on one GPU: "
             f"{s['overlaps']}, wall (first start to last end): {s['wall_s']:.1f} s", "",
             "| GPU UUID | runs | busy s |", "|---|---|---|"]
    lines += [f"| {uuid} | {g['runs']} | {g['busy_s']:.1f} |" for uuid, g in sorted(s["per_gpu"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs_dir", type=Path)
    ap.add_argument("--engines", default="gpu_fp32,gpu_bf16")
    ap.add_argument("--label", default=None)
    ap.add_argument("--compare", type=Path, help="a second runs directory (e.g. the same runs on one GPU)")
    ap.add_argument("--compare-label", default=None)
    args = ap.parse_args(argv)
    engines = args.engines.split(",")
    summary, problems = summarize(load_runs(args.runs_dir, engines))
    print(table(args.label or str(args.runs_dir), summary))
    if args.compare:
        other, more = summarize(load_runs(args.compare, engines))
        problems += more
        print()
        print(table(args.compare_label or str(args.compare), other))
        if summary["wall_s"] > 0:
            print(f"\nwall-time ratio ({args.compare_label or args.compare} / {args.label or args.runs_dir}): "
                  f"{other['wall_s'] / summary['wall_s']:.2f}x")
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
