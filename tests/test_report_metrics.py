"""Divergence metrics (k2vec.report.metrics) on real tiny goldens with injected faults.

Each fault is placed where the golden data says it must be classified in a given way (a step whose
margin is the smallest, a router margin that first appears at a given position...), and the expected
numbers are recomputed here independently of the report code.
"""

import copy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO

from k2vec.kdtr import open_bundle
from k2vec.report import build_report
from k2vec.report.metrics import ROW_COLUMNS, ReportError, compute_metrics
from support.synthetic import case_goldens, perfect_result
from support.synthetic import write_result as synthetic_result
from k2vec.config.expand import expand_config

_GOLDENS: dict[str, dict] = {}


def make_goldens(root: Path) -> dict[tuple[str, str], Path]:
    """fp32 and int4 goldens of the tiny preset, shrunk (2 prompts, 10 tokens, budgets 1 and 4); built
    once per test process (the HTML tests reuse them). A cached pair whose files pytest has since removed
    (its temp-dir retention deletes old sessions' directories; a forked process, as under mutmut, outlives
    the session that built them) is built again, so a test never fails on a missing golden."""
    if "tiny" in _GOLDENS and all(Path(p).exists() for p in _GOLDENS["tiny"].values()):
        return _GOLDENS["tiny"]
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["models"] = {"tiny": {"preset": "tiny"}}
    cfg["prompts"]["count"] = 2
    cfg["decoding"]["max_new_tokens"] = 10
    cfg["decoding"]["ddtree"].update(budgets=[1, 4], accuracies=[0.9, 0.3])
    _GOLDENS["tiny"] = case_goldens(expand_config(cfg)["tiny"], root)
    return _GOLDENS["tiny"]


@pytest.fixture(scope="session")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("report-goldens"))


@pytest.fixture(scope="session")
def gold(goldens):
    """The fp32 golden's arrays, read independently of the report code."""
    with open_bundle(goldens[("tiny", "fp32")]) as b:
        return {"md": b.metadata, **{k: np.array(b[k]) for k in b.keys()}}


def write_result(tmp_path: Path, name: str, result: dict) -> str:
    return synthetic_result(tmp_path / f"{name}.json", result)


def metrics_for(tmp_path, goldens, results: dict[str, tuple[str, dict]], **kw):
    """results: engine name -> (mode, result dict)."""
    runs = [{"engine": e, "model": "tiny", "precision": "fp32", "mode": mode, "result": write_result(tmp_path, e, r)}
            for e, (mode, r) in results.items()]
    return compute_metrics(runs, {k: v for k, v in goldens.items() if k[1] == "fp32"}, **kw)


def flip(result: dict, prompt: int, step: int, gold: dict, *, swap_topk: bool = True) -> int:
    """Make the engine pick the golden's rank-1 token at `step` (and garbage after it); returns it."""
    p = result["runs"][0]["prompts"][prompt]
    second = int(gold[f"golden.p{prompt}.topk_ids"][step, 1])
    p["tokens"][step] = second
    for j in range(step + 1, len(p["tokens"])):
        p["tokens"][j] = (p["tokens"][j] + 7) % 512
    if swap_topk and "topk_ids" in p:   # the engine ranks the two first: ids swap, logits keep their order
        ids = p["topk_ids"][step]
        ids[0], ids[1] = ids[1], ids[0]
        for j in range(step + 1, len(p["topk_logits"])):   # after the divergence: must be ignored
            p["topk_logits"][j] = [v + 100.0 for v in p["topk_logits"][j]]
    return second


def row(m, engine, prompt, accuracy=None):
    r = m.rows[(m.rows["engine"] == engine) & (m.rows["prompt"] == prompt)]
    if accuracy is not None:
        r = r[r["accuracy"] == accuracy]
    assert len(r) == 1
    return r.iloc[0]


# ------------------------------------------------------------------------------------------ perfect


