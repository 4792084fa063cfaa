"""Config and engine checks of k2vec.config (expand, engines): what mutmut (tools/mutmut.sh spec) found unchecked.

Each rejected config must raise a ConfigError whose whole message names the key and says what to change;
each value at the edge of a range must still be accepted; a resolved case must not share state with the
config it came from (the Snakefile keeps both)."""
import copy
import math

import pytest

from conftest import REPO, default_config
from k2vec.errors import ConfigError
from k2vec.config.engines import (check_sandboxes, engine_runs, engines_missing_modules, engines_short_of_gpus,
                                  resolve_engines)
from k2vec.config.expand import expand_config, schema_error
from k2vec.config.presets import PRESETS

YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0}


def tiny(**settings):
    return lambda c: c["models"]["tiny"].update(settings)


REJECTED = [
    (lambda c: c["models"].update(tiny="tiny"), "models.tiny",
     "must be a mapping with a 'preset' or a 'checkpoint' key"),
    (tiny(preset="tinny"), "models.tiny.preset",
     "unknown preset 'tinny'; choose one of ['k2layer', 'k2slice', 'small', 'tiny']"),
    (tiny(hidden=64), "models.tiny.hidden", "unknown model setting; known: " + str(sorted(PRESETS["tiny"]))),
    (tiny(num_hidden_layers=0), "models.tiny.num_hidden_layers", "must be a positive integer, got 0"),
    (tiny(vocab_size=True), "models.tiny.vocab_size", "must be a positive integer, got True"),
    (tiny(vocab_size=512.0), "models.tiny.vocab_size", "must be a positive integer, got 512.0"),
    (tiny(q_lora_rank=0), "models.tiny.q_lora_rank",
     "must be null (no query compression) or a positive integer, got 0"),
    (tiny(q_lora_rank=True), "models.tiny.q_lora_rank",
     "must be null (no query compression) or a positive integer, got True"),
    (tiny(num_experts_per_tok=9), "models.tiny.num_experts_per_tok", "top-k 9 exceeds n_routed_experts 8"),
    (tiny(n_group=3), "models.tiny.n_group", "n_group 3 must divide n_routed_experts 8"),
    (tiny(n_group=8), "models.tiny.n_group",
     "each expert group needs at least 2 experts (group score = sum of its top 2), but 8 experts / 8 groups = 1"),
    (tiny(topk_group=3), "models.tiny.topk_group", "topk_group 3 exceeds n_group 2"),
    (tiny(num_experts_per_tok=5), "models.tiny.num_experts_per_tok",
     "top-k 5 exceeds the 4 experts in the 1 kept groups"),
    (tiny(first_k_dense_replace=4), "models.tiny.first_k_dense_replace",
     "must be between 0 and num_hidden_layers (3), got 4"),
    (tiny(first_k_dense_replace=-1), "models.tiny.first_k_dense_replace",
     "must be between 0 and num_hidden_layers (3), got -1"),
    (tiny(qk_rope_head_dim=15), "models.tiny.qk_rope_head_dim", "rotary dims come in pairs; 15 is odd"),
    (tiny(n_shared_experts=-1), "models.tiny.n_shared_experts", "must be >= 0"),
    (tiny(rms_norm_eps=0.0), "models.tiny.rms_norm_eps", "must be > 0"),
    (tiny(rope_theta=1.0), "models.tiny.rope_theta", "must be > 1"),
    (tiny(routed_scaling_factor=0.0), "models.tiny.routed_scaling_factor", "must be > 0"),
    (tiny(rope_scaling={k: v for k, v in YARN.items() if k != "beta_slow"}), "models.tiny.rope_scaling.beta_slow",
     "required for YaRN"),
    (tiny(rope_scaling={**YARN, "factor": 0.5}), "models.tiny.rope_scaling.factor", "must be >= 1"),
    (tiny(rope_scaling={**YARN, "beta_slow": 2.0}), "models.tiny.rope_scaling.beta_fast",
     "must be >= beta_slow (the YaRN correction range would be reversed)"),
    (lambda c: c["quantization"].update(scheme="all"), "quantization.scheme",
     "unknown scheme 'all'; choose one of ['default', 'k2-checkpoint']"),
    (lambda c: c["quantization"].update(targets=["re:("]), "quantization.targets",
     "pattern 're:(' is not a valid regular expression"),
    (lambda c: c["quantization"].update(ignore=["re:("]), "quantization.ignore",
     "pattern 're:(' is not a valid regular expression"),
    (lambda c: c["quantization"].update(targets=["nothing.matches"]), "quantization.targets",
     "selects no tensor of model 'tiny'; the int4 precision would equal fp32"),
    (lambda c: c["quantization"].update(group_size=128), "quantization.group_size",
     "group size 128 does not divide the input dimension K=64 of model.layers.1.mlp.experts.0.down_proj.weight "
     "(model 'tiny'); choose a group size dividing 64 or change the model"),
    (lambda c: c["prompts"].update(min_length=13), "prompts.min_length", "min_length 13 exceeds max_length 12"),
    (tiny(max_position_embeddings=35, rope_scaling=None), "prompts.max_length",
     "max_length + decoding.max_new_tokens = 36 exceeds the model's max_position_embeddings 35"),
    (lambda c: c["decoding"].update(top_k=513), "decoding.top_k", "top_k 513 exceeds vocab_size 512 of model 'tiny'"),
    (lambda c: c["decoding"]["ddtree"].update(block_size=1), "decoding.ddtree.block_size",
     "must be at least 2 (root + one draft)"),
    (lambda c: c["decoding"]["ddtree"].update(budgets=[4, 4]), "decoding.ddtree.budgets", "has duplicates"),
    (lambda c: c["decoding"]["ddtree"].update(accuracies=[0.5, 0.5]), "decoding.ddtree.accuracies",
     "has duplicates"),
    (lambda c: c.update(models={}), "models", "must name at least one model"),
    (lambda c: c.update(models=["tiny"]), "models", "must name at least one model"),
    (lambda c: c["models"].update({"ti ny": {"preset": "tiny"}}), "models.ti ny",
     "model names may use letters, digits, '-' and '_' only (they become file names and wildcards)"),
    (lambda c: c["models"].update({3: {"preset": "tiny"}}), "models.3",
     "model names may use letters, digits, '-' and '_' only (they become file names and wildcards)"),
]


