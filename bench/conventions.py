"""A float32 engine that follows a known convention, judged on a finished default run's bundles.

    PYTHONPATH=src python bench/conventions.py [--results results] [--convention latent_norm_eps_rms]

The reference model in float32 with the convention's settings (k2vec.model.conventions) decodes greedy and
score mode on every golden under --results; the report (compute_metrics) judges it against the golden alone,
then with the convention variants (results/conventions/) once undeclared and once declared. Prints the score
runs' KL and the rows' classes: what docs/report.md "Conventions" quotes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from k2vec.digests import sha256_bytes, write_record
from k2vec.engines.contract.serialize import greedy_prompt, score_prompt
from k2vec.kdtr import open_bundle
from k2vec.model.conventions import CONVENTIONS
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import ReferenceModel
from k2vec.report.metrics import compute_metrics
from k2vec.stages.golden import open_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", type=Path)
    ap.add_argument("--convention", default="latent_norm_eps_rms", choices=list(CONVENTIONS))
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    runs, goldens, variants = [], {}, {}
    for golden in sorted(a.results.glob("golden/*/*.kdtr")):
        m, p = golden.parent.name, golden.stem
        spec = json.loads((a.results / "cases" / m / "model.json").read_text())
        goldens[(m, p)] = golden
        variants[(m, p, a.convention)] = a.results / "conventions" / m / f"{p}-{a.convention}.kdtr"
        model = ReferenceModel(spec, open_weights(p, a.results / "models" / m / "fp32",
                                                  a.results / "models" / m / "int4"),
                               dtype=np.float32, **CONVENTIONS[a.convention].settings(spec))
        with open_bundle(golden) as b:
            md = b.metadata
            prompts = [np.asarray(b[f"prompt.p{i}.tokens"]) for i in range(md["prompts"])]
            forced = [np.asarray(b[f"golden.p{i}.tokens"]) for i in range(md["prompts"])]
        for mode in ("greedy", "score"):
            rs = greedy_generate(model, prompts, md["max_new_tokens"], top_k=md["top_k"],
                                 forced=forced if mode == "score" else None)
            ps = [score_prompt(r) if mode == "score" else greedy_prompt(r, len(q)) for r, q in zip(rs, prompts)]
            text = json.dumps({"format": "k2vec-engine-result", "version": 1, "status": "ok",
                               "runs": [{"drafter": None, "prompts": ps}]})
            path = out / f"{m}-{p}-{mode}.json"
            path.write_text(text)
            write_record(path, sha256_bytes(text.encode()))
            for engine, declared in (("undeclared", []), ("declared", [a.convention])):
                runs.append({"engine": engine, "model": m, "precision": p, "mode": mode, "result": str(path),
                             "conventions": declared})
    alone = compute_metrics([r for r in runs if not r["conventions"]], goldens)
    both = compute_metrics(runs, goldens, conventions=variants)
    cols = ["engine", "model", "precision", "kl_mean", "kl_p99", "verdict"]
    print("against the golden alone:\n" + alone.score_runs[cols].to_string(index=False))
    print("largest logit error:\n" + alone.rows.groupby(["model", "precision"])["logit_abs_max"].max().to_string())
    print("with the variants:\n" + both.score_runs[cols].to_string(index=False))
    print(both.rows.groupby(["engine", "class"]).size().to_string())


if __name__ == "__main__":
    main()
