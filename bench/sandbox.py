"""The sandbox's cost per engine run: the numpy engine on one bundle, greedy, through the runner, with
and without bubblewrap, alternating so that both see the same machine load.

    PYTHONPATH=src python bench/sandbox.py --results /tmp/k2vec-bench/results \
        --bundle /tmp/k2vec-bench/results/bundles/tiny-fp32.kdtr --repeat 10

`results` is laid out as the pipeline's (the bundle inside it; runs and scratch are written there).
Prints per setting the engine's wall time (runner's `wall_s`) and the whole run_engine call, median
and min over the repetitions. Figures go to bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from k2vec.engines.runner import run_engine

COMMAND = ("OPENBLAS_NUM_THREADS=1 {python} -m k2vec.engines.numpy_engine --bundle {bundle} --mode {mode} "
           "--budget {budget} --output {output}")


def once(results: Path, bundle: str, sandbox: bool, i: int) -> tuple[float, float]:
    name = "boxed" if sandbox else "plain"
    t = time.perf_counter()
    r = run_engine(engine=name, command=COMMAND, bundle=bundle, mode="greedy",
                   output=str(results / "runs" / name / f"{i}.json"), gpus=0, devices=[],
                   lock_dir=str(results / "locks"), timeout_s=600, stderr_path=str(results / "logs" / f"{name}.log"),
                   max_result_mb=96, scratch_dir=str(results / "scratch" / name), sandbox=sandbox,
                   sandbox_required=True, results_dir=str(results), python=sys.executable)
    total = time.perf_counter() - t
    assert r["status"] == "ok" and r["sandbox"] is sandbox, r.get("reason")
    return r["wall_s"], total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True, type=Path)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    once(a.results, a.bundle, True, -1)    # warm the page cache and Python's bytecode cache
    once(a.results, a.bundle, False, -1)
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(a.repeat):
        for sandbox in (False, True):
            got[sandbox].append(once(a.results, a.bundle, sandbox, i))
    for sandbox, runs in got.items():
        wall, total = zip(*runs)
        print(f"sandbox={sandbox!s:5}  engine wall median {statistics.median(wall):.3f} s min {min(wall):.3f} s   "
              f"run_engine median {statistics.median(total):.3f} s min {min(total):.3f} s   (n={len(runs)})")
    d = [b[0] - p[0] for b, p in zip(got[True], got[False])]
    print(f"sandbox cost per run (engine wall, paired): median {statistics.median(d) * 1000:.0f} ms, "
          f"min {min(d) * 1000:.0f} ms, max {max(d) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
