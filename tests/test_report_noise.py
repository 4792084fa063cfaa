"""Reduced-precision verdicts against the noise model (k2vec.stages.noise, k2vec.report.noise), on the tiny
goldens: engines emulated in bfloat16 by the reference model under a schedule the noise model does not use,
correct or with one porting bug. A correct engine passes, in greedy-only runs too; the routing bugs that a
fixed budget missed are over the noise model; the tie credit does not grow with the engine's own errors."""

import dataclasses

import numpy as np
import pytest

from test_report_classify import _tiny_spec, get, noisy
from test_report_metrics import flip, make_goldens

from k2vec.engines.contract.serialize import greedy_prompt, score_prompt
from k2vec.model.precision import ENGINE_SCHEDULE, EXACT, SCHEDULES, get_format
from k2vec.mutation.catalogue import injected
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import ReferenceModel
from k2vec.report.metrics import ReportError, compute_metrics
from k2vec.report.noise import NoiseModel, Rule
from k2vec.stages.golden import open_weights
from k2vec.stages.noise import golden_inputs, make_noise, write_noise
from support.synthetic import write_result

BF16 = ENGINE_SCHEDULE.rounder(get_format("bfloat16"))


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("noise-goldens"))


@pytest.fixture(scope="module")
def gold(goldens):
    from k2vec.kdtr import open_bundle
    with open_bundle(goldens[("tiny", "fp32")]) as b:
        return {"md": b.metadata, **{k: np.array(b[k]) for k in b.keys()}}


@pytest.fixture(scope="module")
def weights(goldens):
    return open_weights("fp32", goldens[("tiny", "fp32")].parent / "fp32")


@pytest.fixture(scope="module")
def noise(goldens, weights, tmp_path_factory):
    return make_noise_models(goldens, weights, tmp_path_factory.mktemp("noise"))


def make_noise_models(goldens, weights, root) -> dict:
    """The bfloat16 noise model of the tiny fp32 golden, as the noise stage writes it, under `root`."""
    path = root / "tiny-fp32-bfloat16.kdtr"
    tensors, metadata = make_noise(_tiny_spec(), weights, golden_inputs(goldens[("tiny", "fp32")]), "bfloat16")
    write_noise(path, tensors, metadata)
    return {("tiny", "fp32", "bfloat16"): path}


def emulated(goldens, weights, mode, *, rounding=BF16, mutant=None, scale=1.0):
    """The result an engine would write: the reference model under `rounding`, with a catalogue mutant
    or the routed scaling factor times `scale`."""
    g = golden_inputs(goldens[("tiny", "fp32")])
    model = ReferenceModel(_tiny_spec(), weights, latent_norm_eps=g["meta"]["reference"]["latent_norm_eps"],
                           rounding=rounding)
    model.dims = dataclasses.replace(model.dims, routed_scaling_factor=model.dims.routed_scaling_factor * scale)

    def decode():
        forced = g["tokens"] if mode == "score" else None
        rs = greedy_generate(model, g["prompts"], g["meta"]["max_new_tokens"], top_k=g["meta"]["top_k"], forced=forced)
        return [score_prompt(r) if mode == "score" else greedy_prompt(r, len(p)) for r, p in zip(rs, g["prompts"])]
    if mutant:
        with injected(mutant) as install:
            install(model)
            prompts = decode()
    else:
        prompts = decode()
    return {"format": "k2vec-engine-result", "version": 1, "runs": [{"drafter": None, "prompts": prompts}]}


def judge(tmp_path, goldens, noise, results, **kw):
    """results: engine -> {mode: result}; every engine declared bfloat16."""
    runs = [{"engine": e, "model": "tiny", "precision": "fp32", "mode": mode, "precision_class": "bfloat16",
             "result": write_result(tmp_path / f"{e}-{mode}.json", r)} for e, by_mode in results.items()
            for mode, r in by_mode.items()]
    return compute_metrics(runs, {k: v for k, v in goldens.items() if k[1] == "fp32"}, noise=noise, **kw)


def classes(m, engine):
    return set(m.rows.loc[m.rows["engine"] == engine, "class"])


FAILING = {"real", "over-budget"}


def test_correct_bfloat16_engine_passes_and_the_porting_bugs_do_not(tmp_path, goldens, weights, noise):
    engines = {"correct": {}, "scale_0.9": {"scale": 0.9}, "bias_in_weights": {"mutant": "router_bias_in_weights"}}
    results = {e: {mode: emulated(goldens, weights, mode, **kw) for mode in ("greedy", "score")}
               for e, kw in engines.items()}
    m = judge(tmp_path, goldens, noise, results)
    assert not classes(m, "correct") & FAILING, m.rows.loc[m.rows["engine"] == "correct", ["class", "over_budget"]]
    for bug in ("scale_0.9", "bias_in_weights"):
        rows = m.rows[m.rows["engine"] == bug]
        assert rows["class"].isin(FAILING).all(), rows[["mode", "class", "over_budget"]]
        assert rows["over_budget"].str.contains("over the noise model").all()
    assert m.strict_problem is not None
    t = m.noise_table.set_index("engine")
    assert t.loc["correct", "verdict"] == "within" and t.loc["correct", "held_out_worst"] < 0.2
    assert t.loc["scale_0.9", "verdict"].startswith("over the noise model: hidden-state error beyond 2x")
    # without the noise model, the fixed bfloat16 budget alone lets the scale bug through (the finding)
    (tmp_path / "fixed").mkdir()
    fixed = judge(tmp_path / "fixed", goldens, None, {"scale_0.9": results["scale_0.9"]})
    assert not classes(fixed, "scale_0.9") & FAILING


