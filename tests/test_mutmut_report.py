"""Report budgets, score verdicts and the top-k KL: what mutmut (tools/mutmut.sh report) found
unchecked. Expected values are computed here by hand, not by the report code."""
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from k2vec.report.classify import DEFAULT_BUDGETS, BudgetError, classify, resolve_budgets
from k2vec.report.logits import compare_logits, topk_kl
from k2vec.report.score import SCORE_COLUMNS, _over_budget, score_stats
from k2vec.report.tokens import compare_tokens


@pytest.mark.parametrize("budgets, message", [
    ({"int8": {}}, "report.budgets.int8: unknown precision; known: float32, bfloat16, float16, fp8"),
    ({"float32": {"kl": 1}}, "report.budgets.float32.kl: unknown budget; known: logit_abs, hidden_rel, same_top1, "
                             "kl_mean, kl_p99"),
    ({"bfloat16": {"kl_mean": "0.1"}}, "report.budgets.bfloat16.kl_mean: '0.1' is not a number or null"),
])
def test_bad_budget_names_the_key(budgets, message):
    with pytest.raises(BudgetError) as err:
        resolve_budgets(budgets)
    assert str(err.value) == message


def test_budget_overrides_are_laid_over_the_defaults_without_changing_them():
    before = {p: dict(b) for p, b in DEFAULT_BUDGETS.items()}
    out = resolve_budgets({"float32": {"logit_abs": 2, "hidden_rel": None}, "fp8": None})
    assert out["float32"] == {**before["float32"], "logit_abs": 2.0, "hidden_rel": None}
    assert type(out["float32"]["logit_abs"]) is float
    assert out["fp8"] == before["fp8"] and out["bfloat16"] == before["bfloat16"]
    assert DEFAULT_BUDGETS == before
    assert resolve_budgets(None) == before


BUDGET = {"same_top1": 0.8, "kl_mean": 0.1, "kl_p99": 2.0}


@pytest.mark.parametrize("rec, budget, why", [
    ({"positions": 10, "same_top1": 0.8, "kl_mean": 0.1, "kl_p99": 2.0}, BUDGET, None),   # at the budget: within
    ({"positions": 10, "same_top1": 0.5, "kl_mean": 0.2, "kl_p99": 2.5}, BUDGET,
     "same top-1 0.500 < 0.8; kl_mean 0.2 > 0.1; kl_p99 2.5 > 2"),
    ({"positions": 10, "same_top1": 0.9, "kl_mean": 0.05, "kl_p99": 2.0001}, BUDGET, "kl_p99 2 > 2"),
    ({"positions": 10, "same_top1": 0.1, "kl_mean": 9.0, "kl_p99": 9.0},
     {"same_top1": None, "kl_mean": None, "kl_p99": 10.0}, None),                        # null: not checked
    ({"positions": 0, "same_top1": 1.0, "kl_mean": math.nan, "kl_p99": math.nan}, BUDGET,
     "no logits to score (topk_ids / topk_logits missing)"),
    ({"positions": 0, "same_top1": 1.0, "kl_mean": math.nan, "kl_p99": math.nan}, None, None),  # no budget
])
def test_score_run_over_budget_reasons(rec, budget, why):
    assert _over_budget(rec, budget) == why


def kl_by_hand(p_logits: dict, q_logits: dict) -> float:
    """KL(p || q) over the union of ids, softmax over each side's logits."""
    ids = sorted(p_logits)
    p = np.array([p_logits[i] for i in ids])
    q = np.array([q_logits[i] for i in ids])
    p, q = np.exp(p - p.max()), np.exp(q - q.max())
    p, q = p / p.sum(), q / q.sum()
    return float((p * np.log(p / q)).sum())


def test_topk_kl_on_the_union_with_floors():
    # golden lists ids 1, 2, 3; the engine lists 2, 4, 1. Id 3 is missing from the engine: it gets the
    # engine's lowest listed logit (-1.0); id 4 is missing from the golden: it gets the golden's lowest (0.5).
    Gids, Glog = np.array([[1, 2, 3]]), np.array([[2.0, 1.0, 0.5]])
    Eids, Elog = np.array([[2, 4, 1]]), np.array([[1.5, 0.0, -1.0]])
    expected = kl_by_hand({1: 2.0, 2: 1.0, 3: 0.5, 4: 0.5}, {1: -1.0, 2: 1.5, 3: -1.0, 4: 0.0})
    assert topk_kl(Gids, Glog, Eids, Elog)[0] == pytest.approx(expected, rel=1e-12)


