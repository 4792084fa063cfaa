"""Mutation score at bfloat16: the numpy engine in emulated bfloat16 (`--precision bfloat16`), unmutated and
with each catalogue mutant (DDTree mutants left out) or a routed scaling factor times 0.9 / 0.95 / 0.97,
greedy and score on the default bundles, judged by the report with the noise model.

    .venv/bin/snakemake --cores 2 && .venv/bin/python bench/noise_mutants.py [NAME ...]

Prints, per mutant, the fraction of its rows that are real or over-budget, the fraction of its cells beyond
the noise model (hidden states, logits, routing; report/noise.py), and its class counts.
"""
import dataclasses
import json
import sys
from pathlib import Path

from k2vec.digests import sha256_bytes, write_record
from k2vec.engines import numpy_engine
from k2vec.mutation.catalogue import CATALOGUE, MUTANTS, injected
from k2vec.report.metrics import compute_metrics

OUT = Path("results/scratch/noise-mutants")
MODELS, PRECISIONS = ("tiny", "small"), ("fp32", "int4")


def scaled(factor):
    def install(model):
        model.dims = dataclasses.replace(model.dims, routed_scaling_factor=model.dims.routed_scaling_factor * factor)
    return install


def result(name, model, precision, mode):
    bundle = f"results/bundles/{model}-{precision}.kdtr"
    if name == "none":
        return numpy_engine.run(bundle, mode, 0, precision="bfloat16")
    if name.startswith("scale"):
        return numpy_engine.run(bundle, mode, 0, scaled(float(name[5:])), precision="bfloat16")
    with injected(name) as install:
        return numpy_engine.run(bundle, mode, 0, install, precision="bfloat16")


def main(names):
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {m: json.loads(Path(f"results/cases/{m}.json").read_text()) for m in MODELS}
    goldens = {(m, p): f"results/golden/{m}/{p}.kdtr" for m in MODELS for p in PRECISIONS}
    noise = {(m, p, "bfloat16"): f"results/noise/{m}/{p}-bfloat16.kdtr" for m in MODELS for p in PRECISIONS}
    for name in ["none"] + names:
        runs = []
        for m in MODELS:
            for p in PRECISIONS:
                if name in MUTANTS and not MUTANTS[name].exercised(cases[m]["model"], cases[m]["quantization"], p,
                                                                   "greedy", 0):
                    continue
                for mode in ("greedy", "score"):
                    path = OUT / f"{name}-{m}-{p}-{mode}.json"
                    text = json.dumps(result(name, m, p, mode))
                    path.write_text(text)
                    write_record(path, sha256_bytes(text.encode()))
                    runs.append({"engine": name, "model": m, "precision": p, "mode": mode, "result": str(path),
                                 "precision_class": "bfloat16"})
        m = compute_metrics(runs, goldens, noise=noise)
        rows, t = m.rows, m.noise_table
        caught = rows["class"].isin(["real", "over-budget"]).mean()
        beyond = {k: t[f"{k}_beyond"].sum() / max(t[f"{k}_cells"].sum(), 1) for k in ("hidden", "logit", "router")}
        print(f"{name:32s} caught {caught:4.2f}  beyond: hidden {beyond['hidden']:4.0%} logits {beyond['logit']:4.0%} "
              f"routing {beyond['router']:4.0%}  over the noise model on "
              f"{int(t['verdict'].str.startswith('over').sum())}/{len(t)} "
              f"bundles  {rows['class'].value_counts().to_dict()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["scale0.9", "scale0.95", "scale0.97"] + [m.name for m in CATALOGUE if m.area != "ddtree"])
