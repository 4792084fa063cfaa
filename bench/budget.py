"""Measured peak RSS of each pipeline stage against k2vec.config.resources's estimate, for a few model sizes.

  PYTHONPATH=src python bench/budget.py                      # presets tiny, small and a "medium" model
  PYTHONPATH=src python bench/budget.py --models small

Each stage runs the same package call as its workflow script, in a fresh process (one BLAS thread),
on the default config's prompts and decoding; the peak RSS is the child's ru_maxrss (os.wait4).
Stages: weights, quantize, golden fp32 + int4, bundle fp32 + int4, numpy engine greedy and
ddtree (largest budget) on each bundle. Prints one markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from k2vec.config.resources import MiB, stage_memory  # noqa: E402
from k2vec.config.cases import write_json  # noqa: E402
from k2vec.config.expand import expand_config, resolve_model  # noqa: E402

MODELS = {
    "tiny": {"preset": "tiny"},
    "small": {"preset": "small", "seed": 1},
    # large enough that the data terms dominate the process base
    "medium": {"preset": "small", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2048,
               "moe_intermediate_size": 256},
}

STAGES = {
    "weights": "from k2vec.stages.weights import write_checkpoint; "
               "write_checkpoint(read_json(d/'model.json'), d/'fp32')",
    "quantize": "from k2vec.model.int4_checkpoint import quantize_checkpoint; "
                "quantize_checkpoint(d/'fp32', d/'int4', read_json(d/'quantization.json'))",
    "golden": "from k2vec.stages.golden import make_golden, open_weights, write_golden; "
              "case = {s: read_json(d/f'{s}.json') for s in ('model', 'prompts', 'decoding')}; "
              "w = open_weights(P, d/'fp32', d/'int4' if P == 'int4' else None); "
              "write_golden(d/f'golden-{P}.kdtr', *make_golden(case, w, P))",
    "bundle": "from k2vec.stages.bundle import write_case_bundle; "
              "write_case_bundle(d/f'{P}.kdtr', model=read_json(d/'model.json'), "
              "decoding=read_json(d/'decoding.json'), "
              "precision=P, fp32_dir=d/'fp32', int4_dir=d/'int4' if P == 'int4' else None, "
              "golden_path=d/f'golden-{P}.kdtr')",
}
PRELUDE = ("import sys; from pathlib import Path; from k2vec.config.cases import read_json; "
           "d = Path(sys.argv[1]); P = sys.argv[2]; ")
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def peak_rss(argv: list[str]) -> int:
    """Run argv; its peak RSS in bytes (Linux ru_maxrss is in KiB)."""
    proc = subprocess.Popen(argv, env=ENV)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed")
    return usage.ru_maxrss * 1024


def measure(name: str, entry: dict, config: dict, scratch: Path) -> list[tuple[str, int, int]]:
    config = {**config, "models": {name: entry}}
    case = expand_config(config)[name]
    for section, content in case.items():
        write_json(scratch / f"{section}.json", content)
    estimates = {n.what.split()[0]: n.amount for n in stage_memory(resolve_model(name, entry), config)}
    rows = []
    for stage, precisions in (("weights", ["-"]), ("quantize", ["-"]), ("golden", ["fp32", "int4"]),
                              ("bundle", ["fp32", "int4"])):
        for p in precisions:
            rss = peak_rss([sys.executable, "-c", PRELUDE + STAGES[stage], str(scratch), p])
            rows.append((f"{stage} {p}".replace(" -", ""), rss, estimates[stage]))
    budget = max(config["decoding"]["ddtree"]["budgets"])
    for p in ("fp32", "int4"):
        for mode in ("greedy", "ddtree"):
            rss = peak_rss([sys.executable, "-m", "k2vec.engines.numpy_engine", "--bundle", str(scratch / f"{p}.kdtr"),
                            "--mode", mode, "--budget", str(budget), "--output", str(scratch / "result.json")])
            rows.append((f"engine {p} {mode}", rss, estimates["engine"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args(argv)
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    print("| model | stage | measured peak RSS | estimate | estimate / measured |\n|---|---|---:|---:|---:|")
    worst = (float("inf"), 0.0)
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            for stage, rss, est in measure(name, MODELS[name], config, Path(tmp)):
                ratio = est / rss
                worst = (min(worst[0], ratio), max(worst[1], ratio))
                print(f"| {name} | {stage} | {rss / MiB:.0f} MiB | {est / MiB:.0f} MiB | {ratio:.2f} |")
    print(f"\nestimate / measured: {worst[0]:.2f} .. {worst[1]:.2f}")
    return 0 if worst[0] >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
