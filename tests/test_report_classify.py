"""Precision-aware classification and score statistics (k2vec.report.classify, .score) on real tiny
goldens: a correct reduced-precision engine is given its ties, an engine with a real bug is not, a
float32 engine is held to float32's tolerance, and score runs give llama.cpp's figures."""

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO
from test_report_metrics import flip, make_goldens

from k2vec.report.classify import DEFAULT_BUDGETS
from k2vec.report.gate import FAILING_CLASSES
from k2vec.report.logits import topk_kl
from k2vec.report.html import summary_text
from k2vec.report.metrics import compute_metrics
from support.synthetic import perfect_result, write_result


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("classify-goldens"))


@pytest.fixture(scope="module")
def gold(goldens):
    from k2vec.kdtr import open_bundle
    with open_bundle(goldens[("tiny", "fp32")]) as b:
        return {"md": b.metadata, **{k: np.array(b[k]) for k in b.keys()}}


def judge(tmp_path, goldens, results, **kw):
    """results: engine (a '#suffix' tells two runs of one engine apart) -> (mode, precision class, result)."""
    runs = [{"engine": e.split("#")[0], "model": "tiny", "precision": "fp32", "mode": mode, "precision_class": pc,
             "result": write_result(tmp_path / f"{e}-{mode}.json", r)} for e, (mode, pc, r) in results.items()]
    return compute_metrics(runs, {k: v for k, v in goldens.items() if k[1] == "fp32"}, **kw)


def get(m, engine, prompt, mode=None):
    r = m.rows[(m.rows["engine"] == engine) & (m.rows["prompt"] == prompt)]
    if mode:
        r = r[r["mode"] == mode]
    assert len(r) == 1
    return r.iloc[0]


def noisy(result: dict, amplitude: float, seed: int, upto: int | None = None) -> dict:
    """Every top-k logit moved by a deterministic error of at most `amplitude` (steps < upto); the
    order of the engine's list follows its own logits, as an engine would report it."""
    rng = np.random.default_rng(seed)
    for p in result["runs"][0]["prompts"]:
        ids, logits = np.array(p["topk_ids"]), np.array(p["topk_logits"])
        n = len(logits) if upto is None else upto
        logits[:n] += rng.uniform(-amplitude, amplitude, logits[:n].shape)
        order = np.argsort(-logits, axis=1, kind="stable")
        p["topk_ids"] = np.take_along_axis(ids, order, 1).tolist()
        p["topk_logits"] = np.take_along_axis(logits, order, 1).tolist()
    return result


def test_default_budgets_are_the_config_ones():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    assert cfg["report"]["budgets"] == DEFAULT_BUDGETS
    assert {e["precision"] for e in cfg["engines"].values()} <= set(DEFAULT_BUDGETS)


def _precision_tie_case(gold):
    """(prompt, step, golden gap between its token and its rank-1 token) with no logit near-tie."""
    margins = np.stack([gold[f"golden.p{i}.margins"] for i in range(gold["md"]["prompts"])])
    ok = np.argwhere((margins > 0.05) & (margins < 0.5) & (np.arange(margins.shape[1]) >= 2))
    assert len(ok), "no step with a golden margin in (0.05, 0.5) after step 2"
    p, k = (int(x) for x in ok[0])
    return p, k, float(margins[p, k])


