"""Known conventions in the report (k2vec.model.conventions, k2vec.stages.convention, report/metrics.py).

An engine that computes the latent norms with eps = rms_norm_eps (vLLM, SGLang, llama.cpp) is over the float32
budget against the golden (transformers' 1e-6) and at float32 noise against that convention's variant: its rows
say `convention` and name it, and fail the strict gate until the engine declares it; declared, it is judged
against the variant and passes. A correct engine's rows name no convention; an engine with the convention and a
bug keeps its failing classes. On the shrunk tiny goldens of the report tests (test_report_metrics.make_goldens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import yaml

from conftest import REPO
from test_report_metrics import make_goldens

from k2vec.config.engines import convention_variants, engine_runs, resolve_engines
from k2vec.config.expand import expand_config
from k2vec.digests import sha256_file
from k2vec.errors import ConfigError
from k2vec.engines.contract.serialize import greedy_prompt, score_prompt
from k2vec.kdtr import open_bundle
from k2vec.model.conventions import CONVENTIONS, ConventionError
from k2vec.mutation.catalogue import MUTANTS, injected
from k2vec.reference.generate import greedy_generate
from k2vec.reference.model import HF_LATENT_NORM_EPS, ReferenceModel
from k2vec.report import build_report
from k2vec.report.golden_data import Golden, ReportError
from k2vec.report.metrics import compute_metrics
from k2vec.stages.convention import make_variant
from k2vec.stages.golden import open_weights, write_golden
from support.synthetic import perfect_result, write_result

NAME = "latent_norm_eps_rms"
LABEL = "latent_norm_eps=rms_norm_eps (vLLM, SGLang, llama.cpp)"
MODES = ("greedy", "score", "ddtree-b4")
FAILING = {"real", "over-budget"}


def tiny_case() -> dict:
    """The case behind make_goldens' tiny goldens (the same shrunk config), prompts as the goldens hold them."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["models"] = {"tiny": {"preset": "tiny"}}
    cfg["prompts"]["count"] = 2
    cfg["decoding"]["max_new_tokens"] = 10
    cfg["decoding"]["ddtree"].update(budgets=[1, 4], accuracies=[0.9, 0.3])
    return expand_config(cfg)["tiny"]


def with_prompts(case: dict, golden) -> dict:
    with open_bundle(golden) as b:
        tokens = [np.asarray(b[f"prompt.p{i}.tokens"]).tolist() for i in range(b.metadata["prompts"])]
    return {**case, "prompts": {**case["prompts"], "tokens": tokens}}


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("convention-goldens"))


@pytest.fixture(scope="module")
def weights(goldens):
    return open_weights("fp32", goldens[("tiny", "fp32")].parent / "fp32")


@pytest.fixture(scope="module")
def variant(goldens, weights, tmp_path_factory):
    """{(model, precision, variant): path}: the fp32 golden's latent_norm_eps_rms variant."""
    golden = goldens[("tiny", "fp32")]
    path = tmp_path_factory.mktemp("variant") / f"fp32-{NAME}.kdtr"
    tensors, metadata = make_variant(with_prompts(tiny_case(), golden), weights, "fp32", golden, [NAME])
    write_golden(path, tensors, metadata)
    return {("tiny", "fp32", NAME): path}


def engine(goldens, weights, mode, *, eps, dtype=np.float32, mutant=None):
    """What a float32 engine with latent-norm epsilon `eps` writes: the reference model in `dtype` (greedy, or
    score: fed the golden's tokens), or a catalogue mutant of the float64 one."""
    with open_bundle(goldens[("tiny", "fp32")]) as b:
        md = b.metadata
        prompts = [np.asarray(b[f"prompt.p{i}.tokens"]) for i in range(md["prompts"])]
        forced = [np.asarray(b[f"golden.p{i}.tokens"]) for i in range(md["prompts"])] if mode == "score" else None
    model = ReferenceModel(tiny_case()["model"], weights, dtype=dtype, latent_norm_eps=eps)
    if mutant:
        with injected(mutant) as install:
            install(model)
            rs = greedy_generate(model, prompts, md["max_new_tokens"], top_k=md["top_k"], forced=forced)
    else:
        rs = greedy_generate(model, prompts, md["max_new_tokens"], top_k=md["top_k"], forced=forced)
    out = [score_prompt(r) if mode == "score" else greedy_prompt(r, len(p)) for r, p in zip(rs, prompts)]
    return {"format": "k2vec-engine-result", "version": 1, "status": "ok", "runs": [{"drafter": None, "prompts": out}]}


@dataclass(frozen=True)
class Engine:
    """An engine of the cases below: how it computes, what it declares."""
    name: str
    eps: float | None          # its latent-norm epsilon; None: the model's rms_norm_eps (the convention)
    declares: tuple[str, ...] = ()
    logit_error: float = 0.0   # a bug on top: every top-k logit of its score run moved by up to this


RMS = Engine("rms-eps", None)
CASES = [
    RMS,
    Engine("rms-eps-declared", None, (NAME,)),
    Engine("golden-eps", HF_LATENT_NORM_EPS),
    Engine("rms-eps-and-a-bug", None, logit_error=0.05),
    Engine("golden-eps-declaring-rms", HF_LATENT_NORM_EPS, (NAME,)),
]


