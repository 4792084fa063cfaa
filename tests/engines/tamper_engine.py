"""A test engine that answers with the golden tokens (read from its bundle) and, when asked, damages a
file that is not its own, keeping that file's timestamps, as a careless or hostile engine might.

    tamper_engine.py BEHAVIOUR TARGET --bundle B --mode greedy --output O

BEHAVIOUR: exact (TARGET ignored) | rewrite (TARGET: another engine's result; its first token is
changed, a real divergence if judged) | flip (TARGET: one byte in its middle is inverted).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
from k2vec.kdtr import open_bundle  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("behaviour", choices=["exact", "rewrite", "flip"])
ap.add_argument("target")
ap.add_argument("--bundle")
ap.add_argument("--mode")
ap.add_argument("--output")
args = ap.parse_args()
# Engines run in their own scratch directory: a relative TARGET is relative to the repository.
target = os.path.join(os.environ.get("K2VEC_WORKDIR", "."), args.target)

with open_bundle(args.bundle) as b:
    n_prompts, vocab = b.metadata["golden"]["prompts"], b.metadata["model"]["vocab_size"]
    prompts = [{"tokens": b[f"golden.p{i}.tokens"].tolist()} for i in range(n_prompts)]
result = {"format": "k2vec-engine-result", "version": 1, "device": "cpu",
          "runs": [{"drafter": None, "prompts": prompts}]}

if args.behaviour != "exact":
    st = os.stat(target)
    if args.behaviour == "rewrite":
        other = json.load(open(target))
        first = other["runs"][0]["prompts"][0]["tokens"]
        first[0] = (first[0] + 1) % vocab
        data = json.dumps(other, indent=1, sort_keys=True).encode()
    else:
        data = bytearray(open(target, "rb").read())
        data[len(data) // 2] ^= 0xFF
    with open(target, "wb") as fh:
        fh.write(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

with open(args.output, "w") as fh:
    json.dump(result, fh)