@pytest.mark.parametrize("mutate, key, reason", REJECTED)
def test_rejected_config_names_key_and_reason(mutate, key, reason):
    config = default_config()
    mutate(config)
    with pytest.raises(ConfigError) as err:
        expand_config(config)
    assert (err.value.key, err.value.reason) == (key, reason)
    assert str(err.value) == f"config key '{key}': {reason}"


@pytest.mark.parametrize("mutate", [
    tiny(num_experts_per_tok=8, n_group=1, topk_group=1),   # top-k = every expert
    tiny(n_group=4, topk_group=4, num_experts_per_tok=8),   # 2 experts per group, every group kept
    tiny(first_k_dense_replace=0), tiny(first_k_dense_replace=3),  # no dense layer; all dense
    tiny(n_shared_experts=0), tiny(q_lora_rank=1), tiny(rope_theta=1.5), tiny(routed_scaling_factor=0.5),
    tiny(rope_scaling={**YARN, "factor": 1.0}, max_position_embeddings=4096), tiny(rope_scaling=None),
    lambda c: c["prompts"].update(min_length=12),           # min = max
    tiny(max_position_embeddings=36, rope_scaling=None),    # max_length + max_new_tokens = the limit
    lambda c: (c["decoding"].update(top_k=512), c["models"].pop("small")),  # top_k = vocab_size
    lambda c: c["decoding"]["ddtree"].update(block_size=2),
    lambda c: c["models"].update({"t_1-x": {"preset": "tiny"}}),
], ids=lambda f: "")
def test_values_at_the_edge_are_accepted(mutate):
    config = default_config()
    mutate(config)
    assert set(expand_config(config)) == set(config["models"])


@pytest.mark.parametrize("rope_scaling, mscale", [
    (None, 1.0),
    ({**YARN, "factor": 1.0, "mscale_all_dim": 1.0}, 1.0),
    ({**YARN, "factor": 2.0}, 1.0),                          # mscale_all_dim absent: 0
    ({**YARN, "factor": 2.0, "mscale_all_dim": 1.0}, 0.1 * math.log(2.0) + 1),
    ({**YARN, "factor": 4.0, "mscale_all_dim": 0.5}, 0.05 * math.log(4.0) + 1),
])
def test_softmax_scale_follows_yarn_mscale(rope_scaling, mscale):
    config = default_config()
    config["models"]["tiny"]["rope_scaling"] = rope_scaling
    if rope_scaling:  # YaRN: max_position_embeddings = factor x original (spec checks it)
        config["models"]["tiny"]["max_position_embeddings"] = int(rope_scaling["factor"] * 4096)
    model = expand_config(config)["tiny"]["model"]
    assert model["softmax_scale"] == pytest.approx((128 + 64) ** -0.5 * mscale ** 2, rel=1e-12)   # nope + rope


