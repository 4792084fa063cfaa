"""Checkpoint import at K2 width: a compressed-tensors checkpoint slice through import, golden, bundle and
the numpy engine (issue 16, must show 3).

  PYTHONPATH=src python bench/import_k2layer.py [--workdir DIR] [--keep]

The source is written by compressed-tensors' own compressor (tests/support/ct_checkpoint.py): one MoE layer at
Kimi K2 widths (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64 / nope 128 / v 128,
moe_intermediate 2048, one shared expert, K2's YaRN) with 8 routed experts (top-4, one group), BF16
everywhere but the pack-quantized routed experts (BF16 group-32 scales) and the float32 router bias, and
a 1024-token vocabulary. The pipeline imports layer 0 with experts [0, 2, 5, 7] (top-2 over them), then
builds both goldens and bundles and runs the numpy engine greedy on each, one job at a time
(`--cores 1`). Checks: the int4 .qw/.sc are the checkpoint's weight_packed / weight_scale bytes, the fp32
and int4 goldens are equal (the fp32 side holds the dequantized experts), and the numpy engine's tokens
and top-k logits equal the golden's. Prints wall time and peak RSS per stage (Snakemake's benchmark
files) as a markdown table. The files (~4 GB) are deleted unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]
from support.ct_checkpoint import arch, write_ct_checkpoint  # noqa: E402
from k2vec.model.checkpoint import Checkpoint  # noqa: E402
from k2vec.kdtr import open_bundle  # noqa: E402

# K2 widths (docs: /work/shared/notes, k2vec.config.expand K2 presets once merged), as overrides of `tiny`
K2_WIDTHS = {"vocab_size": 1024, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128}
SOURCE = {**K2_WIDTHS, "num_hidden_layers": 1, "first_k_dense_replace": 0, "n_routed_experts": 8,
          "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1}
ENTRY = {"layers": [0], "experts": [0, 2, 5, 7], "num_experts_per_tok": 2}
MODEL = "k2imp"
STAGES = [("import_checkpoint", f"import_checkpoint/{MODEL}.tsv")] + [
    (f"{stage} {p}", path) for p in ("fp32", "int4") for stage, path in
    (("golden", f"golden/{MODEL}/{p}.tsv"), ("bundle", f"bundle/{MODEL}-{p}.tsv"),
     ("numpy engine greedy", f"runs/numpy/{MODEL}-{p}-greedy.tsv"))]


def config(source: Path) -> dict:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["models"] = {MODEL: {"checkpoint": str(source), **ENTRY}}
    cfg["prompts"].update(count=2, min_length=3, max_length=5)
    cfg["decoding"].update(max_new_tokens=4)
    cfg["decoding"]["ddtree"].update(budgets=[2], accuracies=[0.9])
    cfg["engines"] = {"numpy": {**cfg["engines"]["numpy"], "modes": ["greedy"]}}
    return cfg


def run(workdir: Path) -> dict:
    t0 = time.perf_counter()
    source = write_ct_checkpoint(workdir / "source", arch("tiny", **SOURCE))
    t_source = time.perf_counter() - t0
    (workdir / "config.yaml").write_text(yaml.safe_dump(config(source), sort_keys=False))
    targets = [f"results/runs/numpy/{MODEL}-{p}-greedy.json" for p in ("fp32", "int4")]
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", "1",
                          *targets, "--configfile", str(workdir / "config.yaml")], cwd=workdir,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    t_pipeline = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(res.stderr[-5000:])
    return {"source_s": t_source, "pipeline_s": t_pipeline, **check(workdir)}


def check(workdir: Path) -> dict:
    """The checks on a finished run in `workdir`, and its benchmark rows."""
    source, results = workdir / "source", workdir / "results"
    # INT4 files: the checkpoint's bytes (one expert spot-checked here; every one in the tests)
    state = Checkpoint(source, verify=False)  # an HF index records no hashes
    prefix = "model.layers.0.mlp.experts.5.down_proj"
    qw = (results / f"models/{MODEL}/int4/model.layers.0.mlp.experts.2.down_proj.weight.qw").read_bytes()
    assert qw == state[prefix + ".weight_packed"].astype("<i4").tobytes()
    sc = (results / f"models/{MODEL}/int4/model.layers.0.mlp.experts.2.down_proj.weight.sc").read_bytes()
    assert sc == state[prefix + ".weight_scale"].astype("<u2").tobytes()  # BF16 bits

    goldens = {p: open_bundle(results / f"golden/{MODEL}/{p}.kdtr") for p in ("fp32", "int4")}
    names = sorted(goldens["fp32"].keys())
    assert names == sorted(goldens["int4"].keys())
    for n in names:
        assert np.array_equal(np.asarray(goldens["fp32"][n]), np.asarray(goldens["int4"][n])), n
    routed = sorted({int(x) for n in names if n.endswith("router_ids") for x in np.asarray(goldens["int4"][n]).ravel()})
    for p, g in goldens.items():
        r = json.loads((results / f"runs/numpy/{MODEL}-{p}-greedy.json").read_text())
        assert r["status"] == "ok", r.get("reason")
        for i, pr in enumerate(r["runs"][0]["prompts"]):
            assert pr["tokens"] == np.asarray(g[f"golden.p{i}.tokens"]).tolist(), (p, i)
            assert np.array_equal(np.asarray(pr["topk_logits"], np.float64), np.asarray(g[f"golden.p{i}.topk_logits"]))

    rows = []
    for stage, path in STAGES:
        lines = (results / "benchmarks" / path).read_text().splitlines()
        head, vals = lines[0].split("\t"), lines[1].split("\t")
        rec = dict(zip(head, vals))
        rows.append((stage, float(rec["s"]), float(rec["max_rss"])))
    sizes = {d: sum(f.stat().st_size for f in (workdir / d).rglob("*") if f.is_file())
             for d in ("source", f"results/models/{MODEL}", "results/bundles")}
    return {"rows": rows, "sizes": sizes, "routed": routed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, help="default: a temporary directory under /tmp")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="k2vec-import-k2layer-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        out = run(workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"source checkpoint written by compressed-tensors in {out['source_s']:.1f} s; pipeline "
          f"{out['pipeline_s']:.1f} s wall; kept experts routed to: {out['routed']}")
    print("sizes: " + ", ".join(f"{d} {b / 2**30:.2f} GiB" for d, b in out["sizes"].items()))
    print("\n| stage | wall s | peak RSS MiB |\n|---|---|---|")
    for stage, s, rss in out["rows"]:
        print(f"| {stage} | {s:.1f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