def test_perfect_runs_are_exact_with_zero_errors(tmp_path, goldens, gold):
    m = metrics_for(tmp_path, goldens, {"g": ("greedy", perfect_result(goldens[("tiny", "fp32")], "greedy")),
                                        "d": ("ddtree-b4", perfect_result(goldens[("tiny", "fp32")], "ddtree-b4"))})
    n_prompts, accs = gold["md"]["prompts"], gold["md"]["ddtree"]["accuracies"]
    assert len(m.rows) == n_prompts * (1 + len(accs))
    assert (m.rows["class"] == "exact").all()
    assert m.rows["first_step"].isna().all() and (m.rows["matched_steps"] == gold["md"]["max_new_tokens"]).all()
    for c in ("logit_abs_max", "logit_abs_mean", "logit_abs_p99", "logit_rel_max", "logit_nmse", "kl_max",
              "fingerprint_rel_max"):
        assert (m.rows[c] == 0).all(), c
    assert (m.rows["topk_overlap"] == 1).all()
    assert m.rows[["first_bad_step", "router_diff_step"]].isna().all().all()
    d = m.rows[m.rows["engine"] == "d"]
    assert d["tree_match"].all() and d["first_tree_diff_round"].isna().all()
    np.testing.assert_allclose(d["accept_mean_engine"], d["accept_mean_golden"])
    # the golden's own acceptance means (metadata summary) per accuracy
    for acc in accs:
        means = [np.diff(gold[f"ddtree.b4.a{accs.index(acc)}.p{i}.accepted_offsets"]).mean() for i in range(n_prompts)]
        np.testing.assert_allclose(d[d["accuracy"] == acc]["accept_mean_golden"], means)
    assert m.strict_problem is None
    assert (m.runs["exact_rate"] == 1).all()


# ---------------------------------------------------------------------------------------- token flip


def test_token_flip_at_step_k_is_a_real_divergence(tmp_path, goldens, gold):
    p, k = 1, 4
    margin = gold[f"golden.p{p}.margins"][k]
    P = len(gold[f"prompt.p{p}.tokens"])
    assert margin > 1e-3 and gold[f"golden.p{p}.router_margins"][:, :P + k].min() > 1e-3  # precondition
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    second = flip(res, p, k, gold)
    m = metrics_for(tmp_path, goldens, {"e": ("greedy", res)})
    r = row(m, "e", p)
    assert r["class"] == "real" and r["first_step"] == k and r["matched_steps"] == k
    assert r["golden_token"] == gold[f"golden.p{p}.tokens"][k] and r["engine_token"] == second
    assert r["golden_rank_in_engine"] == 1 and r["engine_rank_in_golden"] == 1
    assert r["margin"] == pytest.approx(margin)
    # the swapped logits differ by the margin at step k; the +100 after it is not compared
    assert r["logit_abs_max"] == pytest.approx(margin)
    assert r["logit_steps"] == k + 1
    assert r["kl_max"] > 0
    assert row(m, "e", 0)["class"] == "exact"
    assert m.strict_problem is not None
    steps = m.steps[m.steps["row"] == r.name]
    assert steps["step"].tolist() == list(range(k + 1))
    assert (steps["abs_max"].iloc[:k] == 0).all() and steps["abs_max"].iloc[k] == pytest.approx(margin)