@pytest.fixture(scope="module")
def results(goldens, weights, variant, tmp_path_factory):
    """Each case engine's runs: greedy and score from the reference model in float32, DDTree (budget 4) as the
    golden, or the variant for the convention's engines, has its trees."""
    root = tmp_path_factory.mktemp("results")
    runs = []
    for e in CASES:
        for mode in MODES:
            if mode.startswith("ddtree"):
                follows = goldens[("tiny", "fp32")] if e.eps == HF_LATENT_NORM_EPS else variant[("tiny", "fp32", NAME)]
                res = perfect_result(follows, mode, engine=e.name)
            else:
                res = engine(goldens, weights, mode, eps=e.eps)
            if e.logit_error and mode == "score":
                rng = np.random.default_rng(0)
                for p in res["runs"][0]["prompts"]:
                    p["topk_logits"] = (np.array(p["topk_logits"]) + rng.uniform(0, e.logit_error,
                                                                               np.shape(p["topk_logits"]))).tolist()
            runs.append({"engine": e.name, "model": "tiny", "precision": "fp32", "mode": mode,
                         "conventions": list(e.declares), "result": write_result(root / f"{e.name}-{mode}.json", res)})
    return runs


def fp32(goldens):
    return {k: v for k, v in goldens.items() if k[1] == "fp32"}


def rows_of(m, engine_name):
    return m.rows[m.rows["engine"] == engine_name]


@pytest.fixture(scope="module")
def judged(goldens, variant, results):
    return compute_metrics(results, fp32(goldens), conventions=variant)


def test_the_convention_fails_the_golden_alone(goldens, results):
    """Without the variant, the report has only the golden: the convention's engine is over budget (the
    float32 KL budget), as before this feature, and nothing names a convention."""
    m = compute_metrics([r for r in results if not r["conventions"]], fp32(goldens))
    rows = rows_of(m, RMS.name)
    assert set(rows["class"]) == {"over-budget"}, rows[["mode", "class", "over_budget"]]
    assert rows["over_budget"].str.contains("kl_mean").all()
    assert rows["convention"].isna().all()


def test_an_engine_on_the_convention_is_named_so(judged):
    rows = rows_of(judged, RMS.name)
    assert len(rows) and set(rows["class"]) == {"convention"}, rows[["mode", "class", "over_budget"]]
    assert set(rows["convention"]) == {NAME}
    # the golden's figures stay on the row: what it is off by, against the golden
    assert rows["over_budget"].str.contains("kl_mean").all()
    assert judged.strict_problem is not None and f"{RMS.name}/tiny-fp32-score: convention" in judged.strict_problem


def test_a_declared_convention_is_judged_against_its_variant(judged):
    rows = rows_of(judged, "rms-eps-declared")
    assert set(rows["class"]) == {"exact"}, rows[["mode", "class", "over_budget"]]
    assert set(rows["convention"]) == {NAME}
    # at float32 noise there: far below the budget that the golden's 1e-6 is over
    score = rows[rows["mode"] == "score"]
    assert (score["kl_mean"] < 1e-11).all(), score["kl_mean"]


def test_a_correct_engine_names_no_convention(judged):
    rows = rows_of(judged, "golden-eps")
    assert set(rows["class"]) == {"exact"} and rows["convention"].isna().all()


def test_the_convention_does_not_excuse_a_bug(judged):
    rows = rows_of(judged, "rms-eps-and-a-bug")
    assert set(rows["class"]) <= FAILING and len(rows), rows[["mode", "class"]]
    assert rows["convention"].isna().all()


def test_a_wrong_declaration_is_over_its_variant(judged):
    """Declared, an engine is judged against the variant only: one that computes as the golden is then the
    one off (the declaration is the engine team's statement, and the report holds them to it)."""
    rows = rows_of(judged, "golden-eps-declaring-rms")
    assert set(rows["class"]) == {"over-budget"} and set(rows["convention"]) == {NAME}


def test_only_the_undeclared_convention_fails_the_gate(goldens, variant, results):
    alone = {e.name: compute_metrics([r for r in results if r["engine"] == e.name], fp32(goldens),
                                     conventions=variant).strict_problem for e in CASES}
    assert alone["rms-eps"] is not None and alone["rms-eps-declared"] is None and alone["golden-eps"] is None
    assert alone["rms-eps-and-a-bug"] is not None and alone["golden-eps-declaring-rms"] is not None


def test_the_summary_names_the_convention_and_how_to_accept_it(goldens, variant, results, tmp_path):
    res = build_report([r for r in results if r["engine"] in (RMS.name, "rms-eps-declared", "golden-eps")],
                       fp32(goldens), tmp_path, conventions=variant)
    # 2 prompts x (greedy, score, 2 accuracies)
    assert f"CONVENTION: {RMS.name} tiny/fp32: 8 rows off the golden" in res.summary
    assert LABEL in res.summary and f"engines.{RMS.name}.conventions: [{NAME}]" in res.summary
    assert f"convention: rms-eps-declared judged against the variant {LABEL} (declared" in res.summary
    named = [line for line in res.summary.splitlines() if line.lower().startswith("  convention:")]
    assert len(named) == 2 and not any("golden-eps" in line for line in named)
    csv = (tmp_path / "divergence.csv").read_text().splitlines()
    assert csv[0].split(",")[10:12] == ["class", "convention"]