def test_topk_kl_uses_the_top_m_of_the_longer_side_and_skips_missing_engine_ids():
    # golden k = 4, engine k = 2: only the golden's top 2 count; an engine id of -1 is "not listed"
    Gids, Glog = np.array([[5, 6, 7, 8], [5, 6, 7, 8]]), np.array([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    Eids, Elog = np.array([[6, 5], [5, -1]]), np.array([[2.5, 2.0], [3.0, -9.0]])
    kl = topk_kl(Gids, Glog, Eids, Elog)
    assert kl[0] == pytest.approx(kl_by_hand({5: 3.0, 6: 2.0}, {5: 2.0, 6: 2.5}), rel=1e-12)
    # row 1: the engine lists only id 5; id 6 gets the engine's floor, its own logit 3.0
    assert kl[1] == pytest.approx(kl_by_hand({5: 3.0, 6: 2.0}, {5: 3.0, 6: 3.0}), rel=1e-12)
    same = topk_kl(Gids, Glog, Gids, Glog)
    assert np.array_equal(same, [0.0, 0.0])


# ------------------------------------------------------------------------ tokens and logits, by hand
# A golden of 2 prompts x 4 steps x top-3, small enough that every expected column is worked out below
# from the numbers (compare_tokens / compare_logits read only N, K, margins, topk_ids, topk_logits).

G_IDS = np.array([[[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]],
                  [[110, 111, 112], [120, 121, 122], [130, 131, 132], [140, 141, 142]]])
G_LOG = np.array([[[5.0, 4.0, 2.0], [6.0, 5.5, 1.0], [3.0, 2.9, -1.0], [7.0, 1.0, 0.5]],
                  [[2.0, 1.75, 1.0], [3.0, 2.25, 0.0], [4.0, 2.0, 1.5], [1.0, -2.0, -3.0]]])
G_TOK = G_IDS[:, :, 0]


def fake_golden():
    return SimpleNamespace(N=4, K=3, topk_ids=G_IDS, topk_logits=G_LOG, margins=G_LOG[..., 0] - G_LOG[..., 1])


def test_compare_tokens_columns_by_hand():
    datas = [{"tokens": [10, 20, 30, 40]},            # r0 greedy, equal
             {"tokens": [10, 20, 32, 99]},            # r1 greedy, golden rank 2 at step 2
             {"tokens": [110, 999, 130, 141]},        # r2 score: steps 1 and 3 differ, 999 not listed
             {"tokens": None},                        # r3 greedy, no tokens
             {"tokens": [10, 20]},                    # r4 greedy, stops after 2 steps
             {"tokens": [10, 21, 31, 40]},            # r5 DDTree against its trace [10, 21, 30, 40]
             {"tokens": [110, 120, 130, 140]},        # r6 score, equal
             {"tokens": [0, 20, 30, 40]}]             # r7 greedy, token 0 (a real id) at step 0
    prompt = np.array([0, 0, 1, 1, 0, 0, 1, 0])
    ref = G_TOK[prompt].copy()
    ref[5, 1] = 21
    score = np.array([False, False, True, False, False, False, True, False])
    cols, arr = compare_tokens(fake_golden(), datas, prompt, ref, score)
    nan = np.nan
    expected = {
        "first_step": [nan, 2, 1, 0, 2, 2, nan, 0],
        "matched_steps": [4, 2, 1, 0, 2, 2, 4, 0],
        "same_top1": [nan, nan, 0.5, nan, nan, nan, 1.0, nan],
        "golden_token": [nan, 30, 120, 110, 30, 30, nan, 10],
        "engine_token": [nan, 32, 999, nan, nan, 31, nan, 0],
        "margin": [nan, 0.1, 0.75, 0.25, 0.1, 0.1, nan, 1.0],
        # golden top-1 logit minus the engine token's (or, not listed, minus the last listed one)
        "golden_gap": [nan, 4.0, 3.0, 1.0, 4.0, 0.1, nan, 3.0],
        "engine_rank_in_golden": [nan, 2, nan, nan, nan, 1, nan, nan],
    }
    assert set(cols) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(cols[name], want, rtol=1e-12, err_msg=name)
    assert arr["has_div"].tolist() == [False, True, True, True, True, True, False, True]
    assert arr["fs"].tolist() == [4, 2, 1, 0, 2, 2, 4, 0] and arr["fs_c"].tolist() == [3, 2, 1, 0, 2, 2, 3, 0]
    assert arr["g_tok"].tolist() == [40, 30, 120, 110, 30, 30, 140, 10]
    # compared steps: up to the divergent one; every step of a score row
    assert arr["upto"].astype(int).tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0],
                                                [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_compare_logits_columns_and_steps_by_hand():
    """Rows: A greedy without divergence, B greedy diverging at step 1 (its steps 2, 3 are not compared),
    C without top-k, D a score row whose engine lists 2 ids and stops after 3 steps, E ids without logits."""
    datas = [
        {"topk_ids": [[10, 11, 12], [21, 20, 99], [30, 31, 32], [40, 41, 42]],
         "topk_logits": [[5.5, 4.0, 2.0], [5.25, 6.0, 0.0], [3.0, 2.9, -1.0], [7.0, 1.0, 0.5]]},
        {"topk_ids": [[110, 111, 112], [121, 120, 122], [999, 998, 997], [999, 998, 997]],
         "topk_logits": [[2.0, 1.75, 1.25], [3.5, 3.0, 0.0], [100.0, 0.0, -100.0], [100.0, 0.0, -100.0]]},
        {"topk_ids": None, "topk_logits": None},
        {"topk_ids": [[110, 111], [120, 121], [131, 130]], "topk_logits": [[2.0, 1.75], [3.25, 2.25], [2.5, 4.0]]},
        {"topk_ids": G_IDS[0].tolist(), "topk_logits": None},
    ]
    prompt = np.array([0, 1, 0, 1, 0])
    fs = np.array([4, 1, 4, 2, 4])
    upto = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
    has_div = np.array([False, True, False, True, False])
    g_tok = np.array([40, 120, 40, 130, 40])
    cols, steps = compare_logits(fake_golden(), datas, prompt, upto, fs, np.minimum(fs, 3), has_div, g_tok)

    # per-step KL by hand: each side's missing ids at its own lowest listed logit
    kl_a = [kl_by_hand({10: 5, 11: 4, 12: 2}, {10: 5.5, 11: 4, 12: 2}),
            kl_by_hand({20: 6, 21: 5.5, 22: 1, 99: 1}, {20: 6, 21: 5.25, 22: 0, 99: 0}), 0.0, 0.0]
    kl_b = [kl_by_hand({110: 2, 111: 1.75, 112: 1}, {110: 2, 111: 1.75, 112: 1.25}),
            kl_by_hand({120: 3, 121: 2.25, 122: 0}, {120: 3, 121: 3.5, 122: 0})]
    kl_d = [kl_by_hand({110: 2, 111: 1.75, 112: 1}, {110: 2, 111: 1.75, 112: 1.75}),
            kl_by_hand({120: 3, 121: 2.25, 122: 0}, {120: 3.25, 121: 2.25, 122: 2.25}),
            kl_by_hand({130: 4, 131: 2, 132: 1.5}, {130: 4, 131: 2.5, 132: 2.5})]
    nan = np.nan
    # logit errors on the shared ids: A 0.5 (id 10) and 0.25 (id 21) among 11 pairs; B 0.25 (id 112),
    # 1.25 (id 121) among 6; D 0.25 (id 120), 0.5 (id 131) among 6. p99: linear between the two largest.
    expected = {
        "golden_rank_in_engine": [nan, 1, nan, 1],
        "logit_steps": [4, 2, nan, 3],
        "topk_overlap": [11 / 12, 1.0, nan, 0.5],
        "logit_abs_max": [0.5, 1.25, nan, 0.5],
        "logit_abs_mean": [0.75 / 11, 1.5 / 6, nan, 0.75 / 6],
        "logit_abs_p99": [0.25 + 0.9 * 0.25, 0.25 + 0.95 * 1.0, nan, 0.25 + 0.95 * 0.25],
        "logit_rel_max": [0.1, 1.25 / 2.25, nan, 0.25],
        "logit_rel_mean": [(0.1 + 0.25 / 5.5) / 11, (0.25 + 1.25 / 2.25) / 6, nan, (0.25 / 3 + 0.25) / 6],
        "logit_rel_p99": [0.25 / 5.5 + 0.9 * (0.1 - 0.25 / 5.5), 0.25 + 0.95 * (1.25 / 2.25 - 0.25), nan,
                          0.25 / 3 + 0.95 * (0.25 - 0.25 / 3)],
        "logit_nmse": [(0.25 + 0.0625) / (45 + 36 + 30.25 + 9 + 8.41 + 1 + 49 + 1 + 0.25),
                       (0.0625 + 1.5625) / (4 + 3.0625 + 1 + 9 + 5.0625 + 0),
                       nan, (0.0625 + 0.25) / (4 + 3.0625 + 9 + 5.0625 + 16 + 4)],
        "kl_mean": [np.mean(kl_a), np.mean(kl_b), nan, np.mean(kl_d)],
        "kl_p99": [np.percentile(kl_a, 99), np.percentile(kl_b, 99), nan, np.percentile(kl_d, 99)],
        "kl_max": [max(kl_a), max(kl_b), nan, max(kl_d)],
        # the largest error on the steps before the divergence (A: every step, B: step 0, D: steps 0, 1)
        "noise_before": [0.5, 0.25, nan, 0.25],
    }
    assert set(cols) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(cols[name], want + [nan], rtol=1e-12, err_msg=name)   # E: not compared

    assert list(steps.columns) == ["i", "step", "abs_max", "kl", "overlap", "sq_err", "sq_ref"]
    want = pd.DataFrame({
        "i": [0, 0, 0, 0, 1, 1, 3, 3, 3, 3], "step": [0, 1, 2, 3, 0, 1, 0, 1, 2, 3],
        "abs_max": [0.5, 0.25, 0, 0, 0.25, 1.25, 0, 0.25, 0.5, nan],
        "kl": kl_a + kl_b + kl_d + [nan],
        "overlap": [1, 2 / 3, 1, 1, 1, 1, 2 / 3, 2 / 3, 2 / 3, 0],
        "sq_err": [0.25, 0.0625, 0, 0, 0.0625, 1.5625, 0, 0.0625, 0.25, nan],
        "sq_ref": [45, 66.25, 18.41, 50.25, 8.0625, 14.0625, 7.0625, 14.0625, 20, nan]})
    pd.testing.assert_frame_equal(steps.reset_index(drop=True).astype(float), want.astype(float), rtol=1e-12)
    assert (steps.dtypes.iloc[2:] == "float64").all()   # numbers (NaN where none), as the plots and pooling read them


# ------------------------------------------------------------------------------------ classification

BUDGETS = {"float32": {"logit_abs": 1e-3, "hidden_rel": 1e-3, "same_top1": 0.98, "kl_mean": 1e-10, "kl_p99": 1e-9},
           "bfloat16": {"logit_abs": 8.0, "hidden_rel": None, "same_top1": 0.8, "kl_mean": 0.2, "kl_p99": 4.0}}
NEAR, ROUTER = 0.01, 0.02
# kind, precision, first_step, noise_before, score_noise, logit_abs_max, fp_before, fp_max, run_over_budget,
# margin, golden_gap, router_margin, noise_credit (the noise model's, report/noise.py) -> class, noise, over_budget
CASES = [
    ("greedy", "float32", None, None, None, 5e-4, None, 5e-4, None, None, None, None, None, "exact", None, None),
    # at the budget
    ("greedy", "float32", None, None, None, 1e-3, None, 1e-3, None, None, None, None, None, "exact", None, None),
    ("greedy", "float32", None, None, None, 2e-3, None, 0, None, None, None, None, None, "over-budget", None,
     "logit error 0.002 > logit_abs 0.001"),
    ("greedy", "float32", None, None, None, 0, None, 3e-3, None, None, None, None, None, "over-budget", None,
     "fingerprint rel. error 0.003 > hidden_rel 0.001"),
    ("greedy", "float32", None, None, None, 2e-3, None, 3e-3, None, None, None, None, None, "over-budget", None,
     "logit error 0.002 > logit_abs 0.001"),                                      # the logit reason first
    # hidden_rel null
    ("greedy", "bfloat16", None, None, None, 7.0, None, 50.0, None, None, None, None, None, "exact", None, None),
    ("greedy", "bfloat16", 3, 0.1, None, 20.0, None, None, None, 0.005, 5.0, 0.001, 0.1, "near-tie", 0.1, None),
    ("greedy", "bfloat16", 3, 0.1, None, 20.0, None, None, None, 0.01, 5.0, 0.001, 0.1, "router-near-tie", 0.1, None),
    ("greedy", "bfloat16", 3, 0.1, None, 20.0, None, None, None, 0.5, 0.2, 0.02, 0.1, "precision-tie", 0.1, None),
    ("greedy", "bfloat16", 3, 0.1, None, 20.0, None, None, None, 0.5, 0.21, 0.02, 0.1, "real", 0.1, None),
    # the engine's own noise (5, within the budget) buys no credit: the noise model's 0.05 does not cover 0.2
    ("greedy", "bfloat16", 3, 5.0, 5.0, 20.0, None, None, None, 0.5, 0.2, 0.5, 0.05, "real", 0.05, None),
    ("greedy", "bfloat16", 3, 0.05, 0.1, 20.0, None, None, None, 0.5, 0.2, 0.5, 0.1, "precision-tie", 0.1, None),
    # no noise model: the budget's logit_abs is the credit
    ("greedy", "bfloat16", 3, 0.05, None, 20.0, None, None, None, 0.5, 15.0, 0.5, None, "precision-tie", 8.0, None),
    ("greedy", "bfloat16", 3, 9.0, None, 20.0, None, None, None, 0.001, 0.2, 0.001, 0.1, "real", 0.1,
     "logit error before the divergence 9 > logit_abs 8"),
    ("greedy", "float32", 3, 1e-4, None, 9.0, 2e-3, 9.0, None, 0.5, 0.2, 0.5, None, "real", 1e-3,
     "fingerprint rel. error before the divergence 0.002 > hidden_rel 0.001"),
    ("ddtree", "bfloat16", 3, 0.1, None, 20.0, None, None, "kl_mean 0.3 > 0.2", 0.001, 0.1, 0.001, 0.1, "real", 0.1,
     "score run over budget: kl_mean 0.3 > 0.2"),
    ("greedy", "bfloat16", None, None, None, 1.0, None, None, "kl_mean 0.3 > 0.2", None, None, None, None,
     "over-budget", None, "score run over budget: kl_mean 0.3 > 0.2"),
    ("greedy", "bfloat16", None, None, None, 9.0, None, None, "kl_mean 0.3 > 0.2", None, None, None, None,
     "over-budget", None, "logit error 9 > logit_abs 8"),        # its own reason before the score run's
    ("score", "bfloat16", None, None, None, 7.5, None, None, None, None, None, None, None, "exact", None, None),
    ("score", "bfloat16", 2, 0.5, 7.5, 7.5, None, None, None, 0.001, 0.1, 0.001, None, "within-budget", None, None),
    ("score", "bfloat16", 2, 0.5, 9.0, 9.0, None, None, None, 0.001, 0.1, 0.001, None, "over-budget", None,
     "logit error 9 > logit_abs 8"),
    ("score", "bfloat16", None, None, None, 1.0, None, None, "same top-1 0.5 < 0.8", None, None, None, None,
     "over-budget", None, "score run over budget: same top-1 0.5 < 0.8"),
    ("greedy", None, 3, None, None, 100.0, None, None, None, 0.5, 0.01, 0.5, None, "real", None, None),  # no precision
]


def test_classify_each_class_and_reason_by_hand():
    cols = ["kind", "precision_class", "first_step", "noise_before", "score_noise", "logit_abs_max",
            "fingerprint_rel_before", "fingerprint_rel_max", "run_over_budget", "margin", "golden_gap", "router_margin",
            "noise_credit"]
    rows = pd.DataFrame([c[:13] for c in CASES], columns=cols)
    for c in cols[2:]:
        if c != "run_over_budget":
            rows[c] = rows[c].astype(float)
    rows["router_layer"], rows["router_position"], rows["router_evidence"] = 2.0, 7.0, "engine routing differs"
    before = rows.copy()
    out = classify(rows, BUDGETS, near_tie=NEAR, router_near_tie=ROUTER)
    assert out["class"].tolist() == [c[13] for c in CASES]
    np.testing.assert_array_equal(out["noise"].to_numpy(float), np.array([c[14] for c in CASES], float))
    assert [None if pd.isna(v) else v for v in out["over_budget"]] == [c[15] for c in CASES]
    # router evidence is kept only where it is the reason for the class
    tie = out["class"] == "router-near-tie"
    assert out.loc[tie, ["router_margin", "router_layer", "router_position"]].values.tolist() == [[0.001, 2.0, 7.0]]
    assert out.loc[tie, "router_evidence"].tolist() == ["engine routing differs"]
    assert out.loc[~tie, ["router_margin", "router_layer", "router_position", "router_evidence"]].isna().all().all()
    pd.testing.assert_frame_equal(rows, before)   # the input frame is left as it was


def test_score_stats_by_hand():
    """Run a: two prompts of a bfloat16 engine, 6 finite KL positions (one NaN); run b: the reference row."""
    rows = pd.DataFrame({"run": ["a", "a", "b"], "engine": ["e", "e", "int4-format"], "model": "m",
                         "precision": "fp32", "precision_class": ["bfloat16", "bfloat16", "float32"],
                         "reference": [False, False, True], "prompt": [0, 1, 0], "same_top1": [0.75, 1.0, 0.5]},
                        index=[5, 7, 9])
    nan = np.nan
    steps = pd.DataFrame({"row": [5, 5, 5, 7, 7, 7, 7, 9, 9, 11],
                          "step": [0, 1, 2, 0, 1, 2, 3, 0, 1, 0],
                          "kl": [0.1, 0.5, nan, 0.3, 0.05, 0.2, 0.25, 0.0, 1.0, 99.0],   # row 11: not a score row
                          "sq_err": [0.1, 0.2, nan, 0.3, 0.4, 0.0, 0.0, nan, nan, 99.0],
                          "sq_ref": [1.0, 2.0, nan, 3.0, 3.0, 3.0, 3.0, nan, nan, 99.0]})
    out = score_stats(rows, steps, BUDGETS)
    assert list(out.columns) == SCORE_COLUMNS
    a, b = out.to_dict("records")
    assert {k: a[k] for k in ("run", "engine", "model", "precision", "precision_class", "reference", "prompts",
                              "positions", "verdict", "over_budget")} == {
        "run": "a", "engine": "e", "model": "m", "precision": "fp32", "precision_class": "bfloat16",
        "reference": False, "prompts": 2, "positions": 6, "verdict": "over budget",
        "over_budget": "kl_mean 0.233 > 0.2"}
    assert a["same_top1"] == pytest.approx(0.875) and a["kl_mean"] == pytest.approx(1.4 / 6)
    assert a["kl_p99"] == pytest.approx(0.3 + 0.95 * 0.2) and a["kl_max"] == 0.5
    assert a["logit_nmse"] == pytest.approx(1.0 / 15)
    # the 5 largest, largest first; 0.05 is the sixth
    assert a["top_kl"] == "p0 step 1: 0.5; p1 step 0: 0.3; p1 step 3: 0.25; p1 step 2: 0.2; p0 step 0: 0.1"
    assert (b["run"], b["engine"], b["reference"], b["verdict"]) == ("b", "int4-format", True, "reference")
    assert pd.isna(b["over_budget"])
    assert (b["prompts"], b["positions"], b["same_top1"], b["kl_mean"], b["kl_max"]) == (1, 2, 0.5, 0.5, 1.0)
    assert math.isnan(b["logit_nmse"]) and b["top_kl"] == "p0 step 1: 1; p0 step 0: 0"
    # a precision class without a budget: within budget, no reason
    c = score_stats(rows.iloc[:2].assign(precision_class="fp8"), steps, BUDGETS).iloc[0]
    assert c["verdict"] == "within budget" and pd.isna(c["over_budget"])
    assert score_stats(rows.iloc[:0], steps, BUDGETS).columns.tolist() == SCORE_COLUMNS


def test_topk_kl_counts_token_id_0_as_a_listed_id():
    # the engine lists token 0 (not in the golden's list) as its lowest logit: it joins the union (at the
    # golden's lowest logit, 0.5) and is the engine's floor for the golden's id 3 it does not list
    Gids, Glog = np.array([[1, 2, 3]]), np.array([[2.0, 1.0, 0.5]])
    Eids, Elog = np.array([[1, 2, 0]]), np.array([[2.5, 1.0, -1.0]])
    expected = kl_by_hand({0: 0.5, 1: 2.0, 2: 1.0, 3: 0.5}, {0: -1.0, 1: 2.5, 2: 1.0, 3: -1.0})
    assert topk_kl(Gids, Glog, Eids, Elog)[0] == pytest.approx(expected, rel=1e-12)


def test_topk_kl_batched_over_rows_and_steps_takes_m_from_the_id_axis():
    # [rows 1, steps 2, k 3]: m = 3 (the id axis), not the 2 steps; an engine id of -1 (padding) is not
    # listed, and its -inf terms raise no floating-point warning
    Gids, Glog = np.array([[[1, 2, 3], [4, 5, 6]]]), np.array([[[3.0, 2.0, 1.0], [1.0, 0.0, -1.0]]])
    Eids, Elog = np.array([[[1, 3, 2], [5, 4, -1]]]), np.array([[[3.0, 2.5, 0.5], [1.5, 1.0, np.nan]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl = topk_kl(Gids, Glog, Eids, Elog)
    assert kl.shape == (1, 2)
    assert kl[0, 0] == pytest.approx(kl_by_hand({1: 3.0, 2: 2.0, 3: 1.0}, {1: 3.0, 2: 0.5, 3: 2.5}), rel=1e-12)
    assert kl[0, 1] == pytest.approx(kl_by_hand({4: 1.0, 5: 0.0, 6: -1.0}, {4: 1.0, 5: 1.5, 6: 1.0}), rel=1e-12)


def test_score_run_without_topk_logits_is_over_budget_not_a_crash():
    """No run listed top-k logits: the report's step frame is empty (object columns, as compute_metrics
    builds it); the score run has nothing to score and says so, with no warning."""
    rows = pd.DataFrame({"run": "r", "engine": "e", "model": "m", "precision": "fp32", "precision_class": "bfloat16",
                         "reference": False, "prompt": [0, 1], "same_top1": [1.0, 0.5]})
    steps = pd.DataFrame(columns=["row", "step", "abs_max", "kl", "overlap", "sq_err", "sq_ref"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (r,) = score_stats(rows, steps, BUDGETS).to_dict("records")
    assert (r["prompts"], r["positions"], r["same_top1"], r["top_kl"]) == (2, 0, 0.75, "")
    assert all(math.isnan(r[k]) for k in ("kl_mean", "kl_p99", "kl_max", "logit_nmse"))
    assert (r["verdict"], r["over_budget"]) == ("over budget", "no logits to score (topk_ids / topk_logits missing)")


def test_score_table_rows_are_in_run_name_order():
    rows = pd.DataFrame({"run": ["zeta", "alpha", "mid"], "engine": ["z", "a", "m"], "model": "m", "precision": "fp32",
                         "precision_class": "bfloat16", "reference": False, "prompt": 0, "same_top1": 1.0})
    steps = pd.DataFrame({"row": [0, 1, 2], "step": 0, "kl": [0.1, 0.2, 0.3], "sq_err": 0.0, "sq_ref": 1.0})
    out = score_stats(rows, steps, BUDGETS)
    assert out["run"].tolist() == ["alpha", "mid", "zeta"] and out["kl_max"].tolist() == [0.2, 0.3, 0.1]


def test_compare_logits_without_any_topk_row_gives_nan_columns_and_an_empty_step_frame():
    datas = [{"tokens": [10, 20, 30, 40]}, {"topk_ids": None, "topk_logits": None}]
    fs, upto = np.array([4, 4]), np.ones((2, 4), bool)
    cols, steps = compare_logits(fake_golden(), datas, np.array([0, 0]), upto, fs, fs - 1, np.zeros(2, bool),
                                 np.array([40, 40]))
    assert all(np.isnan(v).all() and v.shape == (2,) for v in cols.values())
    assert steps.empty and list(steps.columns) == ["i", "step", "abs_max", "kl", "overlap", "sq_err", "sq_ref"]


def test_compare_logits_rows_with_no_or_one_shared_id():
    """`none`: an engine that listed empty top-k lists; `one`: top-k lists that share a single id with
    the golden's (id 30 at step 2, 0.5 off): its errors are that one pair's, the other's are not 0 but NaN."""
    none = {"topk_ids": [], "topk_logits": []}
    one = {"topk_ids": [[99, 98, 97], [99, 98, 97], [30, 98, 97], [99, 98, 97]],
           "topk_logits": [[1.0, 0.0, -1.0], [1.0, 0.0, -1.0], [3.5, 0.0, -1.0], [1.0, 0.0, -1.0]]}
    fs, upto, g_tok = np.array([4, 4]), np.ones((2, 4), bool), np.array([40, 40])
    cols, steps = compare_logits(fake_golden(), [none], np.array([0]), upto[:1], fs[:1], fs[:1] - 1,
                                 np.zeros(1, bool), g_tok[:1])
    assert (cols["topk_overlap"][0], cols["logit_steps"][0]) == (0, 0)
    assert all(np.isnan(v[0]) for c, v in cols.items() if c not in ("topk_overlap", "logit_steps"))
    assert steps["overlap"].tolist() == [0, 0, 0, 0] and steps[["abs_max", "kl", "sq_err", "sq_ref"]].isna().all().all()

    cols, _ = compare_logits(fake_golden(), [none, one], np.array([0, 0]), upto, fs, fs - 1, np.zeros(2, bool), g_tok)
    nan = np.nan
    expected = {"logit_steps": [0, 1], "topk_overlap": [0, 1 / 12], "logit_abs_max": [nan, 0.5],
                "logit_abs_mean": [nan, 0.5], "logit_abs_p99": [nan, 0.5], "logit_rel_max": [nan, 0.5 / 3],
                "logit_rel_mean": [nan, 0.5 / 3], "logit_rel_p99": [nan, 0.5 / 3], "logit_nmse": [nan, 0.25 / 9],
                "noise_before": [nan, 0.5]}
    for name, want in expected.items():
        np.testing.assert_allclose(cols[name], want, rtol=1e-12, err_msg=name)


def test_kl_of_an_engine_listing_one_id_or_token_0_first():
    """Two engines on one golden: `one` lists only its top-1 (k = 1, padded to the other's k = 3), `zero`
    ranks token 0 first. Both have a KL at every step (the engine's floor: its lowest listed logit)."""
    g_ids, g_log = G_IDS[0], G_LOG[0]
    one = {"topk_ids": g_ids[:, :1].tolist(), "topk_logits": g_log[:, :1].tolist()}
    zero_ids = np.concatenate([np.zeros((4, 1), int), g_ids[:, :2]], 1)
    zero_log = np.concatenate([g_log[:, :1] + 1, g_log[:, :2]], 1)
    zero = {"topk_ids": zero_ids.tolist(), "topk_logits": zero_log.tolist()}
    kl_one = [kl_by_hand(dict(zip(i, v)), dict.fromkeys(i, v[0])) for i, v in zip(g_ids, g_log)]
    kl_zero = [kl_by_hand({0: v[2], **dict(zip(i, v))}, {0: v[0] + 1, i[0]: v[0], i[1]: v[1], i[2]: v[1]})
               for i, v in zip(g_ids, g_log)]
    fs = np.array([4, 4])
    cols, _ = compare_logits(fake_golden(), [one, zero], np.array([0, 0]), np.ones((2, 4), bool), fs, fs - 1,
                             np.zeros(2, bool), np.array([40, 40]))
    np.testing.assert_allclose(cols["kl_mean"], [np.mean(kl_one), np.mean(kl_zero)], rtol=1e-12)
    np.testing.assert_allclose(cols["kl_max"], [max(kl_one), max(kl_zero)], rtol=1e-12)
    assert min(kl_one) > 0 and min(kl_zero) > 0


def test_golden_rank_in_engine_is_nan_where_the_engine_does_not_list_the_golden_token():
    # both diverge at step 1 (golden token 20): `listed` ranks it second, `unlisted` does not list it
    listed = {"topk_ids": [[10, 11, 12], [21, 20, 22], [30, 31, 32], [40, 41, 42]], "topk_logits": G_LOG[0].tolist()}
    unlisted = {"topk_ids": [[10, 11, 12], [21, 22, 23], [30, 31, 32], [40, 41, 42]], "topk_logits": G_LOG[0].tolist()}
    fs, upto = np.array([1, 1]), np.array([[1, 1, 0, 0], [1, 1, 0, 0]], bool)
    cols, _ = compare_logits(fake_golden(), [listed, unlisted], np.array([0, 0]), upto, fs, fs, np.ones(2, bool),
                             np.array([20, 20]))
    np.testing.assert_array_equal(cols["golden_rank_in_engine"], [1, np.nan])
