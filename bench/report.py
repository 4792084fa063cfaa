"""Divergence-report benchmark: build_report over many synthetic engine runs.

    PYTHONPATH=src python bench/report.py [--runs 2000] [--fingerprint-fraction 0.02] [--keep DIR]
    PYTHONPATH=src python bench/report.py --demo DIR    # a small report with one finding of each kind

Builds the fp32 and int4 goldens of the tiny preset with the default config.yaml decoding (4 prompts,
24 new tokens, top-8, DDTree budgets 1/4/16/64 x accuracies 0.9/0.6/0.3), then writes --runs engine
result files (50 engines; modes greedy and ddtree-b{1,4,16,64}; both precisions), each a perfect
result from the golden with top-k and router choices, full fingerprints in a fraction of them (2% by
default: an engine's debug mode; as JSON they make a result ~20x larger), and faults in about a
third: a token flip at a random step, logit noise, a perturbed fingerprint layer, a swapped DDTree
node, a failed run. Times build_report (load + metrics + plots + HTML + CSV), its metric part alone
and the bare JSON parse; goldens and result files are made beforehand, untimed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]  # the synthetic results are the tests' fixture

from k2vec.config.expand import expand_config  # noqa: E402
from k2vec.kdtr import open_bundle  # noqa: E402
from k2vec.report import build_report  # noqa: E402
from k2vec.report.metrics import compute_metrics  # noqa: E402
from support.synthetic import case_goldens, perfect_result, write_result  # noqa: E402
MODES = ["greedy", "ddtree-b1", "ddtree-b4", "ddtree-b16", "ddtree-b64"]


def make_goldens(root: Path) -> dict[tuple[str, str], Path]:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["models"] = {"tiny": {"preset": "tiny"}}
    return case_goldens(expand_config(cfg)["tiny"], root)


def inject(res: dict, fault: str, rng: np.random.Generator) -> None:
    if fault == "failed":
        res.update(status="failed", reason="engine exited with code 139", runs=[], stderr_tail="Segmentation fault")
        return
    run = res["runs"][int(rng.integers(len(res["runs"])))]
    p = run["prompts"][int(rng.integers(len(run["prompts"])))]
    n = len(p["tokens"])
    if fault == "flip":
        k = int(rng.integers(n))
        p["tokens"][k] = p["topk_ids"][k][1]
        p["topk_ids"][k][0], p["topk_ids"][k][1] = p["topk_ids"][k][1], p["topk_ids"][k][0]
    elif fault == "noise":
        for row in p["topk_logits"]:
            row[:] = (np.asarray(row) + rng.normal(0, 1e-3, len(row))).tolist()
    elif fault == "fingerprint" and "fingerprints" in p:
        s, layer = int(rng.integers(n)), int(rng.integers(len(p["fingerprints"][0])))
        p["fingerprints"][s][layer] = (np.asarray(p["fingerprints"][s][layer]) * 1.01).tolist()
    elif fault == "tree" and "rounds" in p:
        big = [r for r in p["rounds"] if len(r["tokens"]) > 2]
        if big:
            r = big[int(rng.integers(len(big)))]
            r["tokens"][1], r["tokens"][2] = r["tokens"][2], r["tokens"][1]


def make_runs(goldens, out: Path, n_runs: int, fp_fraction: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    base: dict[tuple[str, str, bool], str] = {}
    runs = []
    faults = ["flip", "noise", "fingerprint", "tree", "failed"]
    for i in range(n_runs):
        precision = ("fp32", "int4")[i % 2]
        mode = MODES[(i // 2) % len(MODES)]
        with_fp = bool(rng.random() < fp_fraction)
        key = (precision, mode, with_fp)
        if key not in base:
            base[key] = json.dumps(perfect_result(goldens[("tiny", precision)], mode, fingerprints=with_fp,
                                                  wall_s=1.0))
        res = json.loads(base[key])
        res["wall_s"] = float(rng.uniform(0.5, 5.0))
        res["timing"] = {"decode_s": res["wall_s"] * 0.8}
        if rng.random() < 0.35:
            inject(res, faults[int(rng.integers(len(faults)))], rng)
        path = out / f"run{i:05d}.json"
        write_result(path, res)
        runs.append({"engine": f"engine{i % 50:02d}", "model": "tiny", "precision": precision, "mode": mode,
                     "result": str(path)})
    return runs


def demo(out: Path) -> None:
    """A small report with one example of each finding (the screenshot in docs): near_tie 0.02 so
    that the tiny int4 golden has logit near-ties."""
    tmp = out / "inputs"
    goldens = make_goldens(tmp / "goldens")
    rng = np.random.default_rng(1)
    g = {}
    for prec in ("fp32", "int4"):
        with open_bundle(goldens[("tiny", prec)]) as b:
            g[prec] = {"md": b.metadata, **{k: np.array(b[k]) for k in b.keys()}}
    near_tie, router_tie = 0.02, 1e-3

    def flip(res, run, p, k):
        q = res["runs"][run]["prompts"][p]
        q["tokens"][k] = q["topk_ids"][k][1]
        q["topk_ids"][k][0], q["topk_ids"][k][1] = q["topk_ids"][k][1], q["topk_ids"][k][0]
        for j in range(k + 1, len(q["tokens"])):
            q["tokens"][j] = int(rng.integers(512))

    def noisy(res, scale):   # bf16-like: logit noise, fingerprint error growing with depth
        for run in res["runs"]:
            for q in run["prompts"]:
                q["topk_logits"] = (np.asarray(q["topk_logits"])
                                    + rng.normal(0, scale, (len(q["topk_logits"]), 8))).tolist()
                if "fingerprints" in q:
                    fp = np.asarray(q["fingerprints"])
                    err = (rng.normal(0, 1, fp.shape) * np.abs(fp).mean()
                           * (2e-4 * 3.0 ** np.arange(fp.shape[1]))[None, :, None])
                    q["fingerprints"] = (fp + err).tolist()

    results = []
    results.append(("ref-cpu", "fp32", "greedy", perfect_result(goldens[("tiny", "fp32")], "greedy")))
    r = perfect_result(goldens[("tiny", "int4")], "greedy")
    noisy(r, 2e-3)
    m = g["int4"]["golden.p3.margins"]
    flip(r, 0, 3, int(np.argmin(m)))                           # a logit near-tie
    results.append(("cuda-bf16", "int4", "greedy", r))
    r = perfect_result(goldens[("tiny", "int4")], "greedy", fingerprints=False)
    for p in range(g["int4"]["md"]["prompts"]):                # a router near-tie before the flip
        P = len(g["int4"][f"prompt.p{p}.tokens"])
        low = np.flatnonzero(g["int4"][f"golden.p{p}.router_margins"].min(0) < router_tie)
        steps = [k for k in range(max(0, int(low[0]) - P + 1) if low.size else 99, 24)
                 if g["int4"][f"golden.p{p}.margins"][k] > near_tie]
        if steps:
            flip(r, 0, p, steps[0])
            break
    results.append(("triton", "int4", "greedy", r))
    r = perfect_result(goldens[("tiny", "fp32")], "ddtree-b16", fingerprints=False)
    rnd = next(x for x in r["runs"][1]["prompts"][2]["rounds"] if len(x["tokens"]) > 3)
    rnd["tokens"][2], rnd["tokens"][3] = rnd["tokens"][3], rnd["tokens"][2]   # a tree tie-break bug
    results.append(("triton", "fp32", "ddtree-b16", r))
    r = perfect_result(goldens[("tiny", "fp32")], "ddtree-b4")
    noisy(r, 1e-3)
    flip(r, 2, 1, 7)                                           # a real divergence
    q = r["runs"][2]["prompts"][1]
    q["router_experts"][5][1] = [(e + 1) % 8 for e in q["router_experts"][5][1]]
    for x in q["rounds"]:                                      # and the acceptance it costs
        if x["start"] >= len(g["fp32"]["prompt.p1.tokens"]) + 7:
            x["accepted"] = x["accepted"][:1]
    results.append(("cuda-bf16", "fp32", "ddtree-b4", r))
    results.append(("vllm-port", "fp32", "ddtree-b64", {
        "format": "k2vec-engine-result", "version": 1, "status": "failed",
        "reason": "timed out after 600 s (killed)", "stderr_tail": "INFO loading bundle\nINFO round 3 ...",
        "runs": []}))
    runs = []
    for i, (engine, prec, mode, res) in enumerate(results):
        res.setdefault("wall_s", float(rng.uniform(0.5, 3)))
        path = tmp / f"{i}-{engine}-{prec}-{mode}.json"
        write_result(path, res)
        runs.append({"engine": engine, "model": "tiny", "precision": prec, "mode": mode, "result": str(path)})
    res = build_report(runs, goldens, out, near_tie=near_tie, router_near_tie=router_tie)
    print(res.summary)
    print(f"report: {res.paths['html']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--fingerprint-fraction", type=float, default=0.02)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", help="write the report here (default: a temporary directory)")
    ap.add_argument("--demo", metavar="DIR", help="instead: write a small demo report (the docs screenshot) to DIR")
    a = ap.parse_args()
    if a.demo:
        demo(Path(a.demo))
        return
    with tempfile.TemporaryDirectory(prefix="k2vec-report-bench-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        goldens = make_goldens(tmp / "goldens")
        (tmp / "results").mkdir()
        runs = make_runs(goldens, tmp / "results", a.runs, a.fingerprint_fraction)
        size = sum(os.path.getsize(r["result"]) for r in runs)
        print(f"setup (goldens + {a.runs} result files, {size / 2**20:.1f} MiB JSON): {time.perf_counter() - t:.1f} s")
        out = Path(a.keep) if a.keep else tmp / "report"
        gc.disable()   # as compute_metrics does while loading
        t = time.perf_counter()
        loaded = [json.loads(Path(r["result"]).read_text()) for r in runs]
        parse = time.perf_counter() - t
        del loaded
        gc.enable()
        best_total = best_metrics = float("inf")
        for _ in range(a.repeat):
            t = time.perf_counter()
            m = compute_metrics(runs, goldens)
            best_metrics = min(best_metrics, time.perf_counter() - t)
            t = time.perf_counter()
            res = build_report(runs, goldens, out)
            best_total = min(best_total, time.perf_counter() - t)
        html = res.paths["html"].stat().st_size
        print(f"{len(runs)} runs, {len(res.rows)} prompt rows, {len(m.steps)} compared steps; classes: "
              + ", ".join(f"{k} {v}" for k, v in res.rows["class"].value_counts().items()))
        print(f"compute_metrics: {best_metrics:.2f} s   build_report (metrics + plots + HTML + CSV): "
              f"{best_total:.2f} s   (best of {a.repeat}; divergence.html {html / 2**20:.2f} MiB)")
        print(f"of which parsing the JSON alone (json.loads of every result): {parse:.2f} s")
        print(f"python {platform.python_version()}, {os.cpu_count()} cpus, {platform.machine()}", file=sys.stderr)


if __name__ == "__main__":
    main()
