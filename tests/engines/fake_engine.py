"""A fake engine for pipeline tests: behaves as asked, and records when and where it ran.

    fake_engine.py BEHAVIOUR RECORD_DIR --bundle B --mode M --budget N --output O

BEHAVIOUR: ok | crash | hang | badjson | short, or a hostile output: deep (nested 200,000 deep) |
bigint (a 5,000-digit token) | dir ({output} made a directory) | nanlogits (NaN logits) | floattok (token
ids like 5.0) | huge (a 2 MiB device string), or: detach (leaves `setsid sleep 1000.<pid>` running,
then writes a valid result) | escape (tries to write outside its output directory, then a valid result).
`ok` writes a valid result (every token 0). Each run appends {cuda_visible_devices, start, end, pid}
as one JSON file in RECORD_DIR (skipped where RECORD_DIR is read-only: in the sandbox).
"""
import argparse
import json
import os
import subprocess
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
drafters = ([None] if args.mode in ("greedy", "score")
            else [{"accuracy": a} for a in meta["golden"]["ddtree"]["accuracies"]])
one = {"tokens": [0] * n_new}
if args.mode == "score":   # score mode requires the top-k (docs/engine-contract.md section 4)
    one.update(topk_ids=[[0]] * n_new, topk_logits=[[0.0]] * n_new)
result = {"format": "k2vec-engine-result", "version": 1, "device": "fake",
          "runs": [{"drafter": d, "prompts": [one] * meta["golden"]["prompts"]} for d in drafters]}
time.sleep(0.4)  # long enough for concurrent jobs to overlap
if args.behaviour == "crash":
    print("fake kernel fault: illegal memory access in gemm_w4a16", file=sys.stderr)
    sys.exit(3)
if args.behaviour == "hang":
    time.sleep(3600)
n_prompts, vocab = meta["golden"]["prompts"], meta["model"]["vocab_size"]
if args.behaviour == "detach":
    subprocess.Popen(["setsid", "sleep", f"1000.{os.getpid()}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if args.behaviour == "escape":   # the victims: the pipeline's package, its bundle, other results
    victims = [os.path.join(os.environ["K2VEC_WORKDIR"], *p.split("/")) for p in (
        "src/k2vec/__init__.py", "results/runs/ok/tiny-fp32-greedy.json", "results/planted.json")] + [args.bundle]
    for v in victims:
        try:
            with open(v, "a") as fh:
                fh.write("tampered")
            print(f"wrote {v}", file=sys.stderr)
        except OSError as err:
            print(f"could not write {v}: {err.strerror}", file=sys.stderr)
prompt = result["runs"][0]["prompts"][0]
texts = {
    "deep": '{"runs": ' + "[" * 200000 + "]" * 200000 + "}",
    "bigint": json.dumps(result).replace('"tokens": [0', '"tokens": [' + "9" * 5000, 1),
    "nanlogits": json.dumps({**result, "runs": [{**result["runs"][0], "prompts": [
        {**prompt, "topk_logits": [[float("nan")]] * n_new}] * n_prompts}]}),
    "floattok": json.dumps(result).replace('"tokens": [0', '"tokens": [5.0', 1),
    "huge": json.dumps({**result, "device": "x" * (2 << 20)}),
    "badjson": "{\"format\": \"k2vec-engine-res",
}
if args.behaviour == "dir":
    os.mkdir(args.output)
else:
    with open(args.output, "w") as fh:
        fh.write(texts.get(args.behaviour) or json.dumps(result))
record = {"behaviour": args.behaviour, "pid": os.getpid(),
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
          "bundle": args.bundle, "mode": args.mode, "budget": args.budget}
try:
    with open(os.path.join(args.record_dir, f"{os.getpid()}-{time.time_ns()}.json"), "w") as fh:
        json.dump(record, fh)
except OSError:
    pass
