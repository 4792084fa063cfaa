"""The Snakemake workflow as users drive it: bad configs, dry runs, lint, and honest reruns."""
import re
import shutil

import pytest

from conftest import REPO, copy_workflow, default_config, snakemake, write_config


def scheduled_jobs(stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run, as {rule: count} (empty when nothing is to be done)."""
    m = re.search(r"Job stats:\njob\s+count\n[- ]+\n(.*?)\ntotal", stdout, re.S)
    if not m:
        assert "Nothing to be done" in stdout, stdout[-2000:]
        return {}
    return {rule: int(n) for rule, n in (line.split() for line in m.group(1).strip().splitlines())}


def _set(path):
    def mutate(c):
        *keys, last = path[0].split(".")
        node = c
        for k in keys:
            node = node[k]
        node[last] = path[1]
    return mutate


BAD_CONFIGS = [
    # (description, mutation, key that the message must name)
    ("missing section", lambda c: c.pop("decoding"), "decoding"),
    ("unknown top-level key", lambda c: c.update(enignes={}), "enignes"),
    ("unknown model setting", _set(("models.tiny.hidden", 64)), "hidden"),
    ("wrong type", _set(("prompts.count", "four")), "prompts.count"),
    ("negative size", _set(("models.tiny.hidden_size", -128)), "models.tiny.hidden_size"),
    ("group size not dividing K", _set(("quantization.group_size", 128)), "quantization.group_size"),
    ("top-k above experts", _set(("models.tiny.num_experts_per_tok", 9)), "models.tiny.num_experts_per_tok"),
    ("preset typo", _set(("models.tiny.preset", "tinny")), "models.tiny.preset"),
    ("experts not divisible by n_group", _set(("models.small.n_group", 3)), "models.small.n_group"),
    ("one expert per group", _set(("models.tiny.n_group", 8)), "models.tiny.n_group"),
    ("dense layers beyond depth", _set(("models.tiny.first_k_dense_replace", 9)), "models.tiny.first_k_dense_replace"),
    ("odd rope dims", _set(("models.tiny.qk_rope_head_dim", 15)), "models.tiny.qk_rope_head_dim"),
    ("group size not allowed", _set(("quantization.group_size", 48)), "quantization.group_size"),
    ("prompt lengths reversed", _set(("prompts.min_length", 40)), "prompts.min_length"),
    ("invalid ignore regex", _set(("quantization.ignore", ["re:(unclosed"])), "quantization.ignore"),
    ("model name with a space", lambda c: c["models"].update({"my model": {"preset": "tiny"}}), "my model"),
]


@pytest.mark.parametrize("what, mutate, key", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_fails_before_any_job(what, mutate, key, tmp_path):
    config = default_config()
    mutate(config)
    cfg = write_config(tmp_path / "bad.yaml", config)
    res = snakemake("--cores", "1", "--directory", str(tmp_path), "--configfile", str(cfg),
                    "--replace-workflow-config", cwd=tmp_path)
    assert res.returncode != 0
    assert "Invalid configuration" in res.stderr, res.stderr[-1500:]
    assert key in res.stderr, res.stderr[-1500:]
    assert not (tmp_path / "results").exists()


def test_dry_run_prints_the_rule_chain(tmp_path):
    res = snakemake("-n", "--directory", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    jobs = scheduled_jobs(res.stdout)
    n_models = len(default_config()["models"])
    assert jobs["weights"] == n_models and jobs["case"] == n_models and jobs["case_section"] == 4 * n_models
    assert jobs["quantize"] == n_models and jobs["export_compressed_tensors"] == n_models
    assert not (tmp_path / "results").exists()


def test_lint_finds_nothing(tmp_path):
    res = snakemake("--lint", cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def built_workflow(tmp_path_factory):
    """A private copy of the workflow, run once to completion on a one-model config."""
    root = copy_workflow(tmp_path_factory.mktemp("wf"))
    config = default_config()
    config["models"] = {"tiny": config["models"]["tiny"]}
    for name in ("hf_fp32", "hf_bf16"):  # the transformers engine's runs are checked in test_pipeline.py
        del config["engines"][name]
    write_config(root / "config.yaml", config)
    env = {"PYTHONPATH": str(root / "src")}
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return root, env


def dry_run(root, env, *args):
    res = snakemake("-n", *args, snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return scheduled_jobs(res.stdout)


def test_complete_run_has_nothing_to_do(built_workflow):
    root, env = built_workflow
    assert dry_run(root, env) == {}
    assert (root / "results/models/tiny/fp32/config.json").exists()
    assert (root / "results/cases/tiny.json").exists()


def test_copied_checkout_with_its_results_reruns_nothing(built_workflow, tmp_path):
    # Before this run's first edit: the whole finished checkout, results/ and Snakemake's records
    # included, copied elsewhere (timestamps kept, as `cp -a` does).
    root, _ = built_workflow
    copy = tmp_path / "moved"
    shutil.copytree(root, copy, symlinks=True)
    assert dry_run(copy, {"PYTHONPATH": str(copy / "src")}) == {}
    assert (root / "results/models/tiny/int4/index.json").exists()
    for rule_log in ("results/logs/weights/tiny.log", "results/benchmarks/weights/tiny.tsv"):
        assert (root / rule_log).stat().st_size > 0


# Editing a package module schedules exactly the stages that run it, and what follows them.
# On the one-model test config: 2 precisions, 6 modes (greedy, 4 DDTree budgets, score) for the numpy
# engine, and the format-effect run (the int4 golden model forced on the fp32 golden).
AFTER_GOLDEN = {"bundle": 2, "engine_run": 12, "report": 1, "all": 1}
# The prompts stage reads both precisions' weights (it re-draws prompts near-tied under either).
AFTER_WEIGHTS = {"quantize": 1, "export_compressed_tensors": 1, "prompts": 1, "golden": 2, "format_effect": 1,
                 **AFTER_GOLDEN}
CODE_EDITS = [
    ("k2vec/weights.py", {"weights": 1, **AFTER_WEIGHTS}),
    ("k2vec/checkpoint.py", {"weights": 1, **AFTER_WEIGHTS}),
    ("k2vec/cases.py", {"case_section": 4, "case": 1, "weights": 1, **AFTER_WEIGHTS}),
    # Used from the quantize stage on only: the fp32 weights stay.
    ("k2vec/quant.py", AFTER_WEIGHTS),
    ("k2vec/int4_checkpoint.py", AFTER_WEIGHTS),
    # Parse-time only: the resolved content is unchanged, so nothing reruns.
    ("k2vec/spec.py", {}),
    # The reference model: golden data and what follows, and the numpy engine (it shares the math).
    ("k2vec/reference/model.py", {"prompts": 1, "golden": 2, "format_effect": 1, **AFTER_GOLDEN}),
    ("k2vec/bundle.py", AFTER_GOLDEN),
    # The numpy engine: its runs, and the format-effect run, which writes its results the same way.
    ("k2vec/engines/numpy_engine.py", {"engine_run": 12, "format_effect": 1, "report": 1, "all": 1}),
    # The report alone.
    ("k2vec/report/metrics.py", {"report": 1, "all": 1}),
]


@pytest.mark.parametrize("module, expected", CODE_EDITS, ids=[c[0] for c in CODE_EDITS])
def test_editing_a_module_reruns_its_stage_and_what_follows(built_workflow, module, expected):
    root, env = built_workflow
    path = root / "src" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n# an edit\n")
        assert dry_run(root, env) == expected
    finally:
        path.write_text(original)
    assert dry_run(root, env) == {}


def dry_run_with(root, env, tmp_path, override):
    """Dry run with `override` merged over the workflow's config.yaml (as users pass --configfile)."""
    return dry_run(root, env, "--configfile", str(write_config(tmp_path / "override.yaml", override)))


@pytest.mark.parametrize("change", [{"group_size": 64}, {"scheme": "k2-checkpoint"}, {"scale_dtype": "bfloat16"}])
def test_quantization_change_reruns_quantization_not_weights(built_workflow, tmp_path, change):
    root, env = built_workflow
    jobs = dry_run_with(root, env, tmp_path, {"quantization": change})
    # The fp32 weights stay. The prompts are re-checked against the new int4 weights (both goldens
    # share them), so both goldens and what follows rerun.
    after_quantize = {"quantize": 1, "export_compressed_tensors": 1, "prompts": 1, "golden": 2, "bundle": 2,
                      "engine_run": 12, "format_effect": 1, "report": 1, "all": 1}
    assert jobs == {"case_section": 1, "case": 1, **after_quantize}


def test_model_change_regenerates_weights(built_workflow, tmp_path):
    root, env = built_workflow
    jobs = dry_run_with(root, env, tmp_path, {"models": {"tiny": {"seed": 5}}})
    assert jobs["weights"] == 1


def test_readme_rule_graph_is_current():
    res = snakemake("--rulegraph", "mermaid-js", cwd=REPO)
    assert res.returncode == 0, res.stderr
    edges = lambda text: sorted(l.strip() for l in text.splitlines() if re.match(r"\s*id\d+(\[.*\]| --> id\d+)$", l))
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", readme, re.S).group(1)
    assert edges(block) == edges(res.stdout)


def test_report_plot_list_matches_the_package():
    from k2vec.report import OUTPUTS
    smk = (REPO / "workflow/rules/common.smk").read_text()
    listed = re.search(r"REPORT_PLOTS = (\[.*?\])", smk).group(1)
    assert sorted(eval(listed)) == sorted(v[:-4] for v in OUTPUTS.values() if v.endswith(".png"))


def test_overlay_config_disables_a_built_in_engine(built_workflow, tmp_path):
    root, env = built_workflow
    # `engines: {numpy: null}` in an overlay config (docs/engine-contract.md section 1): no numpy run
    # is scheduled or judged, only the report changes.
    assert dry_run_with(root, env, tmp_path, {"engines": {"numpy": None}}) == {"report": 1, "all": 1}