def test_divergence_within_the_engines_own_noise_is_a_precision_tie_and_a_bug_is_real(tmp_path, goldens, gold):
    """Must-show 2, on synthetic results: the same divergence is a precision tie for a bfloat16 engine
    whose noise covers the golden gap, and real when the noise is beyond bfloat16's budget, when the
    engine's score run is over budget, or when the engine declares float32."""
    p, k, gap = _precision_tie_case(gold)
    golden = goldens[("tiny", "fp32")]

    def diverging(amplitude):
        res = noisy(perfect_result(golden, "greedy"), amplitude, seed=1, upto=k)
        flip(res, p, k, gold)
        return res

    fine = diverging(gap)              # noise about the gap: within twice the noise
    buggy = diverging(12.0)            # 12 > bfloat16's logit_abs 8: a tie is not granted
    score_ok = noisy(perfect_result(golden, "score"), 0.01, seed=2)
    score_bad = noisy(perfect_result(golden, "score"), 3.0, seed=3)   # logits within 8, KL beyond 0.2
    m = judge(tmp_path, goldens, {
        "bf16": ("greedy", "bfloat16", fine), "bf16#score": ("score", "bfloat16", score_ok),
        "bug": ("greedy", "bfloat16", buggy),
        "fp32": ("greedy", "float32", diverging(gap)),
    })
    r = get(m, "bf16", p, "greedy")
    assert r["class"] == "precision-tie" and r["first_step"] == k
    assert (r["golden_gap"] == pytest.approx(gap)
            and r["golden_gap"] <= 2 * r["noise"] <= 2 * DEFAULT_BUDGETS["bfloat16"]["logit_abs"])
    assert (get(m, "bug", p)["class"] == "real"
            and "logit error before the divergence" in get(m, "bug", p)["over_budget"])
    # float32's budget (1e-3) does not cover a noise of about the gap
    assert get(m, "fp32", p)["class"] == "real"
    # the other prompts of the buggy engine: tokens equal, logits 12 off
    assert (m.rows[(m.rows["engine"] == "bug") & (m.rows["prompt"] != p)]["class"] == "over-budget").all()
    assert (m.rows[(m.rows["engine"] == "bf16") & (m.rows["mode"] == "score")]["class"].isin(
        ["exact", "within-budget"])).all()

    # the same correct greedy run, but the engine's score run is over budget: no tie credit
    m2 = judge(tmp_path, goldens, {"bf16": ("greedy", "bfloat16", fine),
                                   "bf16#score": ("score", "bfloat16", score_bad)})
    assert m2.score_runs.iloc[0]["verdict"] == "over budget"
    r = m2.rows[(m2.rows["prompt"] == p) & (m2.rows["mode"] == "greedy")].iloc[0]
    assert r["class"] == "real" and r["over_budget"].startswith("score run over budget")
    assert (m2.rows[m2.rows["mode"] == "score"]["class"] == "over-budget").all()
    assert m2.strict_problem is not None and not m.rows[m.rows["engine"] == "bf16"]["class"].isin(
        FAILING_CLASSES).any()


def test_float32_engine_with_logit_errors_is_flagged_though_its_tokens_match(tmp_path, goldens):
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    logits = res["runs"][0]["prompts"][0]["topk_logits"]
    logits[3][-1] -= 0.47   # the last listed logit: no token can flip
    m = judge(tmp_path, goldens, {"f32": ("greedy", "float32", res), "bf16": ("greedy", "bfloat16", res)})
    r = get(m, "f32", 0)
    assert r["first_step"] is pd.NA and r["class"] == "over-budget"
    assert r["over_budget"] == "logit error 0.47 > logit_abs 0.001"
    assert get(m, "bf16", 0)["class"] == "exact" and get(m, "f32", 1)["class"] == "exact"
    assert m.strict_problem is not None
    # a looser float32 budget from the config lets it pass
    loose = judge(tmp_path, goldens, {"f32": ("greedy", "float32", res)}, budgets={"float32": {"logit_abs": 0.5}})
    assert get(loose, "f32", 0)["class"] == "exact" and loose.strict_problem is None


def test_unknown_precision_class_or_budget_is_an_error(tmp_path, goldens):
    from k2vec.report.metrics import ReportError
    res = perfect_result(goldens[("tiny", "fp32")], "greedy")
    with pytest.raises(ReportError, match="precision_class 'int8'"):
        judge(tmp_path, goldens, {"e": ("greedy", "int8", res)})
    with pytest.raises(ReportError, match=r"report.budgets.bfloat16.kl_max: unknown budget"):
        judge(tmp_path, goldens, {"e": ("greedy", "bfloat16", res)}, budgets={"bfloat16": {"kl_max": 1}})