def test_flip_without_topk_has_no_engine_rank(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy", topk=False, fingerprints=False, router=False)
    flip(res, 0, 2, gold)
    r = row(metrics_for(tmp_path, goldens, {"e": ("greedy", res)}), "e", 0)
    assert r["first_step"] == 2 and r["engine_rank_in_golden"] == 1
    assert pd.isna(r["golden_rank_in_engine"]) and pd.isna(r["logit_abs_max"]) and pd.isna(r["fingerprint_rel_max"])


def test_near_tie_threshold_decides_near_tie_vs_real(tmp_path, goldens, gold):
    n = gold["md"]["prompts"]
    margins = np.stack([gold[f"golden.p{i}.margins"] for i in range(n)])
    p, k = np.unravel_index(np.argmin(margins), margins.shape)
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    flip(res, int(p), int(k), gold)
    tight = metrics_for(tmp_path, goldens, {"e": ("greedy", res)}, near_tie=margins[p, k] * 1.01, router_near_tie=0)
    loose = metrics_for(tmp_path, goldens, {"e": ("greedy", res)}, near_tie=margins[p, k] * 0.99, router_near_tie=0)
    assert row(tight, "e", p)["class"] == "near-tie" and row(tight, "e", p)["first_step"] == k
    assert row(loose, "e", p)["class"] == "real"
    assert tight.strict_problem is None and loose.strict_problem is not None
    # a logit near-tie wins over a router near-tie at the same step; without it, the router one counts
    # (an engine that reports no routing: the golden's router margin at the divergent position is the evidence)
    for prompt in res["runs"][0]["prompts"]:
        del prompt["router_experts"]
    both = metrics_for(tmp_path, goldens, {"e": ("greedy", res)}, near_tie=margins[p, k] * 1.01, router_near_tie=np.inf)
    router = metrics_for(tmp_path, goldens, {"e": ("greedy", res)}, near_tie=margins[p, k] * 0.99,
                         router_near_tie=np.inf)
    assert row(both, "e", p)["class"] == "near-tie" and pd.isna(row(both, "e", p)["router_layer"])
    assert row(router, "e", p)["class"] == "router-near-tie"


def _router_tie_step(gold):
    """(prompt, step k, layer index) where the golden's routing margin at the position fed at step k is
    smaller than at every later position and at step k+1's, with no logit near-tie at k or k+1."""
    for p in range(gold["md"]["prompts"]):
        rm, P = gold[f"golden.p{p}.router_margins"], len(gold[f"prompt.p{p}.tokens"])
        for k in range(1, gold["md"]["max_new_tokens"] - 1):
            if rm[:, P - 1 + k].min() < rm[:, P + k:].min() and gold[f"golden.p{p}.margins"][k:k + 2].min() > 1e-3:
                return p, k, int(rm[:, P - 1 + k].argmin())
    pytest.fail("no step of the tiny golden has a routing margin below every later one")


def test_router_near_tie_needs_evidence_at_the_divergence(tmp_path, goldens, gold):
    p, k, layer_i = _router_tie_step(gold)
    rm, P = gold[f"golden.p{p}.router_margins"], len(gold[f"prompt.p{p}.tokens"])
    margin, next_min = rm[layer_i, P - 1 + k], rm[:, P + k:].min()
    thr = (margin + next_min) / 2
    silent_at, silent_after, same, differs = (perfect_result(goldens[("tiny", "fp32")], "greedy") for _ in range(4))
    for res in (silent_at, silent_after):
        for prompt in res["runs"][0]["prompts"]:
            del prompt["router_experts"]
    flip(silent_at, p, k, gold)
    flip(silent_after, p, k + 1, gold)
    flip(same, p, k, gold)
    flip(differs, p, k, gold)
    # the engine reports other experts at the near-tied decision (the golden's k-th choice swapped out)
    chosen = differs["runs"][0]["prompts"][p]["router_experts"][k][layer_i]
    chosen[-1] = next(e for e in range(64) if e not in chosen)
    m = metrics_for(tmp_path, goldens, {"silent_at": ("greedy", silent_at), "silent_after": ("greedy", silent_after),
                                        "same": ("greedy", same), "differs": ("greedy", differs)}, router_near_tie=thr)
    r = row(m, "silent_at", p)   # no routing reported: the golden's margin at the divergent step's position
    assert r["class"] == "router-near-tie" and r["router_evidence"] == "golden margin at the divergent position"
    assert r["router_layer"] == gold["md"]["moe_layers"][layer_i] and r["router_position"] == P - 1 + k
    assert r["router_margin"] == pytest.approx(margin)
    # the same near-tie one position before the divergence no longer labels it
    assert row(m, "silent_after", p)["class"] == "real"
    # the engine's own routing equals the golden's: the near-tie did not happen in it
    assert row(m, "same", p)["class"] == "real"
    r = row(m, "differs", p)
    assert r["class"] == "router-near-tie" and r["router_evidence"] == "engine routing differs"
    assert (r["router_position"], r["router_margin"]) == (P - 1 + k, pytest.approx(margin))
    assert (r["router_diff_step"], r["router_diff_layer"]) == (k, gold["md"]["moe_layers"][layer_i])


# ------------------------------------------------------------------------------------- fingerprints


def test_perturbed_fingerprint_gives_the_first_bad_step_and_layer(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    fp = res["runs"][0]["prompts"][0]["fingerprints"]
    s, j = 3, 2
    vec = np.array(fp[s][j])
    fp[s][j] = (vec * (1 + 1e-2)).tolist()            # rel L2 error 1e-2 > 1e-3
    fp[1][0] = (np.array(fp[1][0]) * (1 + 1e-5)).tolist()   # below the threshold: ignored
    fp[5][0] = (np.array(fp[5][0]) * 2).tolist()      # later step: not the first
    m = metrics_for(tmp_path, goldens, {"e": ("greedy", res)})
    r = row(m, "e", 0)
    assert (r["first_bad_step"], r["first_bad_layer"]) == (s, j)
    assert r["first_bad_rel_err"] == pytest.approx(1e-2, rel=1e-3)
    # float32 (the default declaration) allows hidden_rel 1e-3: tokens match, yet the row is flagged
    assert r["class"] == "over-budget" and "fingerprint" in r["over_budget"]
    assert row(m, "e", 1)["class"] == "exact" and pd.isna(row(m, "e", 1)["first_bad_step"])
    strict = metrics_for(tmp_path, goldens, {"e": ("greedy", res)}, fingerprint_rtol=1e-6)
    assert (row(strict, "e", 0)["first_bad_step"], row(strict, "e", 0)["first_bad_layer"]) == (1, 0)


def test_fingerprints_after_the_divergence_are_not_compared(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    flip(res, 0, 2, gold)
    fp = res["runs"][0]["prompts"][0]["fingerprints"]
    fp[3][0] = (np.array(fp[3][0]) * 2).tolist()      # step 3 feeds the engine's different token
    r = row(metrics_for(tmp_path, goldens, {"e": ("greedy", res)}), "e", 0)
    assert pd.isna(r["first_bad_step"]) and r["fingerprint_rel_max"] == 0


# ------------------------------------------------------------------------------------------- router


def test_router_expert_set_difference(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    rt = res["runs"][0]["prompts"][1]["router_experts"]
    rt[1][0] = rt[1][0][::-1]                          # same set, other order: not a difference
    s, m_i = 4, 1
    rt[s][m_i][0] = next(e for e in range(8) if e not in rt[s][m_i])
    m = metrics_for(tmp_path, goldens, {"e": ("greedy", res)})
    r = row(m, "e", 1)
    assert r["router_diff_step"] == s and r["router_diff_layer"] == gold["md"]["moe_layers"][m_i]
    assert pd.isna(row(m, "e", 0)["router_diff_step"])


# ------------------------------------------------------------------------------------------- logits


def test_logit_statistics_compare_by_id(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy", fingerprints=False, router=False)
    p = res["runs"][0]["prompts"][0]
    for j in range(len(p["topk_ids"])):                # reversed order: same ids and logits
        p["topk_ids"][j], p["topk_logits"][j] = p["topk_ids"][j][::-1], p["topk_logits"][j][::-1]
    shift, delta = 0.5, 0.02
    p["topk_logits"][2] = [v + shift for v in p["topk_logits"][2]]    # a uniform shift: KL 0
    p["topk_logits"][5][-1] += delta                   # the golden top-1 (reversed: last)
    p["topk_ids"][7][0] = 511 if 511 not in gold["golden.p0.topk_ids"][7] else 510   # one id not shared
    m = metrics_for(tmp_path, goldens, {"e": ("greedy", res)})
    r = row(m, "e", 0)
    g_log = gold["golden.p0.topk_logits"]
    N, K = g_log.shape
    err = np.zeros((N, K))
    err[2] = shift
    err[5, 0] = delta
    valid = np.ones((N, K), bool)
    valid[7, -1] = False                               # reversed index 0 is the golden rank K-1
    e = err[valid]
    assert r["logit_abs_max"] == pytest.approx(shift)
    assert r["logit_abs_mean"] == pytest.approx(e.mean())
    assert r["logit_abs_p99"] == pytest.approx(np.percentile(e, 99))
    rel = (err / np.abs(g_log))[valid]                 # no golden logit here is 0: no REL_EPS guard needed
    assert np.abs(g_log).min() > 1e-6
    assert r["logit_rel_max"] == pytest.approx(rel.max())
    assert r["logit_rel_mean"] == pytest.approx(rel.mean())
    assert r["logit_rel_p99"] == pytest.approx(np.percentile(rel, 99))
    assert r["logit_nmse"] == pytest.approx((e ** 2).sum() / (g_log[valid] ** 2).sum())
    assert r["topk_overlap"] == pytest.approx(1 - 1 / (N * K))
    # KL of the top-k softmax: 0 for the shift, the delta's KL at step 5
    lp = g_log[5] - np.log(np.exp(g_log[5]).sum())
    q = g_log[5].copy()
    q[0] += delta
    lq = q - np.log(np.exp(q).sum())
    kl5 = float((np.exp(lp) * (lp - lq)).sum())
    assert r["kl_max"] == pytest.approx(kl5, rel=1e-6) and r["kl_mean"] == pytest.approx(kl5 / N, rel=1e-6)
    steps = m.steps[m.steps["row"] == r.name].set_index("step")
    assert steps.at[2, "kl"] == pytest.approx(0, abs=1e-15) and steps.at[2, "abs_max"] == pytest.approx(shift)


# ------------------------------------------------------------------------------------------- DDTree


def _round_with_nodes(res: dict, n: int) -> tuple[int, int, int]:
    for a_i, run in enumerate(res["runs"]):
        for p_i, prompt in enumerate(run["prompts"]):
            for r_i, rnd in enumerate(prompt["rounds"]):
                if len(rnd["tokens"]) >= n and rnd["tokens"][1] != rnd["tokens"][2]:
                    return a_i, p_i, r_i
    pytest.fail(f"no round with {n} nodes")


def test_ddtree_swapped_node_gives_first_differing_round_and_node(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "ddtree-b4")
    a_i, p_i, r_i = _round_with_nodes(res, 3)
    rnd = res["runs"][a_i]["prompts"][p_i]["rounds"][r_i]
    rnd["tokens"][1], rnd["tokens"][2] = rnd["tokens"][2], rnd["tokens"][1]
    later = res["runs"][a_i]["prompts"][p_i]["rounds"][-1]
    later["tokens"] = later["tokens"] + [1]            # a later difference must not be reported first
    later["parents"], later["depths"] = later["parents"] + [0], later["depths"] + [1]
    acc = gold["md"]["ddtree"]["accuracies"][a_i]
    m = metrics_for(tmp_path, goldens, {"e": ("ddtree-b4", res)})
    r = row(m, "e", p_i, acc)
    assert r["tree_match"] == False and r["first_tree_diff_round"] == r_i and r["first_tree_diff_node"] == 1  # noqa: E712
    assert r["tree_diff_what"].startswith("token")
    assert r["class"] == "exact"                        # tokens still equal greedy
    others = m.rows[(m.rows.index != r.name)]
    assert others["tree_match"].all()


def test_ddtree_size_accepted_and_round_count_differences(tmp_path, goldens, gold):
    base = perfect_result(goldens[("tiny", "fp32")], "ddtree-b4")
    a_i, p_i, r_i = _round_with_nodes(base, 3)
    acc = gold["md"]["ddtree"]["accuracies"][a_i]
    cut, accepted, fewer = (copy.deepcopy(base) for _ in range(3))
    rnd = cut["runs"][a_i]["prompts"][p_i]["rounds"][r_i]
    n = len(rnd["tokens"])
    for key in ("tokens", "parents", "depths"):
        rnd[key] = rnd[key][:-1]
    rnd = accepted["runs"][a_i]["prompts"][p_i]["rounds"][r_i]
    rnd["accepted"] = rnd["accepted"] + [n - 1] if len(rnd["accepted"]) == 1 else rnd["accepted"][:1]
    rounds = fewer["runs"][a_i]["prompts"][p_i]["rounds"]
    del rounds[-1]
    m = metrics_for(tmp_path, goldens, {"cut": ("ddtree-b4", cut), "acc": ("ddtree-b4", accepted),
                                        "fewer": ("ddtree-b4", fewer)})
    r = row(m, "cut", p_i, acc)
    assert (r["first_tree_diff_round"], r["first_tree_diff_node"]) == (r_i, n - 1)
    assert r["tree_diff_what"].startswith("size")
    r = row(m, "acc", p_i, acc)
    assert r["first_tree_diff_round"] == r_i and pd.isna(r["first_tree_diff_node"])
    assert r["tree_diff_what"].startswith("accepted")
    assert r["accept_mean_engine"] != r["accept_mean_golden"]
    r = row(m, "fewer", p_i, acc)
    assert r["first_tree_diff_round"] == len(rounds) and r["tree_diff_what"].startswith("round count")


# ------------------------------------------------------------------------------------------- failed


def test_failed_and_missing_results_are_failed_rows_with_reasons(tmp_path, goldens, gold):
    failed = {"format": "k2vec-engine-result", "version": 1, "engine": "x", "mode": "ddtree-b1", "budget": 1,
              "status": "failed", "reason": "engine exited with code 3", "stderr_tail": "Segmentation fault",
              "runs": []}
    runs = [{"engine": "crash", "model": "tiny", "precision": "fp32", "mode": "ddtree-b1",
             "result": write_result(tmp_path, "crash", failed)},
            {"engine": "gone", "model": "tiny", "precision": "fp32", "mode": "greedy",
             "result": str(tmp_path / "nowhere.json")}]
    m = compute_metrics(runs, goldens)
    n, accs = gold["md"]["prompts"], gold["md"]["ddtree"]["accuracies"]
    crash = m.rows[m.rows["engine"] == "crash"]
    assert len(crash) == n * len(accs) and (crash["class"] == "failed").all()
    assert (crash["reason"] == "engine exited with code 3").all()
    gone = m.rows[m.rows["engine"] == "gone"]
    assert len(gone) == n and (gone["class"] == "failed").all()
    assert gone["reason"].str.startswith("result file missing").all()
    assert m.strict_problem is not None
    assert m.runs[m.runs["engine"] == "crash"]["stderr_tail"].iloc[0] == "Segmentation fault"


def test_missing_golden_names_model_and_precision(tmp_path, goldens):
    runs = [{"engine": "e", "model": "tiny", "precision": "int4", "mode": "greedy", "result": "x.json"}]
    with pytest.raises(ReportError, match=r"model 'tiny' precision 'int4'.*engine 'e'"):
        compute_metrics(runs, {("tiny", "fp32"): goldens[("tiny", "fp32")]})
    with pytest.raises(ReportError, match=r"model 'tiny' precision 'int4' not found: .*nope.kdtr"):
        compute_metrics(runs, {("tiny", "int4"): tmp_path / "nope.kdtr"})
    with pytest.raises(ReportError, match="holds the golden of model 'tiny' precision 'fp32'"):
        compute_metrics(runs, {("tiny", "int4"): goldens[("tiny", "fp32")]})


def test_throughput_from_wall_and_engine_timing(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "ddtree-b1", wall_s=2.0)
    res["timing"] = {"decode_s": 0.5}
    m = metrics_for(tmp_path, goldens, {"e": ("ddtree-b1", res)})
    tokens = gold["md"]["prompts"] * gold["md"]["max_new_tokens"] * len(gold["md"]["ddtree"]["accuracies"])
    assert (m.rows["tokens_per_s"] == tokens / 2.0).all()
    assert (m.rows["decode_tokens_per_s"] == tokens / 0.5).all()


# ------------------------------------------------------------------------------------ fp32 vs int4


def test_format_effect_fp32_vs_int4(tmp_path, goldens):
    m = compute_metrics([], goldens)
    with open_bundle(goldens[("tiny", "fp32")]) as f, open_bundle(goldens[("tiny", "int4")]) as q:
        n = f.metadata["prompts"]
        fe = m.format_effect
        assert len(fe) == n
        matched = []
        for i in range(n):
            a, b = np.array(f[f"golden.p{i}.tokens"]), np.array(q[f"golden.p{i}.tokens"])
            d = np.flatnonzero(a != b)
            r = fe[fe["prompt"] == i].iloc[0]
            assert d.size, "the tiny preset's int4 golden diverges from fp32"
            assert r["first_step"] == d[0] and r["fp32_token"] == a[d[0]] and r["int4_token"] == b[d[0]]
            assert r["fp32_margin"] == pytest.approx(f[f"golden.p{i}.margins"][d[0]])
            assert r["same_top1"] == pytest.approx(d[0] / (d[0] + 1))
            assert r["kl_mean"] > 0 and r["logit_abs_max"] > 0
            matched.append(d[0])
        fs = m.format_steps
        assert len(fs) == sum(k + 1 for k in matched) and (fs["kl"] > 0).all()
    mm = m.format_models.iloc[0]
    assert mm["model"] == "tiny" and mm["diverged"] == n
    assert mm["same_top1_rate"] == pytest.approx(sum(matched) / sum(k + 1 for k in matched))
    assert m.rows.empty and m.strict_problem is None


# ------------------------------------------------------------------------------------------ outputs


def test_csv_has_one_row_per_run_accuracy_prompt(tmp_path, goldens, gold):
    runs = []
    for mode in ("greedy", "ddtree-b4"):
        runs.append({"engine": "e", "model": "tiny", "precision": "fp32", "mode": mode,
                     "result": write_result(tmp_path, mode, perfect_result(goldens[("tiny", "fp32")], mode))})
    res = build_report(runs, goldens, tmp_path / "out")
    df = pd.read_csv(res.paths["csv"])
    assert list(df.columns) == ROW_COLUMNS
    n = gold["md"]["prompts"]
    assert len(df) == n * (1 + len(gold["md"]["ddtree"]["accuracies"]))
    assert set(zip(df["mode"], df["accuracy"].fillna(-1), df["prompt"])) == {
        (mode, a, p) for mode, accs in (("greedy", [-1]), ("ddtree-b4", gold["md"]["ddtree"]["accuracies"]))
        for a in accs for p in range(n)}
    assert (res.paths["summary"].read_text() == res.summary) and "exact" in res.summary
    assert res.strict_problem is None


def test_result_missing_an_accuracy_run_gets_failed_rows(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "ddtree-b1")
    dropped = res["runs"].pop()["drafter"]["accuracy"]
    m = metrics_for(tmp_path, goldens, {"e": ("ddtree-b1", res)})
    miss = m.rows[m.rows["accuracy"] == dropped]
    assert len(miss) == gold["md"]["prompts"] and (miss["class"] == "failed").all()
    assert miss["reason"].str.contains("no run").all()
    assert (m.rows[m.rows["accuracy"] != dropped]["class"] == "exact").all()


def test_unreadable_golden_is_a_clear_error(tmp_path):
    bad = tmp_path / "junk.kdtr"
    bad.write_bytes(b"not a bundle at all" * 10)
    runs = [{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": "x.json"}]
    with pytest.raises(ReportError, match=r"golden for model 'tiny' precision 'fp32' is not readable"):
        compute_metrics(runs, {("tiny", "fp32"): bad})
    with pytest.raises(ReportError, match="unknown mode 'beam'"):
        compute_metrics([{**runs[0], "mode": "beam"}], {("tiny", "fp32"): bad})


def test_ddtree_budget_without_golden_trace_is_compared_by_tokens_and_said(tmp_path, goldens, gold):
    from k2vec.report.html import summary_text

    res = perfect_result(goldens[("tiny", "fp32")], "ddtree-b4")
    m = metrics_for(tmp_path, goldens, {"e": ("ddtree-b8", res)})     # the golden has budgets 1 and 4
    assert (m.rows["class"] == "exact").all() and m.rows["tree_match"].isna().all()
    assert "no golden trace for ddtree-b8" in summary_text(m)


def test_router_near_tie_at_a_prompt_position_from_the_engines_score_run(tmp_path, goldens, gold):
    """The engine's own routing at prompt positions comes from its score run (greedy results cannot
    give it): a decision it took otherwise there, at a golden near-tie, explains a later divergence."""
    def setting(p):
        """(step, layer index, prompt position, threshold) for prompt p: its smallest router margin at a
        prompt position, and a step with no logit near-tie. The engines route as the golden at every fed
        position, so nearer golden ties there are no evidence (a tie needs a decision taken otherwise)."""
        rm, P = gold[f"golden.p{p}.router_margins"], len(gold[f"prompt.p{p}.tokens"])
        layer_i, pos = np.unravel_index(np.argmin(rm[:, :P - 1]), rm[:, :P - 1].shape)   # a prompt position
        thr = rm[layer_i, pos] * 1.01
        steps = [k for k in range(1, len(gold[f"golden.p{p}.margins"])) if gold[f"golden.p{p}.margins"][k] > 1e-3]
        return (steps[0], layer_i, pos, thr) if steps else None

    p = next(p for p in range(gold["md"]["prompts"]) if setting(p))
    k, layer_i, pos, thr = setting(p)
    greedy = perfect_result(goldens[("tiny", "fp32")], "greedy")
    flip(greedy, p, k, gold)
    score, score_same = (perfect_result(goldens[("tiny", "fp32")], "score") for _ in range(2))
    chosen = score["runs"][0]["prompts"][p]["router_experts"][pos][layer_i]
    chosen[-1] = next(e for e in range(64) if e not in chosen)
    runs = [{"engine": e, "model": "tiny", "precision": "fp32", "mode": mode,
             "result": write_result(tmp_path, f"{e}-{mode}", r)}
            for e, mode, r in (("a", "greedy", greedy), ("a", "score", score),
                               ("b", "greedy", greedy), ("b", "score", score_same))]
    m = compute_metrics(runs, {("tiny", "fp32"): goldens[("tiny", "fp32")]}, router_near_tie=thr)
    ra = m.rows[(m.rows["engine"] == "a") & (m.rows["mode"] == "greedy") & (m.rows["prompt"] == p)].iloc[0]
    assert ra["class"] == "router-near-tie" and ra["router_evidence"] == "engine routing differs (its score run)"
    assert (ra["router_position"], ra["router_layer"]) == (pos, gold["md"]["moe_layers"][layer_i])
    # the same greedy run beside a score run that routed like the golden: nothing explains it
    rb = m.rows[(m.rows["engine"] == "b") & (m.rows["mode"] == "greedy") & (m.rows["prompt"] == p)].iloc[0]
    assert rb["class"] == "real"