def test_greedy_only_engines_are_judged_as_fairly(tmp_path, goldens, weights, noise):
    """No score run to lean on: a correct greedy-only engine has no failing row; with the routed scaling
    factor missing (tiny's is 2.5) every row fails."""
    spec = _tiny_spec()
    results = {"correct": {"greedy": emulated(goldens, weights, "greedy")},
               "no_scaling": {"greedy": emulated(goldens, weights, "greedy",
                                                 scale=1.0 / spec["routed_scaling_factor"])}}
    m = judge(tmp_path, goldens, noise, results)
    assert not classes(m, "correct") & FAILING
    assert classes(m, "no_scaling") <= FAILING


def test_tie_credit_comes_from_the_noise_model_not_the_engines_own_errors(tmp_path, goldens, gold, noise):
    """Two engines flip the same step; one has ten times the other's logit errors before it. Their credit
    is the same, the noise model's at that step, and the noisy one gains no tie the quiet one lacks."""
    from support.synthetic import perfect_result
    quiet, loud = (perfect_result(goldens[("tiny", "fp32")], "greedy"),
                   perfect_result(goldens[("tiny", "fp32")], "greedy"))
    step = 6
    for r in (quiet, loud):
        flip(r, 0, step, gold)
    noisy(quiet, 0.01, seed=1, upto=step)
    noisy(loud, 0.1 * 8.0, seed=1, upto=step)   # a tenth of the bfloat16 budget: within it, far beyond the noise model
    m = judge(tmp_path, goldens, noise, {"quiet": {"greedy": quiet}, "loud": {"greedy": loud}})
    q, lo = get(m, "quiet", 0), get(m, "loud", 0)
    assert q["first_step"] == lo["first_step"] == step
    nm = NoiseModel(noise[("tiny", "fp32", "bfloat16")], _golden(goldens), "bfloat16")
    assert q["noise"] == lo["noise"] == pytest.approx(Rule.from_config(None).margin * nm.env_logit[0, step])
    assert lo["noise_before"] > 5 * q["noise_before"]


def _golden(goldens):
    from k2vec.report.golden_data import Golden
    return Golden("tiny", "fp32", goldens[("tiny", "fp32")])


def test_noise_model_of_another_golden_is_refused(tmp_path, goldens, noise):
    with pytest.raises(ReportError, match="another golden"):
        NoiseModel(noise[("tiny", "fp32", "bfloat16")], Golden_int4(goldens), "bfloat16")


def Golden_int4(goldens):
    from k2vec.report.golden_data import Golden
    g = Golden("tiny", "int4", goldens[("tiny", "int4")])
    g.precision = "fp32"   # pretend: the model and precision match, the golden's bytes do not
    return g


def test_calibration_holds_each_schedule_out(goldens, noise):
    nm = NoiseModel(noise[("tiny", "fp32", "bfloat16")], _golden(goldens), "bfloat16")
    rule = Rule.from_config(None)
    cal = nm.calibration(rule)
    assert sorted(c["schedule"] for c in cal) == sorted(SCHEDULES)
    # each emulated correct engine, held out, stays far below the rule's fraction
    assert all(c[f"{k}_beyond"] < rule.fraction for c in cal for k in ("hidden", "logit", "kl")), cal
    assert all(c["hidden_cells"] > rule.min_cells for c in cal)


def test_noise_rule_settings_are_checked():
    assert Rule.from_config({"margin": 2}).margin == 2.0
    with pytest.raises(ReportError, match="report.noise.margn"):
        Rule.from_config({"margn": 2})
    with pytest.raises(ReportError, match="margin must be >= 1"):
        Rule.from_config({"margin": 0.5})


def test_exact_rounding_leaves_the_reference_bit_identical(goldens, weights):
    g = golden_inputs(goldens[("tiny", "fp32")])
    spec = _tiny_spec()
    a = ReferenceModel(spec, weights).forward(g["prompts"][0], record=True)
    b = ReferenceModel(spec, weights, rounding=EXACT).forward(g["prompts"][0], record=True)
    c = ReferenceModel(spec, weights, rounding=BF16).forward(g["prompts"][0], record=True)
    assert np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden, b.hidden)
    rel = np.linalg.norm(c.hidden - a.hidden) / np.linalg.norm(a.hidden)
    assert 1e-3 < rel < 0.2   # bfloat16's rounding, not a broken model


def test_summary_names_an_engine_judged_without_its_noise_model(tmp_path, goldens, weights):
    from k2vec.report.html import summary_text
    m = judge(tmp_path, goldens, None, {"correct": {"score": emulated(goldens, weights, "score")}})
    assert ("noise model correct tiny/fp32 (bfloat16): none given; judged by the fixed bfloat16 budgets only"
            in summary_text(m))