def test_resolved_case_sections_and_values():
    case = expand_config(default_config())["tiny"]
    model = case["model"]
    assert model["name"] == "tiny" and model["preset"] == "tiny"
    assert model["num_key_value_heads"] == 4
    assert model["experts_per_group"] == 4 and type(model["experts_per_group"]) is int
    q = {k: v for k, v in case["quantization"].items() if k != "tensors"}
    assert q == {"scheme": "default", "targets": ["Linear"], "ignore": ["lm_head", "re:.*self_attn.*"], "bits": 4,
                 "symmetric": True, "group_size": 32, "scale_dtype": "float32"}
    # the settings only: the prompts stage (k2vec.stages.prompts) draws the tokens
    assert set(case["prompts"]) == {"seed", "count", "min_length", "max_length", "redraw_attempts", "near_tie",
                                    "router_near_tie"}
    assert (case["prompts"]["seed"], case["prompts"]["count"]) == (7, 4)
    assert case["decoding"] == default_config()["decoding"]


def test_prompt_tokens_are_pinned_by_seed_model_index_and_attempt():
    # golden vectors are compared across versions: the derivation (seed, model name, "prompt", index,
    # "attempt", attempt) of a candidate prompt is fixed
    from k2vec.stages.prompts import candidate
    case = expand_config(default_config())["tiny"]
    prompts = [candidate(case["prompts"], case["model"], i, 0) for i in range(4)]
    assert [len(p) for p in prompts] == [4, 5, 4, 5]
    assert prompts[0] == [190, 455, 48, 80]
    assert candidate(case["prompts"], case["model"], 0, 1) != prompts[0]
    config = default_config()
    config["prompts"].update(min_length=6, max_length=6)
    small = expand_config(config)["small"]
    assert [len(candidate(small["prompts"], small["model"], i, 0)) for i in range(4)] == [6, 6, 6, 6]


def test_resolved_cases_share_no_state_with_the_config_or_presets():
    config = default_config()
    config["models"]["tiny"].update(rope_scaling=dict(YARN), max_position_embeddings=8192)
    before = copy.deepcopy(config)
    presets = copy.deepcopy(PRESETS)
    cases = expand_config(config)
    for case in cases.values():
        case["model"]["rope_scaling"]["factor"] = 99.0
        case["decoding"]["ddtree"]["budgets"].append(99)
    assert config == before and PRESETS == presets
    assert expand_config(config)["small"]["model"]["rope_scaling"]["factor"] == 64.0


def test_schema_error_keeps_the_schema_message():
    config = default_config()
    config["prompts"]["count"] = "four"
    err = schema_error(config, str(REPO / "workflow/schemas/config.schema.yaml"))
    assert err.key == "prompts.count" and err.reason == "'four' is not of type 'integer'"


# ------------------------------------------------------------------------------------------- engines

CMD = "run {bundle} {output}"


def engines_config(**entries):
    config = default_config()
    config["engines"] = entries
    return config


def engine_error(entry, basedir=str(REPO)):
    with pytest.raises(ConfigError) as err:
        resolve_engines(engines_config(bad=entry), basedir)
    return err.value.key, err.value.reason


NEAR = "run --with-a-long-prefix {bundle} {output} {oops} --and-a-long-suffix-after-it"


def test_command_template_errors_say_where():
    assert engine_error({"command": NEAR}) == (
        "engines.bad.command",
        "unknown placeholder {oops} at character 44 (near 'prefix {bundle} {output} {oops} "
        "--and-a-long-suffi'); known: {bundle}, {mode}, {budget}, {output}, {batch}, {gpus}, {python}; "
        "for a brace the shell should see, write it twice ({{ or }})")
    assert engine_error({"command": "awk '{print}' {bundle} {output}"}) == (
        "engines.bad.command",
        "unknown placeholder {print} at character 6 (near \"awk '{print}' {bundle} {output\"); "
        "known: {bundle}, {mode}, {budget}, {output}, {batch}, {gpus}, {python}; "
        "for a brace the shell should see, write it twice ({{ or }})")
    assert engine_error({"command": "run {bundle} {output} }"}) == (
        "engines.bad.command",
        "stray '}' at character 23 (near 'run {bundle} {output} }'); "
        "for a brace the shell should see, write it twice ({{ or }})")
    assert engine_error({"command": "run {bundle} {output} {"}) == (
        "engines.bad.command",
        "stray '{' at character 23 (near 'run {bundle} {output} {'); "
        "for a brace the shell should see, write it twice ({{ or }})")
    assert engine_error({"command": "run {bundle!r} {output}"}) == (
        "engines.bad.command",
        "placeholder {bundle!r} at character 5 (near 'run {bundle!r} {output}') has a conversion or format "
        "spec; write {bundle}: values are shell-quoted strings")
    assert engine_error({"command": "run {bundle:>9} {output}"})[1].startswith("placeholder {bundle:>9} at ch")
    single = "must use {bundle} and {output} (or {bundle} and {batch}: several runs in one process)"
    assert engine_error({"command": "run {bundle}"}) == ("engines.bad.command", single)
    assert engine_error({"command": "run {output}"}) == ("engines.bad.command", single)
    assert engine_error({"command": "run {batch}"}) == (
        "engines.bad.command", "a batch command (one with {batch}) must use {bundle}")
    assert engine_error({"command": "run {bundle} {batch} --mode {mode} {output}"}) == (
        "engines.bad.command", "a batch command (one with {batch}) cannot use {mode}, {output}: each run's mode, "
        "budget and output are in the batch listing")


