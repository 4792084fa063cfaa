"""C and Python KDTR readers on the same fuzzed files: same verdict, field and byte offset?

  PYTHONPATH=src python tools/kdtr_agree.py --cases 20000 --seed 20261130

Builds tools/kdtr_tool.c with ASan+UBSan (as tests/test_kdtr_c.py does), feeds it the corpus of
k2vec.kdtr.fuzz.cases(seed, n) in one process, opens + verifies each case with the Python reader,
and prints the tallies as a markdown table for bench/RESULTS.md. Exits 1 on any disagreement.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from k2vec.kdtr import KdtrError, open_bundle_buffer  # noqa: E402
from k2vec.kdtr.fuzz import cases, write_corpus  # noqa: E402

SAN = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def python_verdict(data: bytes) -> tuple:
    try:
        open_bundle_buffer(data, verify=True)
        return ("ok",)
    except KdtrError as e:
        return ("err", e.offset, e.field)


def c_verdicts(tool: Path, bufs: list[bytes], scratch: Path) -> tuple[list[tuple], str]:
    corpus = scratch / "corpus.bin"
    write_corpus(corpus, bufs)
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:exitcode=99"}
    r = subprocess.run([str(tool), "fuzz", str(corpus)], capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode != 0 or "runtime error" in r.stderr:
        raise SystemExit(f"kdtr_tool fuzz failed (exit {r.returncode}): {r.stderr[-2000:]}")
    out = [("ok",) if p[1] == "ok" else ("err", int(p[2]), p[3]) for p in map(str.split, r.stdout.splitlines())]
    return out, r.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=20261130)
    args = ap.parse_args(argv)
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("gcc not found: the C reader cannot be built")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tool = scratch / "kdtr_tool"
        subprocess.run([gcc, "-std=c11", *SAN, f"-I{REPO / 'include'}", str(REPO / "tools" / "kdtr_tool.c"),
                        "-o", str(tool)], check=True)
        bufs = cases(args.seed, args.cases)
        t0 = time.perf_counter()
        got_c, _ = c_verdicts(tool, bufs, scratch)
        t_c = time.perf_counter() - t0
    t0 = time.perf_counter()
    got_py = [python_verdict(b) for b in bufs]
    t_py = time.perf_counter() - t0
    def row(v):  # the Python outcome, with dir[i] entries pooled
        return v[2].split("[")[0] if v[0] == "err" else "ok"
    rows = collections.Counter(map(row, got_py))
    kinds, by_row = collections.Counter(), collections.Counter()
    for p, c in zip(got_py, got_c):
        kind = ("verdict" if p[0] != c[0] else "field" if p[0] == "err" and p[2] != c[2]
                else "offset" if p[0] == "err" and p[1] != c[1] else None)
        if kind:
            kinds[kind] += 1
            by_row[row(p)] += 1
    print(f"cases: {args.cases} (seed {args.seed}); C (ASan+UBSan, one process) {t_c:.2f} s, "
          f"Python {t_py:.2f} s")
    print("\n| outcome (Python) | cases | C differs (verdict, field or offset) |\n|---|---:|---:|")
    for name, n in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {n} | {by_row[name]} |")
    print(f"\ndisagreements: verdict {kinds['verdict']}, field {kinds['field']}, offset {kinds['offset']}")
    differ = kinds
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
