"""A fake engine for pipeline tests: behaves as asked, and records when and where it ran.

    fake_engine.py BEHAVIOUR RECORD_DIR --bundle B --mode M --budget N --output O

BEHAVIOUR: ok | crash | hang | badjson | short. `ok` writes a valid result (every token 0).
Each run appends {cuda_visible_devices, start, end, pid} as one JSON file in RECORD_DIR.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from k2vec.kdtr import open_bundle  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("behaviour")
ap.add_argument("record_dir")
ap.add_argument("--bundle")
ap.add_argument("--mode")
ap.add_argument("--budget", type=int)
ap.add_argument("--output")
args = ap.parse_args()

start = time.time()
meta = open_bundle(args.bundle).metadata
n_new = meta["decoding"]["max_new_tokens"] - (1 if args.behaviour == "short" else 0)
drafters = [None] if args.mode == "greedy" else [{"accuracy": a} for a in meta["golden"]["ddtree"]["accuracies"]]
result = {"format": "k2vec-engine-result", "version": 1, "device": "fake",
          "runs": [{"drafter": d, "prompts": [{"tokens": [0] * n_new}] * meta["golden"]["prompts"]} for d in drafters]}
time.sleep(0.4)  # long enough for concurrent jobs to overlap
if args.behaviour == "crash":
    print("fake kernel fault: illegal memory access in gemm_w4a16", file=sys.stderr)
    sys.exit(3)
if args.behaviour == "hang":
    time.sleep(3600)
with open(args.output, "w") as fh:
    fh.write("{\"format\": \"k2vec-engine-res" if args.behaviour == "badjson" else json.dumps(result))
record = {"behaviour": args.behaviour, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
          "start": start, "end": time.time(),
          "bundle": args.bundle, "mode": args.mode, "budget": args.budget}
with open(os.path.join(args.record_dir, f"{os.getpid()}-{time.time_ns()}.json"), "w") as fh:
    json.dump(record, fh)
