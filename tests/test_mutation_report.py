"""Report budgets, score verdicts and the top-k KL: what mutation testing (bench/mutation.sh report) found
unchecked. Expected values are computed here by hand, not by the report code."""
import math

import numpy as np
import pytest

from k2vec.report.classify import DEFAULT_BUDGETS, BudgetError, resolve_budgets
from k2vec.report.logits import topk_kl
from k2vec.report.score import _over_budget


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
