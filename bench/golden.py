"""Golden generation (the reference model's greedy decoding) against transformers' greedy `generate`.

Same model (the default config's fp32 checkpoints), same prompts, same number of new tokens, same
run. Prints seconds for: our greedy decoding of all prompts (the golden stage's greedy part), our
whole golden stage for the case (greedy + every DDTree trace), HF `generate` one prompt at a time,
and HF `generate` on the left-padded batch; and the peak RSS of the process.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python bench/golden.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from k2vec.stages.golden import make_golden, open_weights, reference_model  # noqa: E402
from k2vec.reference.generate import greedy_generate  # noqa: E402
from k2vec.config.expand import expand_config  # noqa: E402
from k2vec.stages.weights import write_checkpoint  # noqa: E402


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(1)
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    cases = expand_config(config)
    print(f"{'model':6} {'ours greedy':>12} {'ours golden':>12} {'HF 1-by-1':>10} {'HF batch':>9} "
          f"{'speedup 1-by-1':>15} {'speedup batch':>14} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in cases.items():
            ck = Path(tmp) / name
            write_checkpoint(case["model"], ck)
            prompts = case["prompts"]["tokens"]
            n_new = case["decoding"]["max_new_tokens"]
            weights = open_weights("fp32", ck)
            model = reference_model(case["model"], weights)
            t_ours, ours = best(lambda: greedy_generate(model, prompts, n_new, top_k=case["decoding"]["top_k"]),
                                args.repeat)
            t_golden, _ = best(lambda: make_golden(case, weights, "fp32"), 1)
            hf = DeepseekV3ForCausalLM.from_pretrained(ck, attn_implementation="eager", dtype=torch.float32).eval()

            def hf_one_by_one():
                with torch.no_grad():
                    return [hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False,
                                        min_new_tokens=n_new)[0, len(p):].tolist() for p in prompts]

            def hf_batch():
                width = max(map(len, prompts))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
                with torch.no_grad():
                    return hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                                       min_new_tokens=n_new)[:, width:].tolist()

            t_hf1, hf_tokens = best(hf_one_by_one, args.repeat)
            t_hfb, _ = best(hf_batch, args.repeat)
            same = sum(a.tokens.tolist() == b for a, b in zip(ours, hf_tokens))
            print(f"{name:6} {t_ours:11.3f}s {t_golden:11.3f}s {t_hf1:9.3f}s {t_hfb:8.3f}s "
                  f"{t_hf1 / t_ours:14.1f}x {t_hfb / t_ours:13.1f}x {len(prompts)}x{n_new} "
                  f"(greedy tokens equal to HF's on {same}/{len(prompts)} prompts)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB (torch and transformers included)")


if __name__ == "__main__":
    main()
