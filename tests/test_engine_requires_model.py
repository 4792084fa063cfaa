"""`engines.<name>.requires_model`: an engine that cannot run some model (vLLM's MLA and the latent widths it takes)
gets no run there, and says so, naming the engine, the model and the values that fail; a bad expression is a
config error naming the key."""
from dataclasses import dataclass

import pytest

from conftest import REPO, default_config, snakemake, write_config
from test_workflow import scheduled_job_wildcards

from k2vec.config.engines import engine_runs, engines_off_models, left_out_on_models, resolve_engines
from k2vec.config.expand import resolve_model
from k2vec.errors import ConfigError

FAKE = REPO / "tests" / "engines" / "fake_engine.py"


def resolved(cfg):
    return {m: resolve_model(m, entry) for m, entry in cfg["models"].items()}


def fake_entry(requires_model):
    return {"command": f"{{python}} {FAKE} ok /nonexistent --bundle {{bundle}} --mode {{mode}} --budget {{budget}} "
                       f"--output {{output}}", "sources": [str(FAKE)], "modes": ["greedy"],
            "requires_model": requires_model}


def test_vllm_runs_on_tiny_and_is_named_off_small():
    cfg = default_config()
    engines = resolve_engines(cfg, str(REPO))
    off = engines_off_models(engines, resolved(cfg))
    assert off == {"vllm": {"small": "requires_model 'kv_lora_rank + qk_rope_head_dim in (320, 512, 576)' is false "
                                     "(kv_lora_rank 64, qk_rope_head_dim 16)"}}
    assert left_out_on_models(off, engines) == {
        "vllm on small": off["vllm"]["small"] + " (engines.vllm.requires_model)"}
    runs = engine_runs(engines, cfg["decoding"]["ddtree"]["budgets"], off_models=off)
    assert {(m, p, mode) for e, m, p, mode in runs if e == "vllm"} == {
        ("tiny", p, mode) for p in ("fp32", "int4") for mode in ("greedy", "score")}
    assert {m for e, m, _, _ in runs if e == "numpy"} == {"tiny", "small"}   # no requires_model: every model


def test_an_engine_off_every_model_is_left_out_by_name():
    cfg = default_config()
    cfg["engines"] = {"fake": fake_entry("hidden_size > 4096")}
    engines = resolve_engines(cfg, str(REPO))
    off = engines_off_models(engines, resolved(cfg))
    assert set(off["fake"]) == {"tiny", "small"}
    (name, why), = left_out_on_models(off, engines).items()
    assert name == "fake" and why.startswith("no model it can run on: small: requires_model 'hidden_size > 4096' "
                                             "is false (hidden_size 256); tiny: "), why
    assert engine_runs(engines, [1], off_models=off) == []


@dataclass(frozen=True)
class Bad:
    name: str
    expression: str
    says: str


BAD = [
    Bad("syntax", "kv_lora_rank +", "not a Python expression: invalid syntax in 'kv_lora_rank +'"),
    Bad("unknown setting", "kv_lora_width > 0", "name 'kv_lora_width' is not defined: the expression may name"),
    Bad("no builtins", "len(str(hidden_size)) > 1", "name 'len' is not defined"),
    Bad("fails on a model", "hidden_size / (n_group - 2) > 0", "ZeroDivisionError: division by zero on model 'tiny'"),
]


@pytest.mark.parametrize("case", BAD, ids=[c.name for c in BAD])
def test_a_bad_expression_names_the_key(case):
    cfg = default_config()
    cfg["engines"] = {"fake": fake_entry(case.expression)}
    with pytest.raises(ConfigError) as err:
        engines_off_models(resolve_engines(cfg, str(REPO)), resolved(cfg))
    assert str(err.value).startswith(f"config key 'engines.fake.requires_model': {case.says}"), str(err.value)


def test_dry_run_leaves_the_engine_off_the_model_with_one_notice(tmp_path):
    cfg = default_config()
    cfg["engines"] = {"numpy": cfg["engines"]["numpy"], "fake": fake_entry("hidden_size > 128")}
    path = write_config(tmp_path / "c.yaml", cfg)
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(path), "--replace-workflow-config",
                    cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    notice = [line for line in res.stderr.splitlines() if "requires_model" in line]
    assert notice == ["k2vec: no run of engine fake on model(s) tiny: requires_model 'hidden_size > 128' is false "
                      "(hidden_size 128) (engines.fake.requires_model)"], res.stderr[-2000:]
    runs = [w for rule, w in scheduled_job_wildcards(res.stdout) if rule == "engine_run"]
    assert {(w["engine"], w["model"]) for w in runs} == {("fake", "small")}, runs
