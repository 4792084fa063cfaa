"""The default cases are strong: long positions where YaRN matters, and no blind prompt rows."""
import copy

import numpy as np
import pytest

from k2vec.model.architecture import tensor_shapes
from k2vec.errors import ConfigError
from k2vec.stages.golden import open_weights, reference_model, strength
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.kdtr import open_bundle
from k2vec.stages.prompts import candidate, draw_prompts
from k2vec.reference.generate import greedy_generate, logits_no_cache
from k2vec.config.expand import expand_config
from k2vec.stages.weights import make_tensor, write_checkpoint
from conftest import default_config

CASES = expand_config(default_config())


def fp32_model(spec):
    return reference_model(spec, {n: make_tensor(spec, n, list(s)) for n, s in tensor_shapes(spec).items()})


def test_candidates_derive_from_names_and_attempt():
    settings, spec = CASES["small"]["prompts"], CASES["small"]["model"]
    a = [candidate(settings, spec, i, t) for i in range(3) for t in range(2)]
    assert a == [candidate(settings, spec, i, t) for i in range(3) for t in range(2)]   # any call order
    assert len({tuple(c) for c in a}) == len(a)
    assert all(settings["min_length"] <= len(c) <= settings["max_length"] and 0 <= min(c) and max(c) < 2048 for c in a)


def test_redraw_rejects_near_tied_prompts_and_gives_up_with_the_key():
    case = CASES["small"]
    model = fp32_model(case["model"])
    strict = {**case["prompts"], "router_near_tie": 0.01, "near_tie": 0.1}   # rejects many candidates
    got = draw_prompts(strict, case["model"], {"fp32": model})
    assert max(got["attempts"]) > 1
    rows = greedy_generate(model, got["tokens"], 1)
    for i, g in enumerate(rows):   # the golden's own margins at the prompt positions clear both thresholds
        assert g.router_margins[:, :g.prompt.size].min() >= 0.01 and g.margins[0] >= 0.1
        assert got["tokens"][i] == candidate(strict, case["model"], i, got["attempts"][i] - 1)
    with pytest.raises(ConfigError, match=r"prompts\.redraw_attempts"):
        draw_prompts({**strict, "router_near_tie": 1.0, "redraw_attempts": 3}, case["model"], {"fp32": model})


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_default_prompt_row_is_blind(name, tmp_path):
    """Under both precisions' weights, no default prompt has a golden router margin below
    report.router_near_tie at a prompt position or a step-0 logit gap below report.near_tie."""
    case = copy.deepcopy(CASES[name])
    write_checkpoint(case["model"], tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "int4", case["quantization"])
    models = {p: reference_model(case["model"], open_weights(p, tmp_path / "fp32", tmp_path / "int4"))
              for p in ("fp32", "int4")}
    prompts = draw_prompts(case["prompts"], case["model"], models)
    for precision, model in models.items():
        summary = strength(greedy_generate(model, prompts["tokens"], 2), case["model"], prompts)
        assert summary["blind_prompts"] == [], (precision, summary)
        assert min(summary["prompt_router_margin"]) >= case["prompts"]["router_near_tie"]
        assert min(summary["prompt_token_margin"]) >= case["prompts"]["near_tie"]


def test_default_positions_are_where_yarn_interpolation_matters():
    """Disabling YaRN's interpolation (every pair at its original frequency) moves the default tiny
    model's logits over a default-length sequence by 5.7 (median over positions of the largest
    change; 12.7 at most); over K2's original 4,096 by 0.03: the default case is what makes a YaRN
    frequency bug visible."""
    spec = CASES["tiny"]["model"]
    n = CASES["tiny"]["prompts"]["max_length"] + CASES["tiny"]["decoding"]["max_new_tokens"] - 1
    assert n > 4 * spec["rope_scaling"]["original_max_position_embeddings"]
    tokens = np.random.default_rng(0).integers(0, spec["vocab_size"], n)

    def change(orig):
        s = copy.deepcopy(spec)
        s["rope_scaling"]["original_max_position_embeddings"] = orig
        yarn = fp32_model(s)
        plain = fp32_model(s)
        plain.inv_freq = 1.0 / s["rope_theta"] ** (np.arange(0, s["qk_rope_head_dim"], 2) / s["qk_rope_head_dim"])
        per_position = np.abs(logits_no_cache(yarn, tokens) - logits_no_cache(plain, tokens)).max(-1)
        return np.median(per_position), per_position.max()

    default, k2 = change(spec["rope_scaling"]["original_max_position_embeddings"]), change(4096)
    print(f"|logit change| without interpolation, median and max over positions: default {default}, K2's 4096 {k2}")
    assert default[0] > 2.0 and default[1] > 5.0 and k2[0] < 0.1


def test_report_shows_golden_strength_and_flags_blind_prompts(tmp_path):
    from k2vec.report import build_report
    from k2vec.report.golden_data import Golden, golden_strength
    from support.synthetic import perfect_result, write_result
    from test_report_metrics import make_goldens

    goldens = make_goldens(tmp_path / "goldens")
    opened = {k: Golden(*k, p) for k, p in goldens.items()}
    try:
        per_golden, per_prompt = golden_strength(opened, 1e-3, 1e-3)
        strict = golden_strength(opened, 1e-3, 1.0)[1]    # every router margin is below 1: all blind
    finally:
        for g in opened.values():
            g.close()
    with open_bundle(goldens[("tiny", "fp32")]) as b:
        md = b.metadata["summary"]
        routed = [np.unique(np.asarray(b[f"golden.p{i}.router_ids"])[0]) for i in range(b.metadata["prompts"])]
    row = per_golden[per_golden["precision"] == "fp32"].iloc[0]
    assert (row["experts_routed"] == md["experts_routed"]
            and row["experts_routed"][0] == np.unique(np.concatenate(routed)).size)
    assert row["n_routed_experts"] == 8 and row["n_group"] == 2 and all(1 <= x <= 2 for x in row["groups_routed"])
    fp32 = per_prompt[per_prompt["precision"] == "fp32"]
    np.testing.assert_allclose(fp32["prompt_router_margin"], md["prompt_router_margin"])
    np.testing.assert_allclose(fp32["step0_margin"], md["prompt_token_margin"])
    assert list(fp32["distinct_tokens"]) == md["distinct_tokens"]
    assert not per_prompt["blind"].any() and strict["blind"].all()

    path = write_result(tmp_path / "r.json", perfect_result(goldens[("tiny", "fp32")], "greedy"))
    res = build_report([{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": path}],
                       goldens, tmp_path / "out", router_near_tie=1.0)   # every prompt blind
    html = res.paths["html"].read_text()
    assert 'id="strength-table"' in html and 'id="prompt-strength-table"' in html and "tiny/int4" in html
    assert "2 of 2" in html and "blind prompt(s), near-tied at a prompt position: tiny/fp32 p0" in \
        res.paths["summary"].read_text()