def test_score_statistics(tmp_path, goldens, gold):
    golden = goldens[("tiny", "fp32")]
    exact = perfect_result(golden, "score")
    off = noisy(perfect_result(golden, "score"), 0.3, seed=5)
    m = judge(tmp_path, goldens, {"exact": ("score", "float32", exact), "off": ("score", "bfloat16", off)})
    sr = m.score_runs.set_index("engine")
    n, N = gold["md"]["prompts"], gold["md"]["max_new_tokens"]
    assert (sr.loc["exact", "same_top1"], sr.loc["exact", "kl_max"], sr.loc["exact", "logit_nmse"]) == (1.0, 0.0, 0.0)
    assert sr.loc["exact", "positions"] == n * N and sr.loc["exact", "verdict"] == "within budget"
    assert (m.rows[m.rows["engine"] == "exact"]["class"] == "exact").all()
    # independent recomputation: every position, KL over the union of the two top-k id sets
    kl, same, se, sg = [], [], 0.0, 0.0
    for i, p in enumerate(off["runs"][0]["prompts"]):
        g_ids, g_log = gold[f"golden.p{i}.topk_ids"], gold[f"golden.p{i}.topk_logits"]
        e_ids, e_log = np.array(p["topk_ids"]), np.array(p["topk_logits"])
        for j in range(N):
            ids = sorted(set(g_ids[j]) | set(e_ids[j]))
            gl = dict(zip(g_ids[j], g_log[j]))
            el = dict(zip(e_ids[j], e_log[j]))
            a = np.array([gl.get(t, g_log[j].min()) for t in ids])
            b = np.array([el.get(t, e_log[j].min()) for t in ids])
            pa, pb = np.exp(a - a.max()) / np.exp(a - a.max()).sum(), np.exp(b - b.max()) / np.exp(b - b.max()).sum()
            kl.append(float((pa * np.log(pa / pb)).sum()))
            same.append(e_ids[j][0] == gold[f"golden.p{i}.tokens"][j])
            se += sum((el[t] - gl[t]) ** 2 for t in set(g_ids[j]) & set(e_ids[j]))
            sg += sum(gl[t] ** 2 for t in set(g_ids[j]) & set(e_ids[j]))
    assert sr.loc["off", "kl_mean"] == pytest.approx(np.mean(kl), rel=1e-9)
    assert sr.loc["off", "kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
    assert sr.loc["off", "kl_max"] == pytest.approx(max(kl), rel=1e-9)
    assert sr.loc["off", "logit_nmse"] == pytest.approx(se / sg, rel=1e-9)
    # the synthetic result's tokens are the golden's: same top-1 counts the engine's own tokens
    assert sr.loc["off", "same_top1"] == 1.0
    worst = int(np.argmax(kl))
    assert sr.loc["off", "top_kl"].startswith(f"p{worst // N} step {worst % N}: ")


def test_kl_treats_ids_missing_from_one_side_as_its_lowest_logit():
    g_ids, g_log = np.array([[1, 2]]), np.array([[2.0, 1.0]])
    same = topk_kl(g_ids, g_log, g_ids, g_log)
    assert same[0] == 0.0
    # the engine lists 3 instead of 2: union {1, 2, 3}; golden 3 -> 1.0 (its lowest), engine 2 -> 0.5
    kl = topk_kl(g_ids, g_log, np.array([[1, 3]]), np.array([[2.0, 0.5]]))[0]
    p = np.exp([2.0, 1.0, 1.0]) / np.exp([2.0, 1.0, 1.0]).sum()
    q = np.exp([2.0, 0.5, 0.5]) / np.exp([2.0, 0.5, 0.5]).sum()
    assert kl == pytest.approx(float((p * np.log(p / q)).sum()))
    # disjoint sets: a KL, not none (each side's missing ids at its own lowest logit)
    assert topk_kl(g_ids, g_log, np.array([[5, 6]]), np.array([[9.0, 8.0]]))[0] > 0.1


def test_score_rows_compare_routing_at_prompt_positions(tmp_path, goldens, gold):
    res = perfect_result(goldens[("tiny", "fp32")], "score")
    P = len(gold["prompt.p0.tokens"])
    chosen = res["runs"][0]["prompts"][0]["router_experts"][1][0]   # prompt position 1, first MoE layer
    chosen[0] = next(e for e in range(64) if e not in chosen)
    m = judge(tmp_path, goldens, {"e": ("score", "float32", res)})
    r = get(m, "e", 0)
    assert (r["router_diff_step"], r["router_diff_layer"]) == (1 - (P - 1), gold["md"]["moe_layers"][0])
    assert pd.isna(get(m, "e", 1)["router_diff_step"])


def _tiny_spec():
    from k2vec.config.expand import expand_config
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["models"] = {"tiny": {"preset": "tiny"}}
    cfg["prompts"]["count"] = 2
    cfg["decoding"]["max_new_tokens"] = 10
    cfg["decoding"]["ddtree"].update(budgets=[1, 4], accuracies=[0.9, 0.3])
    return expand_config(cfg)["tiny"]["model"]


def test_reference_model_without_routed_scaling_fails_a_bfloat16_budget(tmp_path, goldens):
    """A real bug, computed (the reference model with routed_scaling_factor 1), scored in score mode and
    declared bfloat16: over budget and failing the gate; the same model without the bug is exact."""
    from k2vec.stages.format_effect import format_effect_result, write_format_effect
    from k2vec.stages.golden import open_weights

    root, spec = goldens[("tiny", "fp32")].parent, _tiny_spec()
    runs = []
    for name, model in (("correct", spec), ("noscale", {**spec, "routed_scaling_factor": 1.0})):
        write_format_effect(tmp_path / f"{name}.json",
                            format_effect_result(model, open_weights("fp32", root / "fp32"), goldens[("tiny", "fp32")]))
        runs.append({"engine": name, "model": "tiny", "precision": "fp32", "mode": "score",
                     "precision_class": "bfloat16", "result": str(tmp_path / f"{name}.json")})
    m = compute_metrics(runs, goldens)
    sr = m.score_runs.set_index("engine")
    assert sr.loc["correct", "verdict"] == "within budget" and sr.loc["correct", "kl_max"] == 0.0
    assert (sr.loc["noscale", "verdict"] == "over budget"
            and sr.loc["noscale", "kl_mean"] > DEFAULT_BUDGETS["bfloat16"]["kl_mean"])
    assert set(m.rows.loc[m.rows["engine"] == "noscale", "class"]) == {"over-budget"}
    assert set(m.rows.loc[m.rows["engine"] == "correct", "class"]) == {"exact"}
    assert m.strict_problem is not None
    # the summary says why only where there is a reason (a mixed column holds NaN, not None, for the others)
    lines = {ln.split()[1]: ln for ln in summary_text(m).splitlines() if ln.startswith("  score ")}
    assert lines["correct"].endswith(": within budget") and "over budget (" in lines["noscale"]


def test_format_effect_row_reproduces_the_fp32_vs_int4_figures(tmp_path, goldens):
    """Must-show 3b: the int4 golden model forced on the fp32 golden sequence, scored as the reference
    row `int4-format`: up to each prompt's first fp32/int4 divergence both views fed the same tokens, so
    its first top-1 miss and its KL per step are those of the fp32-vs-int4 comparison; it is shown in
    the score table, not judged as an engine."""
    from k2vec.stages.format_effect import format_effect_result, write_format_effect
    from k2vec.stages.golden import open_weights

    root = goldens[("tiny", "fp32")].parent
    result = format_effect_result(_tiny_spec(), open_weights("int4", root / "fp32", root / "int4"),
                                  goldens[("tiny", "fp32")])
    write_format_effect(tmp_path / "tiny.json", result)
    m = compute_metrics([{"engine": "int4-format", "model": "tiny", "precision": "fp32", "mode": "score",
                          "result": str(tmp_path / "tiny.json"), "reference": True}], goldens)
    assert m.rows.empty   # not an engine under test: nothing for the gate
    (ref,) = m.score_runs.itertuples()
    assert ((ref.engine, ref.reference, ref.verdict, ref.precision_class)
            == ("int4-format", True, "reference", "float32"))
    fe, fs = m.format_effect.set_index("prompt"), m.format_steps
    assert fe["first_step"].notna().any()   # else the comparison below says nothing past a divergence
    for p, grp in m.score_reference_steps.groupby("prompt"):
        k = fe.loc[p, "first_step"]
        k = 9 if pd.isna(k) else int(k)
        ours = grp.set_index("step")["kl"].loc[:k].to_numpy()
        theirs = fs[(fs["prompt"] == p) & (fs["model"] == "tiny")].set_index("step")["kl"].loc[:k].to_numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-15)
        tokens = np.array(result["runs"][0]["prompts"][p]["tokens"])
        golden_tokens = np.array(json.loads(json.dumps(perfect_result(goldens[("tiny", "fp32")], "score")))
                                 ["runs"][0]["prompts"][p]["tokens"])
        miss = np.flatnonzero(tokens != golden_tokens)
        assert (int(miss[0]) if miss.size else None) == (None if pd.isna(fe.loc[p, "first_step"]) else k)
    # the same positions pooled: the score table's same-top-1 counts every forced position
    n_pos = 2 * 10
    assert ref.positions == n_pos and 0 < ref.same_top1 < 1 and ref.kl_mean > 0