def test_the_mutant_is_the_convention(goldens, weights, variant, tmp_path):
    """The catalogue's latent-eps mutant installs the convention's own settings: its float64 run equals the
    variant's golden, and the report names it so (the mutation report, judging against the golden alone, still
    catches it: test_the_convention_fails_the_golden_alone)."""
    assert MUTANTS["mla_latent_norm_eps_rms"].exercised(tiny_case()["model"], {}, "fp32", "score", 0)
    res = engine(goldens, weights, "greedy", eps=HF_LATENT_NORM_EPS, dtype=np.float64,
                 mutant="mla_latent_norm_eps_rms")
    with open_bundle(variant[("tiny", "fp32", NAME)]) as b:
        for i, p in enumerate(res["runs"][0]["prompts"]):
            assert p["tokens"] == b[f"golden.p{i}.tokens"].tolist()
            assert np.array_equal(np.array(p["topk_logits"]), b[f"golden.p{i}.topk_logits"])
    runs = [{"engine": "mutant", "model": "tiny", "precision": "fp32", "mode": mode,
             "result": write_result(tmp_path / f"{mode}.json",
                                    engine(goldens, weights, mode, eps=HF_LATENT_NORM_EPS, dtype=np.float64,
                                           mutant="mla_latent_norm_eps_rms"))} for mode in ("greedy", "score")]
    m = compute_metrics(runs, fp32(goldens), conventions=variant)
    assert set(m.rows["class"]) == {"convention"}


# ------------------------------------------------------------------------------ the variant and its inputs


def test_the_variant_is_the_golden_of_the_convention(goldens, variant):
    with open_bundle(goldens[("tiny", "fp32")]) as g, open_bundle(variant[("tiny", "fp32", NAME)]) as v:
        gm, vm = g.metadata, v.metadata
        assert vm["kind"] == "k2vec-golden" and vm["reference"]["conventions"] == [NAME]
        assert vm["reference"]["latent_norm_eps"] == tiny_case()["model"]["rms_norm_eps"] == 1e-5
        assert gm["reference"]["latent_norm_eps"] == HF_LATENT_NORM_EPS and "conventions" not in gm["reference"]
        assert vm["golden_sha256"] == sha256_file(goldens[("tiny", "fp32")])
        # the golden's drafts (what the bundle gives an engine), its prompts; its own logits
        for name in g.keys():
            if name.startswith(("drafts.", "prompt.")):
                assert np.array_equal(g[name], v[name]), name
        moved = max(float(np.abs(g[f"golden.p{i}.topk_logits"] - v[f"golden.p{i}.topk_logits"]).max())
                    for i in range(gm["prompts"]))
        assert 1e-6 < moved < 1e-2, moved


def test_a_variant_and_a_golden_are_not_mistaken(goldens, variant):
    path = variant[("tiny", "fp32", NAME)]
    with pytest.raises(ReportError, match="convention variant 'latent_norm_eps_rms', but was given as the golden"):
        Golden("tiny", "fp32", path)
    with pytest.raises(ReportError, match="holds the golden of the reference, but was given as convention variant"):
        Golden("tiny", "fp32", goldens[("tiny", "fp32")], variant=NAME)
    with pytest.raises(ReportError, match="declares conventions 'latent_norm_eps_rms', but no convention variant"):
        compute_metrics([{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": "x.json",
                          "conventions": [NAME]}], fp32(goldens))


def test_make_variant_refuses_other_prompts_and_no_convention(goldens, weights):
    golden = goldens[("tiny", "fp32")]
    case = with_prompts(tiny_case(), golden)
    other = {**case, "prompts": {**case["prompts"], "tokens": [t[:-1] for t in case["prompts"]["tokens"]]}}
    with pytest.raises(ConventionError, match="other prompts"):
        make_variant(other, weights, "fp32", golden, [NAME])
    with pytest.raises(ConventionError, match="at least one convention"):
        make_variant(case, weights, "fp32", golden, [])


def test_engines_declare_known_conventions_and_the_variants_follow():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["engines"] = {"vllm_like": {**cfg["engines"]["numpy"], "conventions": [NAME], "models": ["tiny"]},
                      "numpy": cfg["engines"]["numpy"]}
    engines = resolve_engines(cfg, str(REPO))
    runs = engine_runs(engines, cfg["decoding"]["ddtree"]["budgets"])
    assert convention_variants(engines, runs) == sorted({(m, p, NAME) for m in cfg["models"] for p in ("fp32", "int4")})
    assert list(CONVENTIONS) == [NAME]
    cfg["engines"]["vllm_like"]["conventions"] = ["latent_norm_eps_1e5"]
    with pytest.raises(ConfigError, match=r"engines\.vllm_like\.conventions.*unknown convention"):
        resolve_engines(cfg, str(REPO))
