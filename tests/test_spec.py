"""Config expansion: presets, derived dimensions and the cross-field checks a schema cannot make."""

import pytest

from k2vec.model.architecture import tensor_shapes
from k2vec.errors import ConfigError
from k2vec.config.engines import engine_runs, resolve_engines
from k2vec.config.expand import expand_config, schema_error
from k2vec.config.presets import PRESETS
from conftest import REPO

SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


def test_default_config_expands_with_derived_dims(config):
    cases = expand_config(config)
    assert set(cases) == set(config["models"])
    tiny = cases["tiny"]["model"]
    assert tiny["qk_head_dim"] == 192   # K2's nope 128 + rope 64
    assert tiny["dense_layers"] == [0] and tiny["moe_layers"] == [1, 2]
    assert tiny["experts_per_group"] == 4
    # K2's softmax scale with YaRN factor 64, mscale_all_dim 1 (notes §3): qk^-0.5 * (0.1 ln 64 + 1)^2
    assert tiny["softmax_scale"] == pytest.approx(192 ** -0.5 * (0.1 * 4.1588830833596715 + 1) ** 2)
    assert tiny["n_parameters"] == sum(int(__import__("math").prod(s)) for s in tensor_shapes(tiny).values())
    q = cases["tiny"]["quantization"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in q["tensors"]
    assert "model.layers.0.mlp.gate_proj.weight" in q["tensors"]  # default scheme: dense MLP too
    assert not any("self_attn" in n or n == "lm_head.weight" or n.endswith("mlp.gate.weight") for n in q["tensors"])


def test_schema_preset_enum_matches_code():
    import yaml
    schema = yaml.safe_load(open(SCHEMA))
    assert sorted(schema["$defs"]["model"]["properties"]["preset"]["enum"]) == sorted(PRESETS)
    overridable = set(schema["$defs"]["model"]["properties"]) - {"preset"}
    assert overridable == set(PRESETS["tiny"])


def test_k2_checkpoint_scheme_quantizes_only_routed_experts(config):
    config["quantization"]["scheme"] = "k2-checkpoint"
    q = expand_config(config)["small"]["quantization"]["tensors"]
    assert q and all(".mlp.experts." in n for n in q)
    assert len(q) == 3 * 16 * 3  # 3 MoE layers x 16 experts x gate/up/down


def test_prompt_settings_carry_their_own_near_tie_thresholds(config):
    # the report's thresholds judge; the prompts' own decide the redraws (a report change reruns the report only)
    config["report"]["router_near_tie"] = 0.5
    config["prompts"]["router_near_tie"] = 0.02
    config["prompts"].pop("near_tie", None)
    p = expand_config(config)["small"]["prompts"]
    assert p == {"seed": 7, "count": 4, "min_length": 4, "max_length": 12, "redraw_attempts": 64,
                 "near_tie": 1e-3, "router_near_tie": 0.02}


def test_engine_ddtree_budgets_select_its_runs(config):
    config["engines"] = {"numpy": {**config["engines"]["numpy"], "ddtree_budgets": [16, 1]}}
    engines = resolve_engines(config, str(REPO))
    modes = sorted({mode for _, _, _, mode in engine_runs(engines, config["decoding"]["ddtree"]["budgets"])})
    assert modes == ["ddtree-b1", "ddtree-b16", "greedy", "score"]
    config["engines"]["numpy"]["ddtree_budgets"] = [1, 32]
    with pytest.raises(ConfigError, match=r"engines\.numpy\.ddtree_budgets.*\[32\] not in decoding\.ddtree\.budgets"):
        resolve_engines(config, str(REPO))


def test_yarn_factor_must_match_max_positions(config):
    config["models"]["tiny"]["max_position_embeddings"] = 1024   # 64 x 8 = 512
    with pytest.raises(ConfigError, match=r"models\.tiny\.max_position_embeddings.*512"):
        expand_config(config)


def test_q_lora_null_gives_q_proj(config):
    config["models"]["tiny"]["q_lora_rank"] = None
    shapes = tensor_shapes(expand_config(config)["tiny"]["model"])
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [4 * (128 + 64), 128]   # heads x (nope + rope)
    assert not any("q_a_proj" in n for n in shapes)


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["models"]["tiny"].update(num_experts_per_tok=9), "models.tiny.num_experts_per_tok"),
    (lambda c: c["models"]["tiny"].update(n_group=3), "models.tiny.n_group"),
    (lambda c: c["models"]["tiny"].update(n_group=8), "models.tiny.n_group"),
    (lambda c: c["models"]["tiny"].update(topk_group=3), "models.tiny.topk_group"),
    (lambda c: c["models"]["tiny"].update(first_k_dense_replace=4), "models.tiny.first_k_dense_replace"),
    (lambda c: c["models"]["tiny"].update(qk_rope_head_dim=15), "models.tiny.qk_rope_head_dim"),
    (lambda c: c["models"]["tiny"].update(preset="tinny"), "models.tiny.preset"),
    (lambda c: c["models"]["tiny"].update(hidden=64), "models.tiny.hidden"),
    (lambda c: c["quantization"].update(group_size=128), "quantization.group_size"),
    (lambda c: c["quantization"].update(ignore=["re:("]), "quantization.ignore"),
    (lambda c: c["quantization"].update(targets=["nothing.matches"]), "quantization.targets"),
    (lambda c: c["prompts"].update(min_length=20), "prompts.min_length"),
    (lambda c: c["decoding"].update(top_k=100000), "decoding.top_k"),
    (lambda c: c["decoding"]["ddtree"].update(budgets=[4, 4]), "decoding.ddtree.budgets"),
])
def test_cross_field_errors_name_the_key(config, mutate, key):
    mutate(config)
    with pytest.raises(ConfigError) as err:
        expand_config(config)
    assert err.value.key == key
    assert str(err.value).startswith(f"config key '{key}':")


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c.pop("decoding"), "(top level)"),
    (lambda c: c.update(extra=1), "(top level)"),
    (lambda c: c["prompts"].update(count="four"), "prompts.count"),
    (lambda c: c["models"]["tiny"].update(hidden_size=-128), "models.tiny.hidden_size"),
    (lambda c: c["quantization"].update(scale_dtype="float16"), "quantization.scale_dtype"),
    # 1e308 passed a bare minimum, then crashed the runner in int() (OverflowError, the engine orphaned)
    (lambda c: c["engines"]["numpy"].update(timeout_s=1e308), "engines.numpy.timeout_s"),
    (lambda c: c["engines"]["numpy"].update(build_timeout_s=1e308), "engines.numpy.build_timeout_s"),
    (lambda c: c["engines"]["numpy"].update(max_result_mb=1e308), "engines.numpy.max_result_mb"),
], ids=["missing-section", "extra-key", "wrong-type", "negative", "enum", "timeout-1e308", "build-timeout-1e308",
        "max-result-1e308"])