def test_escaped_braces_before_placeholders_are_skipped():
    engines = resolve_engines(engines_config(e={"command": "awk '{{print}}' {bundle} {output}"}), str(REPO))
    assert engines["e"]["command"] == "awk '{{print}}' {bundle} {output}"


def test_engine_models_and_sources_are_checked(tmp_path):
    assert engine_error({"command": CMD, "models": ["tiny", "huge"]}) == ("engines.bad.models", "unknown model 'huge'")
    assert engine_error({"command": CMD, "sources": ["src/k2vec/nothing_*.py"]}) == (
        "engines.bad.sources", "pattern 'src/k2vec/nothing_*.py' matches no file")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/a.py", "pkg/sub/b.py", "c.txt"):
        (tmp_path / name).write_text("x")
    entry = {"command": CMD, "sources": ["pkg/**", "pkg/a.py", str(tmp_path / "c.txt")]}
    e = resolve_engines(engines_config(e=entry), str(tmp_path))["e"]
    # relative to basedir, recursive, files only (not the directories), each once, sorted
    assert e["source_files"] == sorted(str(tmp_path / n) for n in ("pkg/a.py", "pkg/sub/b.py", "c.txt"))
    assert engine_error({"command": CMD, "sources": ["pkg"]}, str(tmp_path)) == (
        "engines.bad.sources", "pattern 'pkg' matches no file")


def test_sandbox_problem_is_a_config_error():
    engines = resolve_engines(engines_config(bad={"command": CMD, "sandbox": True}), str(REPO))
    with pytest.raises(ConfigError) as err:
        check_sandboxes(engines, lambda: "no user namespaces")
    assert (err.value.key, err.value.reason) == ("engines.bad.sandbox", "no user namespaces; or set sandbox: false")
    check_sandboxes(engines, lambda: None)   # a host that can sandbox
    assert engines["bad"]["sandbox"] is True

    def never_asked():
        raise AssertionError("the probe runs only when an engine wants the sandbox")
    check_sandboxes(resolve_engines(engines_config(e={"command": CMD, "sandbox": False}), str(REPO)), never_asked)


def test_engine_defaults_are_not_shared_between_engines():
    config = engines_config(off=None, a={"command": CMD}, b={"command": CMD})
    engines = resolve_engines(config, str(REPO), defined={"off"})
    assert sorted(engines) == ["a", "b"]   # a disabled engine listed first does not end the list
    engines["a"]["precisions"].append("fp8")
    engines["a"]["models"].append("huge")
    assert engines["b"]["precisions"] == ["fp32", "int4"] and engines["b"]["models"] == ["small", "tiny"]
    assert resolve_engines(config, str(REPO), defined={"off"})["a"]["precisions"] == ["fp32", "int4"]
    entry = {"command": CMD, "precisions": ["int4"]}
    resolve_engines(engines_config(e=entry), str(REPO))["e"]["precisions"].append("fp32")
    assert entry["precisions"] == ["int4"]


def test_engine_runs_list_exactly_the_enabled_modes():
    engines = resolve_engines(engines_config(
        skipped={"command": CMD}, score_only={"command": CMD, "modes": ["score"], "models": ["tiny"],
                                              "precisions": ["int4"]},
        ddtree_only={"command": CMD, "modes": ["ddtree"], "models": ["tiny"], "precisions": ["fp32"]}), str(REPO))
    assert engine_runs(engines, [1, 4], left_out=["skipped"]) == [
        ("score_only", "tiny", "int4", "score"),
        ("ddtree_only", "tiny", "fp32", "ddtree-b1"), ("ddtree_only", "tiny", "fp32", "ddtree-b4")]


def test_engines_short_of_gpus_and_missing_modules():
    engines = {"cpu": {"gpus": 0, "requires": []}, "one": {"gpus": 1, "requires": ["os", "no_such_module_k2"]},
               "two": {"gpus": 2, "requires": ["no_such_module_k2", "json", "no_such_module_k3"]}}
    assert engines_short_of_gpus(engines, 1) == ["two"]
    assert engines_short_of_gpus(engines, 0) == ["one", "two"]
    assert engines_missing_modules(engines) == {"one": ["no_such_module_k2"],
                                                "two": ["no_such_module_k2", "no_such_module_k3"]}
