"""DDTree's lossless check (report/lossless.py): an engine's DDTree tokens against its own greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from k2vec.report.classify import DEFAULT_BUDGETS, classify
from k2vec.report.lossless import lossless_columns, tie_credit
from k2vec.report.noise import NoiseModel, Rule

N = 6
GREEDY = [5, 7, 9, 11, 13, 15]
# the greedy run's top-k per step: its own token first, then the runners-up
TOPK_IDS = [[t, t + 1, t + 2] for t in GREEDY]
TOPK_LOGITS = [[10.0, 9.9, 4.0]] * N


def greedy_data(tokens=GREEDY):
    return {"tokens": list(tokens), "topk_ids": TOPK_IDS, "topk_logits": TOPK_LOGITS}


@dataclass
class Case:
    name: str
    tree_tokens: list[int]
    credit: float
    step: float | None          # expected own_greedy_step (None: NaN)
    gap: float | None
    broken: bool
    engine_with_greedy: str = "e"


CASES = [
    Case("equal to its greedy", GREEDY, 0.5, None, None, False),
    Case("runner-up by 0.1: a tie", [5, 7, 10, 11, 13, 15], 0.5, 2, 0.1, False),
    Case("third by 6.0: a tree bug", [5, 7, 11, 11, 13, 15], 0.5, 2, 6.0, True),
    Case("outside its top-k: over the last", [5, 7, 9, 99, 13, 15], 0.5, 3, 6.0, True),
    Case("third by 6.0 under a wide credit", [5, 7, 11, 11, 13, 15], 4.0, 2, 6.0, False),
    Case("no greedy run of its own", [5, 8, 9, 11, 13, 15], 0.5, None, None, False, engine_with_greedy="other"),
]


def frame(case: Case):
    base = pd.DataFrame([
        {"engine": case.engine_with_greedy, "model": "m", "precision": "fp32", "prompt": 0, "kind": "greedy",
         "status": "ok", "precision_class": "bfloat16", "first_step": np.nan},
        {"engine": "e", "model": "m", "precision": "fp32", "prompt": 0, "kind": "ddtree", "status": "ok",
         "precision_class": "bfloat16", "first_step": np.nan},
    ])
    data = [greedy_data(), {"tokens": case.tree_tokens}]
    return base, data


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_lossless_columns(case: Case):
    base, data = frame(case)
    out = lossless_columns(base, data, np.full((2, N), case.credit), N)
    assert np.isnan(out["own_greedy_step"][0]) and out["lossless"][0] is None   # the greedy row itself
    if case.step is None:
        assert np.isnan(out["own_greedy_step"][1]) and out["lossless"][1] is None
        return
    assert out["own_greedy_step"][1] == case.step
    assert out["own_greedy_gap"][1] == pytest.approx(case.gap)
    assert (out["lossless"][1] is not None) == case.broken
    if case.broken:
        assert f"step {case.step}" in out["lossless"][1] and "tree bug" in out["lossless"][1]


def test_a_lossless_breach_is_real_whatever_the_golden_says():
    rows = pd.DataFrame({
        "kind": ["ddtree", "ddtree"], "precision_class": ["bfloat16", "bfloat16"], "first_step": [3.0, 3.0],
        "margin": [0.5, 0.5], "golden_gap": [0.1, 0.1], "router_margin": [np.nan, np.nan],
        "noise_credit": [1.0, 1.0], "noise_before": [0.1, 0.1], "score_noise": [np.nan, np.nan],
        "logit_abs_max": [0.1, 0.1], "fingerprint_rel_before": [np.nan, np.nan],
        "fingerprint_rel_max": [np.nan, np.nan], "run_over_budget": [None, None], "noise_over": [None, None],
        "noise_router_credit": [np.nan, np.nan], "router_layer": [np.nan] * 2, "router_position": [np.nan] * 2,
        "router_evidence": [None, None], "lossless": [None, "its DDTree tokens leave ... a tree bug, not rounding"]})
    out = classify(rows, DEFAULT_BUDGETS, near_tie=1e-3, router_near_tie=1e-3)
    assert list(out["class"]) == ["precision-tie", "real"]


def test_tie_credit_follows_the_noise_model_on_the_golden_path_and_its_widest_after():
    base = pd.DataFrame({"model": ["m", "m", "x"], "precision": ["fp32"] * 3,
                         "precision_class": ["bfloat16", "bfloat16", "float32"], "prompt": [0, 0, 0],
                         "first_step": [np.nan, 2.0, np.nan]})
    env = np.array([[0.1, 0.2, 0.3, 0.4]])
    judged = np.array([[True, True, True, False]])   # step 3: a schedule flips an expert there
    nm = SimpleNamespace(env_logit=env, judged=judged)
    credit = tie_credit(base, {("m", "fp32", "bfloat16"): nm}, DEFAULT_BUDGETS, margin=2.0, n_steps=4)
    # on the golden's tokens: margin x the envelope there; an unjudged step or past the row's own departure
    # from the golden: margin x the widest judged envelope of the prompt
    np.testing.assert_allclose(credit[0], [0.2, 0.4, 0.6, 0.6])
    np.testing.assert_allclose(credit[1], [0.2, 0.4, 0.6, 0.6])
    base.loc[1, "first_step"] = 0.0
    np.testing.assert_allclose(tie_credit(base, {("m", "fp32", "bfloat16"): nm}, DEFAULT_BUDGETS, 2.0, 4)[1],
                               [0.2, 0.6, 0.6, 0.6])
    # no noise model: the precision's logit budget
    np.testing.assert_allclose(credit[2], DEFAULT_BUDGETS["float32"]["logit_abs"])


def test_flippable_steps_find_the_first_router_decision_a_correct_engine_may_flip():
    """A DDTree result records no routing: from the first step whose fed position holds a golden router decision
    within twice `margin` times the noise model's movement of it, a divergence may be a flipped expert."""
    from k2vec.report.lossless import flippable_steps
    margins = np.full((2, 8, 2), 0.5)           # [prompts, positions, MoE layers]
    env = np.full((2, 8, 2), 0.001)
    margins[0, 5, 1] = 0.003                     # prompt 0: position 5, layer index 1: 0.003 <= 2 x 2 x 0.001
    margins[1, 6, 0] = 0.005                     # prompt 1: 0.005 > 0.004, not flippable
    nm = SimpleNamespace(golden_router_margins=margins, env_router=env,
                         fed=np.array([[3, 4, 5, 6, 7], [2, 3, 4, 5, 6]]),
                         router_tie_bound=lambda rule: NoiseModel.router_tie_bound(nm, rule))
    base = pd.DataFrame({"model": "m", "precision": "int4", "precision_class": "bfloat16", "prompt": [0, 1, 0],
                         "kind": ["ddtree", "ddtree", "greedy"]})
    out = flippable_steps(base, {("m", "int4", "bfloat16"): nm}, {("m", "int4"): np.array([1, 2])},
                          Rule(margin=2.0, fraction=0.2, min_cells=6))
    assert out["step"][0] == 2 and out["router_position"][0] == 5 and out["router_layer"][0] == 2
    assert out["router_margin"][0] == pytest.approx(0.003)
    assert np.isinf(out["step"][1]) and np.isnan(out["router_margin"][1])   # nothing a correct engine flips
    assert np.isnan(out["step"][2])                                        # not a DDTree row


def test_a_lossless_breach_from_a_flippable_step_on_is_not_judged():
    base, data = frame(CASES[2])                 # the DDTree row leaves its greedy at step 2 by 6.0
    at_2 = lossless_columns(base, data, np.full((2, N), 0.5), N, flippable=np.array([np.nan, 2.0]))
    assert at_2["own_greedy_step"][1] == 2 and at_2["lossless"][1] is None
    at_3 = lossless_columns(base, data, np.full((2, N), 0.5), N, flippable=np.array([np.nan, 3.0]))
    assert at_3["lossless"][1] is not None


def test_a_greedy_run_whose_top_k_stops_short_gives_no_verdict():
    base, data = frame(CASES[2])                 # parts at step 2
    data[0] = {**data[0], "topk_ids": TOPK_IDS[:2], "topk_logits": TOPK_LOGITS[:2]}
    out = lossless_columns(base, data, np.full((2, N), 0.5), N)
    assert np.isnan(out["own_greedy_step"][1]) and out["lossless"][1] is None
