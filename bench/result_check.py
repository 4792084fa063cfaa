"""What checking an engine result costs the runner: the quick schema check against jsonschema, and writing
the final JSON compact against indented, on result files of a finished run.

    python bench/result_check.py results/runs/numpy/small-int4-score.json [more results...] [--repeat 5]

Prints one markdown row per file: its size, the best of --repeat timings of each step, and whether the quick
check passed it (when it does, the runner does not call jsonschema).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from k2vec.engines.contract import checks
from k2vec.engines.contract.schema import conforms


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    schema, validator = checks._schema(), checks._validator()
    print("| result | MB | quick check | jsonschema | passed quickly | JSON indent=1 | JSON compact |")
    print("|---|---|---|---|---|---|---|")
    for path in args.results:
        doc = json.loads(path.read_text())
        quick = best(lambda: conforms(doc, schema), args.repeat)
        full = best(lambda: next(iter(validator.iter_errors(doc)), None), args.repeat)
        indented = best(lambda: json.dumps(doc, indent=1, sort_keys=True), args.repeat)
        compact = best(lambda: json.dumps(doc, sort_keys=True), args.repeat)
        print(f"| {path} | {path.stat().st_size / 1e6:.2f} | {quick * 1e3:.1f} ms | {full * 1e3:.0f} ms | "
              f"{conforms(doc, schema)} | {indented * 1e3:.0f} ms | {compact * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