def test_schema_errors_name_the_key(config, mutate, key):
    assert schema_error(config, SCHEMA) is None
    mutate(config)
    err = schema_error(config, SCHEMA)
    assert err is not None and err.key == key


def test_schema_maxima_are_the_engine_limits():
    import yaml
    from k2vec.config.engines import ENGINE_LIMITS
    props = yaml.safe_load(open(SCHEMA))["$defs"]["engine"]["properties"]
    assert {k: props[k]["maximum"] for k in ENGINE_LIMITS} == ENGINE_LIMITS


@pytest.mark.parametrize("key, value", [("timeout_s", float("nan")), ("timeout_s", float("inf")),
                                        ("max_result_mb", float("nan")), ("build_timeout_s", 1e308)])
def test_engine_limits_are_finite_and_bounded(config, key, value):
    # a NaN passes every schema bound (it compares false with all): the resolved engine refuses it itself
    config["engines"]["numpy"][key] = value
    with pytest.raises(ConfigError) as err:
        resolve_engines(config, str(REPO))
    assert err.value.key == f"engines.numpy.{key}", err.value


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["report"].update(fingerprint_rtol=float("nan")), "report.fingerprint_rtol"),
    (lambda c: c["report"].update(near_tie=float("inf")), "report.near_tie"),
    (lambda c: c["decoding"]["ddtree"].update(accuracies=[0.9, float("nan")]), "decoding.ddtree.accuracies[1]"),
], ids=["nan-threshold", "inf-threshold", "nan-in-list"])
def test_non_finite_numbers_are_refused_naming_the_key(config, mutate, key):
    # .nan passes the schema, and a divergence threshold of NaN never fires
    mutate(config)
    assert schema_error(config, SCHEMA) is None
    with pytest.raises(ConfigError) as err:
        expand_config(config)
    assert err.value.key == key, err.value


def test_engines_get_score_runs_unless_they_opt_out_and_null_disables_one():
    from k2vec.config.engines import engine_runs, resolve_engines
    from conftest import default_config
    cfg = default_config()
    cmd = "run {bundle} {output}"
    cfg["engines"] = {"plain": {"command": cmd}, "no_score": {"command": cmd, "modes": ["greedy", "ddtree"]},
                      "numpy": None}
    engines = resolve_engines(cfg, str(REPO), defined={"numpy"})
    assert sorted(engines) == ["no_score", "plain"]   # null: disabled, not an error
    with pytest.raises(ConfigError, match="engines.numpy.*known engines: no_score, plain"):
        resolve_engines(cfg, str(REPO))   # a null that no config file defines: a typo
    modes = {(e, mode) for e, _, _, mode in engine_runs(engines, [4])}
    assert ("plain", "score") in modes and ("no_score", "score") not in modes
    assert {m for e, m in modes if e == "plain"} == {"greedy", "ddtree-b4", "score"}


@pytest.mark.parametrize("entry, key, reason", [
    ({"command": "run {bundle} {output} --layers {layer}"}, "command", "unknown placeholder {layer} at character 32"),
    ({"command": "run --output {output}"}, "command", "must use {bundle} and {output}"),
    ({"command": "run --bundle {bundle} > result.json"}, "command", "must use {bundle} and {output}"),
    ({"command": "run {bundle} {output}", "models": ["tiny", "tiyn"]}, "models", "unknown model 'tiyn'"),
    ({"command": "run {bundle} {output}", "sources": ["src/k2vec/engines/*.py", "engine/*.cu"]}, "sources",
     "pattern 'engine/*.cu' matches no file"),
], ids=["unknown-placeholder", "no-bundle", "no-output", "unknown-model", "sources-match-nothing"])
def test_bad_engine_entry_names_its_key(entry, key, reason):
    from k2vec.config.engines import resolve_engines
    from conftest import default_config
    cfg = default_config()
    cfg["engines"] = {**cfg["engines"], "mine": entry}
    with pytest.raises(ConfigError) as err:
        resolve_engines(cfg, str(REPO))
    assert err.value.key == f"engines.mine.{key}"
    assert str(err.value).startswith(f"config key 'engines.mine.{key}': {reason}"), str(err.value)
