"""What a reduced-precision verdict resolves (k2vec.report.resolution) and the score run's KL against the noise
model (k2vec.report.score, report/noise.py): named cases, each a small record, as llama.cpp's test-backend-ops
lists its cases. The resolution is the rule's own boundary; the mutants below it come from the mutation run's
file when it is of the same golden; a clean reduced-precision engine is told where its verdict stops and which
float32 engine sees further; a bug only the KL of its score run shows is over the noise model."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from test_report_metrics import make_goldens
from test_report_noise import _golden, emulated, judge, make_noise_models

from k2vec.config.engines import command_family, float32_counterparts
from k2vec.report.html import summary_text
from k2vec.report.noise import NoiseModel, Rule
from k2vec.report.resolution import MUTATION_RESOLUTION_COLUMNS, resolution_lines, resolution_table
from support.synthetic import perfect_result

RULE = Rule.from_config(None)
FAILING = {"real", "over-budget"}


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("resolution-goldens"))


@pytest.fixture(scope="module")
def weights(goldens):
    from k2vec.stages.golden import open_weights
    return open_weights("fp32", goldens[("tiny", "fp32")].parent / "fp32")


@pytest.fixture(scope="module")
def noise(goldens, weights, tmp_path_factory):
    return make_noise_models(goldens, weights, tmp_path_factory.mktemp("noise"))


# ------------------------------------------------------------------ the resolution is the rule's boundary

def _model(env_hidden, env_logit, env_kl, judged) -> NoiseModel:
    """A noise model of given envelopes ([P, N, L], [P, N], [P, N]) and judged steps ([P, N])."""
    nm = object.__new__(NoiseModel)
    nm.env_hidden, nm.env_logit, nm.env_kl, nm.judged = (np.asarray(a, float) for a in (env_hidden, env_logit, env_kl,
                                                                                           judged))
    nm.judged = nm.judged.astype(bool)
    return nm


@dataclass(frozen=True)
class EnvelopeCase:
    name: str
    env: np.ndarray         # [P, N] logit envelope (hidden: the same at every layer, KL: its tenth)
    judged: np.ndarray      # [P, N]
    logit_abs: float        # the expected resolution of the logits (NaN: too few cells)


_RAMP = np.arange(1.0, 21.0).reshape(2, 10)   # 20 cells, envelopes 1..20
ENVELOPE_CASES = [
    # 20 cells: more than 20% beyond is 5 of them; an error beyond 2x the 5th smallest (5) has them
    EnvelopeCase("ramp", _RAMP, np.ones((2, 10)), 2 * 5.0),
    # the steps where a schedule flips an expert are not cells: the 10 of prompt 1 left, 3 beyond is over
    EnvelopeCase("unjudged-prompt", _RAMP, np.r_[[np.zeros(10)], [np.ones(10)]], 2 * 13.0),
    EnvelopeCase("uniform", np.full((2, 10), 0.5), np.ones((2, 10)), 2 * 0.5),
    # fewer than min_cells (6) cells: the rule judges nothing there
    EnvelopeCase("too-few-cells", _RAMP, np.r_[[np.zeros(10)], [np.r_[np.ones(5), np.zeros(5)]]], np.nan),
]


@pytest.mark.parametrize("case", ENVELOPE_CASES, ids=lambda c: c.name)
def test_resolution_is_where_the_rule_turns(case):
    L = 3
    hidden = np.repeat(case.env[..., None], L, -1) * np.array([1.0, 2.0, 3.0])   # layer l: (l + 1) x
    r = _model(hidden, case.env, case.env / 10, case.judged).resolution(RULE)
    np.testing.assert_allclose([r["logit_abs"], r["kl"] * 10 / RULE.kl_margin * RULE.margin],
                               [case.logit_abs] * 2, equal_nan=True)
    np.testing.assert_allclose(r["hidden_rel_layers"], [case.logit_abs * (i + 1) for i in range(L)], equal_nan=True)
    if np.isnan(case.logit_abs):
        return
    # an engine off by the resolution at every cell is within the rule; a hair more is over it
    cells = case.env[case.judged.astype(bool)]
    for error, over in ((r["logit_abs"], False), (r["logit_abs"] * (1 + 1e-9), True)):
        beyond = (error > RULE.margin * cells).sum()
        assert (beyond > RULE.fraction * cells.size) == over, (case.name, error, beyond)


# ------------------------------------------------------------------ the mutants below it, from the mutation run

SHA = "a" * 64


def _measured(*rows) -> pd.DataFrame:
    """mutation_resolution.csv rows: (mutant, model, precision, golden sha256, seen: resolvable and caught), at
    bfloat16."""
    return pd.DataFrame([{"mutant": mu, "compute": "bfloat16", "model": m, "precision": p, "golden_sha256": sha,
                          "hidden_beyond": 0.0, "logit_beyond": 0.0, "kl_beyond": 0.0, "router_beyond": 0.0,
                          "resolvable": ok, "catch_rate": float(ok), "below": not ok} for mu, m, p, sha, ok in rows],
                        columns=MUTATION_RESOLUTION_COLUMNS)


@dataclass(frozen=True)
class MutationCase:
    name: str
    measured: pd.DataFrame | None   # the mutation run's file; None: it has not run
    below: list[str] | None         # the mutants named below tiny/fp32's resolution; None: none can be
    note: str | None                # why not


MUTATION_CASES = [
    MutationCase("no-mutation-run", None, None, "no mutation run: `snakemake mutation_report`"),
    MutationCase("two-below-one-resolvable", _measured(("router_logits_bf16", "tiny", "fp32", SHA, False),
                                                       ("experts_gelu", "tiny", "fp32", SHA, True),
                                                       ("int4_scale_bf16", "tiny", "fp32", SHA, False),
                                                       ("mla_q_norm_skipped", "tiny", "int4", SHA, False)),
                 ["int4_scale_bf16", "router_logits_bf16"], None),
    MutationCase("none-below", _measured(("experts_gelu", "tiny", "fp32", SHA, True)), [], None),
    # results of an older golden: naming their mutants would be a guess
    MutationCase("another-golden", _measured(("router_logits_bf16", "tiny", "fp32", "b" * 64, False)), None,
                 "of another golden: rerun `snakemake mutation_report`"),
    MutationCase("other-bundle-only", _measured(("router_logits_bf16", "tiny", "int4", SHA, False)), None,
                 "did not judge tiny/fp32 at bfloat16"),
]


@pytest.mark.parametrize("case", MUTATION_CASES, ids=lambda c: c.name)
def test_mutants_below_the_resolution_come_from_the_same_golden(tmp_path, case):
    path = tmp_path / "mutation_resolution.csv"
    if case.measured is not None:
        case.measured.to_csv(path, index=False)
    nm = _model(np.ones((2, 10, 3)), np.ones((2, 10)), np.ones((2, 10)), np.ones((2, 10)))
    (r,) = resolution_table({("tiny", "fp32", "bfloat16"): nm}, {("tiny", "fp32"): SimpleNamespace(sha256=SHA)}, RULE,
                            path).to_dict("records")
    assert r["below"] == case.below
    assert (r["mutation_note"] is None) if case.note is None else (case.note in r["mutation_note"])
    assert (r["hidden_rel"], r["logit_abs"], r["kl"]) == (RULE.margin, RULE.margin, RULE.kl_margin)


# ------------------------------------------------------------------ the score run's KL against the noise model

def sharpened(result: dict, nm: NoiseModel, factor: float) -> dict:
    """At every step the top-1 logit raised and every other one lowered by `factor` times the noise model's
    logit envelope there: each logit within `factor` x the envelope, the distribution sharper than rounding
    makes it (a softmax-temperature or scale bug on the head)."""
    for i, p in enumerate(result["runs"][0]["prompts"]):
        logits = np.array(p["topk_logits"])
        delta = factor * nm.env_logit[i, :len(logits), None]
        logits += np.where(np.arange(logits.shape[1]) == 0, delta, -delta)
        p["topk_logits"] = logits.tolist()
    return result


@dataclass(frozen=True)
class SharpCase:
    name: str
    factor: float           # sharpened() by this much of the logit envelope
    over: bool              # over the noise model, by its KL alone


SHARP_CASES = [
    SharpCase("within-rounding", 0.5, False),
    # every logit within 1.5x the envelope (the logit cells see nothing) and a mean KL below the noise model's
    # and the fixed budget's: only its KL, position by position, is beyond what rounding does
    SharpCase("sharpened-head", 1.5, True),
]


@pytest.mark.parametrize("case", SHARP_CASES, ids=lambda c: c.name)
def test_score_kl_is_judged_against_the_noise_model(tmp_path, goldens, noise, case):
    nm = NoiseModel(noise[("tiny", "fp32", "bfloat16")], _golden(goldens), "bfloat16")
    result = sharpened(perfect_result(goldens[("tiny", "fp32")], "score"), nm, case.factor)
    m = judge(tmp_path, goldens, noise, {"sharp": {"score": result}})
    (s,) = m.score_runs.to_dict("records")
    (t,) = m.noise_table.to_dict("records")
    assert t["logit_beyond"] == 0 and t["hidden_beyond"] == 0 and s["kl_cells"] == t["kl_cells"] >= RULE.min_cells
    assert (s["noise_kl_mean"], s["noise_kl_p99"]) == pytest.approx(nm.kl_stats())
    assert s["kl_mean"] < min(s["noise_kl_mean"], 0.2)   # below the noise model's mean and the fixed budget
    classes = set(m.rows["class"])
    if case.over:
        assert s["verdict"] == "over the noise model" and pd.isna(s["over_budget"])
        assert s["noise_over"].startswith(f"KL beyond {RULE.kl_margin:g}x the noise model at ")
        assert classes == {"over-budget"} and m.rows["over_budget"].str.contains("over the noise model: KL").all()
        # the fixed budgets alone let it through
        (tmp_path / "fixed").mkdir()
        fixed = judge(tmp_path / "fixed", goldens, None, {"sharp": {"score": result}})
        assert not set(fixed.rows["class"]) & FAILING and fixed.score_runs["verdict"].iloc[0] == "within budget"
    else:
        assert s["verdict"] == "within budget" and pd.isna(s["noise_over"]) and not classes & FAILING
        assert s["kl_beyond"] <= RULE.fraction * s["kl_cells"]


# ------------------------------------------------------------------ a clean engine is told where its verdict stops

@dataclass(frozen=True)
class CleanCase:
    name: str
    engine: dict = field(default_factory=dict)   # emulated(): a catalogue mutant or a mixing-weight scale
    clean: bool = True


CLEAN_CASES = [CleanCase("correct"), CleanCase("mixing-weights-x0.9", {"scale": 0.9}, clean=False)]


@pytest.fixture(scope="module")
def judged(goldens, weights, noise, tmp_path_factory):
    """The clean cases judged once, with a mutation run's file naming one mutant below tiny/fp32's resolution,
    one above it, one of another bundle; `correct` has a float32 counterpart, the bug has none."""
    import dataclasses

    tmp = tmp_path_factory.mktemp("clean")
    sha = _golden(goldens).sha256
    path = tmp / "mutation_resolution.csv"
    _measured(("router_logits_bf16", "tiny", "fp32", sha, False), ("experts_gelu", "tiny", "fp32", sha, True),
              ("int4_scale_bf16", "tiny", "int4", sha, False)).to_csv(path, index=False)
    results = {c.name: {mode: emulated(goldens, weights, mode, **c.engine) for mode in ("greedy", "score")}
               for c in CLEAN_CASES}
    m = judge(tmp, goldens, noise, results, mutation_resolution=path)
    return dataclasses.replace(m, float32_engines={"correct": "correct-fp32"}, left_out={"correct-fp32": "no GPU"})


@pytest.mark.parametrize("case", CLEAN_CASES, ids=lambda c: c.name)
def test_a_clean_engine_is_told_its_resolution_and_its_float32_run(goldens, noise, judged, case):
    nm = NoiseModel(noise[("tiny", "fp32", "bfloat16")], _golden(goldens), "bfloat16")
    res = nm.resolution(RULE)
    (r,) = judged.resolution.to_dict("records")
    assert r["below"] == ["router_logits_bf16"] and r["hidden_rel"] == res["hidden_rel"] > 0
    lines = [line.strip() for line in summary_text(judged).splitlines()]
    mine = [line for line in lines if line.startswith(f"CLEAN {case.name} ")]
    if not case.clean:
        assert not mine
        return
    (line,) = mine
    assert line.startswith(f"CLEAN {case.name} tiny/fp32: clean at bfloat16 down to hidden-state rel. error "
                           f"{res['hidden_rel']:.2e} "
                           f"(by layer {', '.join(f'{v:.2e}' for v in res['hidden_rel_layers'])}), "
                           f"logit error {res['logit_abs']:.2e}, KL {res['kl']:.2e}; ")
    assert line.endswith("bugs smaller than that (e.g. router_logits_bf16 of the catalogue) need the float32 run of "
                         "this engine: correct-fp32 (left out of this run)")
    from k2vec.report.html import _resolution_card
    card = _resolution_card(judged)
    assert 'id="resolution-table"' in card and "router_logits_bf16" in card
    assert f"<b>{case.name}</b>: the float32 run of this engine: correct-fp32" in card


def test_a_bundle_with_no_clean_engine_still_states_its_resolution(goldens, weights, noise, tmp_path):
    m = judge(tmp_path, goldens, noise, {"bug": {"score": emulated(goldens, weights, "score", scale=0.9)}})
    (line,) = [x.strip() for x in summary_text(m).splitlines() if x.strip().startswith("resolution ")]
    assert line.startswith("resolution tiny/fp32 at bfloat16: the noise model's verdict resolves "
                           "hidden-state rel. error ")
    assert line.endswith("need a float32 run (no mutation run: `snakemake mutation_report` names the catalogue's "
                         "bugs below it)")
    assert "CLEAN" not in summary_text(m)


@dataclass(frozen=True)
class FamilyCase:
    name: str
    engines: dict           # name -> (command, precision)
    counterparts: dict


FAMILY_CASES = [
    FamilyCase("dtype-flag", {"hf_fp32": ("OMP_NUM_THREADS=1 {python} -m k2vec.engines.hf --dtype float32 "
                                          "--batch {batch}", "float32"),
                              "hf_bf16": ("OMP_NUM_THREADS=2 {python} -m k2vec.engines.hf --dtype bfloat16 "
                                          "--batch {batch}", "bfloat16")}, {"hf_bf16": "hf_fp32"}),
    FamilyCase("another-program", {"numpy": ("{python} -m k2vec.engines.numpy_engine --batch {batch}", "float32"),
                                   "gpu_bf16": ("{python} -m k2vec.engines.gpu_triton --batch {batch}", "bfloat16")},
               {}),
    FamilyCase("first-by-name", {"b32": ("./eng --fp32 --output {output}", "float32"),
                                 "a32": ("./eng --output {output}", "float32"),
                                 "bf": ("./eng --bf16 --output {output}", "bfloat16")}, {"bf": "a32"}),
]


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c.name)
def test_float32_counterpart_is_the_same_program(case):
    engines = {n: {"command": c, "precision": p} for n, (c, p) in case.engines.items()}
    assert float32_counterparts(engines) == case.counterparts
    assert command_family("A=1 B=x ./run -m mod --flag v") == ("./run", "-m", "mod")


def test_the_default_config_names_each_reduced_engine_its_float32_one():
    import yaml

    from conftest import REPO
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    engines = {n: {"command": e["command"], "precision": e.get("precision", "float32")}
               for n, e in cfg["engines"].items()}
    assert float32_counterparts(engines) == {"gpu_bf16": "gpu_fp32", "hf_bf16": "hf_fp32"}


def test_resolution_lines_without_a_noise_model_are_none():
    empty = resolution_table({}, {}, RULE)
    assert empty.empty and resolution_lines(empty, pd.DataFrame(), pd.DataFrame(), {}, {}) == []


def test_the_mutation_run_writes_what_the_report_reads(tmp_path):
    """mutation/score.py's per-bundle table, written and read back by the report. On tiny/fp32 the mutant whose
    float32 runs stay within the noise model and whose bfloat16 runs are not caught is below its resolution; one
    over it is not; one within it (few cells: it flipped an expert at once) whose bfloat16 runs are caught is not
    either. A mutant not planned at bfloat16 (DDTree's) is left out; the per-mutant verdict takes the bundles
    together."""
    from k2vec.mutation.score import _bundle_resolution, _resolution

    def table_row(mutant, model, precision, hidden, cells, verdict):
        return {"engine": f"mutant-{mutant}-as-bfloat16", "model": model, "precision": precision,
                "precision_class": "bfloat16", "hidden_cells": cells, "hidden_beyond": hidden, "logit_cells": 10,
                "logit_beyond": 0, "kl_cells": 10, "kl_beyond": 0, "router_cells": 0, "router_beyond": 0,
                "held_out_worst": 0.0, "verdict": verdict}
    noise_table = pd.DataFrame([
        table_row("router_logits_bf16", "tiny", "fp32", 1, 20, "within"),
        table_row("experts_gelu", "tiny", "fp32", 15, 20, "over the noise model: hidden"),
        table_row("experts_gelu", "tiny", "int4", 2, 20, "within"),
        table_row("router_group_max", "tiny", "fp32", 0, 0, "within"),
        table_row("ddtree_mask_causal", "tiny", "fp32", 0, 0, "too few cells"),
    ])
    noise_table.loc[5] = {**noise_table.iloc[0].to_dict(), "engine": "numpy-bfloat16"}   # not a re-judged mutant
    shas = {("tiny", "fp32"): "a" * 64, ("tiny", "int4"): "b" * 64}
    resolution = pd.DataFrame([{"model": m, "precision": p, "precision_class": "bfloat16", "golden_sha256": s}
                               for (m, p), s in shas.items()])
    # the mutants' own bfloat16 rows: router_group_max caught in 3 of 4 on tiny/fp32, experts_gelu in 1 of 4 on int4
    rows = pd.DataFrame({"mutant": ["router_group_max"] * 4 + ["experts_gelu"] * 4 + ["router_logits_bf16"] * 4,
                         "precision_class": "bfloat16", "model": "tiny",
                         "precision": ["fp32"] * 4 + ["int4"] * 4 + ["fp32"] * 4,
                         "caught": [True, True, True, False, True, False, False, False] + [False] * 4})
    planned = pd.DataFrame({"mutant": ["router_logits_bf16", "experts_gelu", "router_group_max"],
                            "compute": "bfloat16"})
    by_bundle = _bundle_resolution(noise_table, resolution, rows, planned, {}, {}, pd.DataFrame())
    assert by_bundle[["mutant", "model", "precision", "golden_sha256", "resolvable", "catch_rate", "below"]
                     ].fillna({"catch_rate": -1}).values.tolist() == [
        ["experts_gelu", "tiny", "fp32", "a" * 64, True, -1, False],   # no bfloat16 run there
        ["experts_gelu", "tiny", "int4", "b" * 64, False, 0.25, True],
        ["router_group_max", "tiny", "fp32", "a" * 64, False, 0.75, False],
        ["router_logits_bf16", "tiny", "fp32", "a" * 64, False, 0.0, True]]
    assert by_bundle["hidden_beyond"].tolist()[:2] == [0.75, 0.1] and np.isnan(by_bundle["hidden_beyond"].iloc[2])
    path = tmp_path / "mutation_resolution.csv"
    by_bundle.to_csv(path, index=False)
    nm = _model(np.ones((2, 10, 3)), np.ones((2, 10)), np.ones((2, 10)), np.ones((2, 10)))
    read = resolution_table({(m, p, "bfloat16"): nm for m, p in shas},
                            {k: SimpleNamespace(sha256=s) for k, s in shas.items()},
                            RULE, path).set_index("precision")["below"]
    assert read["fp32"] == ["router_logits_bf16"] and read["int4"] == ["experts_gelu"]
    scores = pd.DataFrame({"mutant": ["router_logits_bf16", "experts_gelu", "experts_gelu"],
                           "compute": ["bfloat16", "bfloat16", "float32"], "catch_rate": [0.0, 0.5, 1.0]})
    out = _resolution(scores, by_bundle)
    assert out["verdict"].tolist() == ["below resolution", "missed", "caught"]
    assert out["float32_beyond"].tolist()[:2] == [0.05, 0.75] and np.isnan(out["float32_beyond"].iloc[2])


def test_a_tree_mutant_is_resolvable_where_its_float32_effect_comes_before_the_precision_departs():
    """A DDTree mutant changes tokens, not cells: at bfloat16 it is resolvable on a bundle where, in 3/4 of its
    float32 DDTree rows judged at bfloat16, it is caught and leaves the golden before the unmutated bfloat16
    engine does (the recorded drafts follow the golden's tokens; past an engine's own departure its tree is
    barely exercised)."""
    from k2vec.mutation.score import _tree_ahead

    def row(engine, model, prompt, first, cls):
        return {"engine": engine, "model": model, "precision": "fp32", "mode": "ddtree-b4", "accuracy": 0.9,
                "prompt": prompt, "first_step": first, "class": cls}
    judged = "mutant-ddtree_mask_causal-as-bfloat16"
    rejudged = pd.DataFrame(
        # tiny: the bug acts at steps 2, 3, 5, 9, judged at bfloat16 real but the last (a router-near-tie there)
        [row(judged, "tiny", p, f, c) for p, f, c in [(0, 2, "real"), (1, 3, "real"), (2, 5, "real"),
                                                       (3, 9, "router-near-tie")]]
        # small: it acts late, after the bfloat16 engine has left (step 1): 0 of 2
        + [row(judged, "small", p, f, "real") for p, f in [(0, 6), (1, 7)]]
        + [row(judged.replace("as-bfloat16", "as-float16"), "tiny", 0, 2, "real")]  # no control at float16
        + [{**row("mutant-experts_gelu-as-bfloat16", "tiny", 0, 1, "real"), "mode": "greedy"}])  # not a tree mutant
    rows = pd.DataFrame(
        # bfloat16 departs at 10, 10, 4, never on tiny; at step 1 on small
        [row("numpy-bfloat16", "tiny", p, f, "router-near-tie") for p, f in enumerate([10, 10, 4, np.nan])]
        + [row("numpy-bfloat16", "small", p, 1.0, "router-near-tie") for p in range(2)])
    mutants = {"mutant-ddtree_mask_causal": {"name": "ddtree_mask_causal", "area": "ddtree"},
               "mutant-experts_gelu": {"name": "experts_gelu", "area": "experts"}}
    ahead = _tree_ahead(rows, rejudged, mutants, {"float32": "numpy", "bfloat16": "numpy-bfloat16"})
    # tiny: steps 2 and 3 before the departures at 10; step 5 after the departure at 4; step 9 not caught
    assert ahead[("ddtree_mask_causal", "bfloat16", "tiny", "fp32")] == 0.5
    assert ahead[("ddtree_mask_causal", "bfloat16", "small", "fp32")] == 0.0
    assert ahead[("ddtree_mask_causal", "float16", "tiny", "fp32")] == 1.0      # no control: never departs
    assert not any(k[0] == "experts_gelu" for k in ahead.index)


def test_a_clean_engine_without_ddtree_runs_is_not_told_of_ddtree_mutants():
    """The DDTree mutants below a bundle's resolution (below_ddtree) concern only engines that ran DDTree there."""
    r = {"model": "tiny", "precision": "fp32", "precision_class": "bfloat16", "golden_sha256": "a" * 64,
         "hidden_rel": 0.01, "hidden_rel_layers": [0.01], "logit_abs": 0.2, "kl": 0.003, "hidden_cells": 30,
         "step_cells": 10, "below": ["ddtree_mask_causal", "router_logits_bf16"],
         "below_ddtree": ["ddtree_mask_causal"], "mixing_scale": None, "mutation_note": None}
    resolution = pd.DataFrame([r])
    rows = pd.DataFrame({"engine": ["plain", "tree", "tree"], "model": "tiny", "precision": "fp32",
                         "mode": ["greedy", "greedy", "ddtree-b4"], "class": "exact", "tree_match": [None, None, True]})
    noise_table = pd.DataFrame({"engine": ["plain", "tree"], "model": "tiny", "precision": "fp32",
                                "precision_class": "bfloat16", "verdict": "within"})
    lines = {line.split()[1]: line for line in resolution_lines(resolution, rows, noise_table, {}, {})}
    assert "(e.g. router_logits_bf16 of the catalogue)" in lines["plain"]
    assert "(e.g. ddtree_mask_causal, router_logits_bf16 of the catalogue)" in lines["tree"]
