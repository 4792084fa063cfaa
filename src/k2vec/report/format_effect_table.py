"""The format effect: how far INT4 quantization moves the model, the int4 golden against the fp32 one.

Two views: (1) both goldens decode their own tokens, compared up to their first divergence (the
table below the score table, format_effect.csv); (2) the int4 golden model forced on the fp32 golden
sequence (results/format-effect/{model}.json, a score-mode result) judged as the engine
`int4-format` on fp32: one more row of the score table, next to the engines'.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from k2vec.report.classify import classify
from k2vec.report.compare import compare_rows, finish_frame
from k2vec.report.golden_data import Golden, ReportError


def format_effect(opened: dict[tuple[str, str], Golden], th: dict[str, float], budgets):
    """How far quantization moves the model: the int4 golden compared to the fp32 golden as if it
    were an engine. Both decode their own tokens, so steps are compared up to the first divergence."""
    frames, step_frames, model_rows = [], [], []
    for model in sorted({m for m, _ in opened}):
        if (model, "fp32") not in opened or (model, "int4") not in opened:
            continue
        fp, q = opened[(model, "fp32")], opened[(model, "int4")]
        if fp.n_prompts != q.n_prompts or fp.N != q.N:
            raise ReportError(f"the fp32 and int4 goldens of model {model!r} were made from different prompt "
                              f"counts or decoding settings ({fp.path}, {q.path})")
        # the int4 prompts stage re-draws a prompt blind under the int4 weights: compare the shared ones
        shared = np.array([i for i in range(q.n_prompts) if np.array_equal(fp.prompts[i], q.prompts[i])], np.int64)
        redrawn = sorted(set(range(q.n_prompts)) - set(shared.tolist()))
        if shared.size == 0:
            continue
        datas = [{"tokens": q.tokens[i], "topk_ids": q.topk_ids[i], "topk_logits": q.topk_logits[i],
                  "fingerprints": q.fingerprints[i],
                  "router_experts": q.router_ids[i, q.prompt_lengths[i] - 1:q.prompt_lengths[i] - 1 + q.N]}
                 for i in shared]
        cols, steps, _ = compare_rows(fp, datas, shared, fp.tokens[shared], fingerprint_rtol=th["fingerprint_rtol"])
        df = pd.DataFrame({"model": model, "prompt": shared, **cols})
        # classified without a precision budget or noise credit: near-tie, router-near-tie or real
        df = classify(df.assign(kind="greedy", precision_class=None, run_over_budget=None, score_noise=np.nan,
                                noise_before=np.nan), budgets,
                      near_tie=th["near_tie"], router_near_tie=th["router_near_tie"])
        # steps compared = matched + the divergent one; same top-1 on all but the divergent one
        compared = np.minimum(df["matched_steps"] + 1, fp.N)
        df["same_top1"] = df["matched_steps"] / compared   # censored: the divergent step is the only miss
        df["int4_margin"] = np.where(df["first_step"].notna(),
                                     q.margins[shared, np.minimum(df["matched_steps"].astype(int), fp.N - 1)], np.nan)
        frames.append(df)
        steps = steps.assign(model=model, prompt=shared[steps["i"].to_numpy()]).drop(columns="i")
        step_frames.append(steps)
        # pooled over prompts: the fraction of compared steps with the same top-1 (the censored
        # geometric estimate of the per-step agreement probability)
        model_rows.append({"model": model, "prompts": len(df), "int4_redrawn_prompts": redrawn, "max_new_tokens": fp.N,
                           "diverged": int(df["first_step"].notna().sum()),
                           "same_top1_rate": df["matched_steps"].sum() / compared.sum(),
                           "mean_first_step": df["first_step"].mean(), "kl_mean": steps["kl"].mean(),
                           "kl_max": steps["kl"].max(), "topk_overlap": steps["overlap"].mean(),
                           "logit_abs_max": df["logit_abs_max"].max(),
                           "fp32": str(fp.path), "int4": str(q.path)})
    fe_cols = ["model", "prompt", "class", "first_step", "matched_steps", "golden_token", "engine_token",
               "golden_rank_in_engine", "engine_rank_in_golden", "margin", "int4_margin", "same_top1",
               "kl_mean", "kl_max", "topk_overlap", "logit_abs_max", "logit_rel_max", "logit_nmse",
               "first_bad_step", "first_bad_layer", "first_bad_rel_err", "router_diff_step", "router_diff_layer"]
    fe = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=fe_cols)
    fe = finish_frame(fe, fe_cols)[fe_cols].rename(columns={
        "golden_token": "fp32_token", "engine_token": "int4_token", "golden_rank_in_engine": "fp32_rank_in_int4",
        "engine_rank_in_golden": "int4_rank_in_fp32", "margin": "fp32_margin"})
    fs = pd.concat(step_frames, ignore_index=True) if step_frames else pd.DataFrame(
        columns=["model", "prompt", "step", "abs_max", "kl", "overlap"])
    return fe, fs[["model", "prompt", "step", "abs_max", "kl", "overlap"]], pd.DataFrame(model_rows)
