"""The report rule's work on a finished default run: k2vec.report.write_report over its results/, repeated.

    PYTHONPATH=src python bench/report_default.py [--repeat 5] [--results-of .] [--out DIR]

Builds the rule's inputs from the results directory (every engine result under results/runs, the
format-effect runs, the goldens, the bfloat16 noise models, the convention variants, the mutation run's
per-bundle resolution where it exists) and the checkout's config.yaml, then times write_report, wall and CPU,
in one process: the first repetition draws the plots a plot cache of its own lacks; the others are the
report's steady cost on the edit-to-verdict path. The code timed is the one on PYTHONPATH, so the same
command with another checkout's src/ times that code on the same results (before and after a change).
"""

from __future__ import annotations

import argparse
import glob
import inspect
import logging
import os
import re
import tempfile
import time

import yaml


def rule_inputs(root: str) -> tuple[list[dict], dict, dict]:
    """(runs, goldens, keyword arguments) as rule `report` passes them, from `root`'s results/ and config.yaml."""
    cfg = yaml.safe_load(open(os.path.join(root, "config.yaml")))
    engines, models = cfg["engines"], sorted(cfg["models"])
    runs = []
    for path in sorted(glob.glob(os.path.join(root, "results/runs/*/*.json"))):
        engine = os.path.basename(os.path.dirname(path))
        model, precision, mode = re.fullmatch(r"(\w+)-(fp32|int4)-(.+)\.json", os.path.basename(path)).groups()
        e = engines[engine]
        runs.append({"engine": engine, "model": model, "precision": precision, "mode": mode, "result": path,
                     "precision_class": e.get("precision", "float32"), "conventions": e.get("conventions", [])})
    runs += [{"engine": "int4-format", "model": m, "precision": "fp32", "mode": "score", "reference": True,
              "result": os.path.join(root, f"results/format-effect/{m}.json")} for m in models]
    goldens = {f"{m}/{p}": os.path.join(root, f"results/golden/{m}/{p}.kdtr") for m in models for p in ("fp32", "int4")}

    def keyed(pattern: str) -> dict:
        return {f"{os.path.basename(os.path.dirname(p))}/{os.path.basename(p)[:-5].replace('-', '/', 1)}": p
                for p in glob.glob(os.path.join(root, pattern))}
    ran = {r["engine"] for r in runs}
    kw = {"near_tie": cfg["report"]["near_tie"], "router_near_tie": cfg["report"]["router_near_tie"],
          "fingerprint_rtol": cfg["report"]["fingerprint_rtol"], "budgets": cfg["report"]["budgets"],
          "noise": keyed("results/noise/*/*.kdtr"), "conventions": keyed("results/conventions/*/*.kdtr"),
          "noise_rule": cfg["report"]["noise"], "left_out": {e: "not run here" for e in engines if e not in ran},
          "integrity_key": os.path.join(root, "results/.integrity.key")}
    return runs, goldens, kw


def main() -> None:
    from k2vec.report import write_report

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--results-of", default=".", help="the checkout whose results/ and config.yaml are read")
    ap.add_argument("--out", help="output directory (default: a temporary one)")
    a = ap.parse_args()
    runs, goldens, kw = rule_inputs(a.results_of)
    if "mutation_resolution" in inspect.signature(write_report).parameters:   # code before issue 29's resolution
        from k2vec.config.engines import float32_counterparts
        cfg = yaml.safe_load(open(os.path.join(a.results_of, "config.yaml")))
        kw.update(mutation_resolution=os.path.join(a.results_of, "results/mutation/mutation_resolution.csv"),
                  float32_engines=float32_counterparts({n: {"command": e["command"],
                                                            "precision": e.get("precision", "float32")}
                                                        for n, e in cfg["engines"].items()}))
    logging.disable(logging.CRITICAL)
    with tempfile.TemporaryDirectory() as tmp:
        out = a.out or tmp
        for i in range(a.repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            res = write_report(runs, goldens, out, cache=os.path.join(tmp, "report-cache"), **kw)
            print(f"repetition {i}: wall {time.perf_counter() - wall:.3f} s, cpu {time.process_time() - cpu:.3f} s; "
                  f"{len(res.rows)} rows, {res.rows['class'].value_counts().to_dict()}")


if __name__ == "__main__":
    main()