def test_report_shows_the_score_table_plot_and_budget_verdicts(tmp_path, goldens):
    from k2vec.report import build_report
    golden = goldens[("tiny", "fp32")]
    runs = [{"engine": "bf16", "model": "tiny", "precision": "fp32", "mode": "score", "precision_class": "bfloat16",
             "result": write_result(tmp_path / "bf16.json", noisy(perfect_result(golden, "score"), 0.3, seed=5))},
            {"engine": "f32", "model": "tiny", "precision": "fp32", "mode": "score", "precision_class": "float32",
             "result": write_result(tmp_path / "f32.json", noisy(perfect_result(golden, "score"), 0.3, seed=5))}]
    res = build_report(runs, goldens, tmp_path / "out")
    score = pd.read_csv(res.paths["score_csv"]).set_index("engine")
    assert score.loc["bf16", "verdict"] == "within budget" and score.loc["f32", "verdict"] == "over budget"
    assert "kl_mean" in score.loc["f32", "over_budget"]
    html = res.paths["html"].read_text()
    assert 'id="score-table"' in html and 'id="plot-score-kl"' in html and "over budget" in html
    assert res.paths["score_kl"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "score bf16 tiny/fp32 (bfloat16): same top-1 100.0%" in res.summary
    assert res.strict_problem is not None   # the float32 run is over its budget
    rows = pd.read_csv(res.paths["csv"])
    assert set(rows.loc[rows["engine"] == "f32", "class"]) == {"over-budget"}
