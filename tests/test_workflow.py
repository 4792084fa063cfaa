"""The Snakemake workflow as users drive it: bad configs, dry runs, lint, and honest reruns."""
import os
import re
import shutil
import time

import pandas as pd
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
    ("run time limit 1e308", _set(("engines.numpy.timeout_s", 1e308)), "engines.numpy.timeout_s"),
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
    # the transformers engine's runs are checked in test_pipeline.py, the native engine's in test_native_engine.py,
    # the llama.cpp and vLLM engines' in test_llama_cpp_engine.py and test_vllm_engine.py
    for name in ("hf_fp32", "hf_bf16", "native", "llama_cpp", "vllm"):
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


# Editing a package module's code schedules exactly the stages that run it, and what follows them.
# On the one-model test config: 2 precisions, 6 modes (greedy, 4 DDTree budgets, score) for the numpy
# engine, and the format-effect run (the int4 golden model forced on the fp32 golden).
AFTER_GOLDEN = {"bundle": 2, "engine_batch_numpy": 2, "report": 1, "all": 1}
# The int4 side of one model: its quantization, prompts (re-checked under int4), golden, its convention variant,
# bundle and 6 numpy runs (one batch job), and the format effect.
INT4_SIDE = {"quantize": 1, "export_compressed_tensors": 1, "prompts": 1, "golden": 1, "convention": 1, "bundle": 1,
             "engine_batch_numpy": 1, "format_effect": 1, "report": 1, "all": 1}
# The prompts stage runs per precision (each re-draws prompts near-tied under its own weights); each golden's
# convention variant follows it.
AFTER_WEIGHTS = {"quantize": 1, "export_compressed_tensors": 1, "prompts": 2, "golden": 2, "convention": 2,
                 "format_effect": 1, **AFTER_GOLDEN}
CODE_EDITS = [
    ("k2vec/stages/weights.py", {"weights": 1, **AFTER_WEIGHTS}),
    ("k2vec/model/checkpoint.py", {"weights": 1, **AFTER_WEIGHTS}),
    ("k2vec/config/cases.py", {"case_section": 4, "case": 1, "weights": 1, **AFTER_WEIGHTS}),
    # Run by the int4 side only: the fp32 weights, golden, bundle and engine runs stay.
    ("k2vec/model/int4.py", INT4_SIDE),
    ("k2vec/model/int4_checkpoint.py", INT4_SIDE),
    # Parse-time only: the resolved content is unchanged, so nothing reruns.
    ("k2vec/config/expand.py", {}),
    # The reference model: golden data and what follows, and the numpy engine (it shares the math).
    ("k2vec/reference/model.py", {"prompts": 2, "golden": 2, "convention": 2, "format_effect": 1, **AFTER_GOLDEN}),
    ("k2vec/stages/bundle.py", AFTER_GOLDEN),
    # The numpy engine: its runs and the report (test_numpy_engine_code_change_reruns_only_its_runs).
    ("k2vec/engines/numpy_engine.py", {"engine_batch_numpy": 2, "report": 1, "all": 1}),
    # The report alone.
    ("k2vec/report/metrics.py", {"report": 1, "all": 1}),
    # A stage script: that stage and what follows.
    ("../workflow/scripts/bundle.py", AFTER_GOLDEN),
]


@pytest.mark.parametrize("module, expected", CODE_EDITS, ids=[c[0] for c in CODE_EDITS])
def test_editing_a_module_reruns_its_stage_and_what_follows(built_workflow, module, expected):
    root, env = built_workflow
    path = root / "src" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n_AN_EDIT = 1\n")  # code, not a comment: it changes the module
        assert dry_run(root, env) == expected
    finally:
        path.write_text(original)
    assert dry_run(root, env) == {}


def scheduled_job_wildcards(stdout: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, wildcards) of every job a dry run lists."""
    jobs = []
    for rule, body in re.findall(r"^(?:local)?rule (\w+):\n(.*?)(?=\n\n|\n\[|\Z)", stdout, re.S | re.M):
        m = re.search(r"^\s+wildcards: (.*)$", body, re.M)
        jobs.append((rule, dict(kv.split("=", 1) for kv in m.group(1).split(", ")) if m else {}))
    return jobs


def dry_run_after_code_edit(built_workflow, module: str):
    """A dry run of the built workflow after a real code change (a new function) in `module`, which is
    restored afterwards."""
    root, env = built_workflow
    path = root / module
    original = path.read_text()
    try:
        path.write_text(original + "\n\ndef _new_helper(x):\n    return x + 1\n")
        res = snakemake("-n", snakefile=root / "Snakefile", cwd=root, env=env)
    finally:
        path.write_text(original)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_quantizer_code_change_schedules_nothing_on_the_fp32_side(built_workflow):
    res = dry_run_after_code_edit(built_workflow, "src/k2vec/model/int4.py")
    jobs = scheduled_job_wildcards(res.stdout)
    by_rule = {}
    for rule, wildcards in jobs:
        by_rule.setdefault(rule, []).append(wildcards)
    assert sum(len(v) for v in by_rule.values()) == sum(scheduled_jobs(res.stdout).values())  # all parsed
    for rule in ("prompts", "golden", "convention", "bundle", "engine_batch_numpy"):
        assert by_rule[rule] and all(w["precision"] == "int4" for w in by_rule[rule]), (rule, by_rule[rule])
    assert "weights" not in by_rule


def test_numpy_engine_code_change_reruns_only_its_runs(built_workflow):
    """A code edit in the numpy engine schedules its engine runs, every one of them, and the report:
    no stage that makes data (the format-effect run writes its result through the contract's
    serializer, k2vec.engines.contract.serialize, not the engine's) and no other engine's run."""
    root, _ = built_workflow
    res = dry_run_after_code_edit(built_workflow, "src/k2vec/engines/numpy_engine.py")
    jobs = scheduled_job_wildcards(res.stdout)
    assert len(jobs) == sum(scheduled_jobs(res.stdout).values())  # every job parsed
    assert sorted({rule for rule, _ in jobs}) == ["all", "engine_batch_numpy", "report"], scheduled_jobs(res.stdout)
    assert [rule for rule, _ in jobs].count("report") == 1
    # one batch job per bundle: every mode of it in one process
    bundles = sorted((w["model"], w["precision"]) for rule, w in jobs if rule == "engine_batch_numpy")
    # exactly the bundles of the numpy engine's finished runs: both precisions, every mode
    finished = [tuple(p.stem.split("-", 2)) for p in (root / "results/runs/numpy").glob("*.json")]
    assert len(finished) == 12 and bundles == sorted({f[:2] for f in finished}), bundles
    outputs = [o for line in re.findall(r"^\s+output: (.*)$", res.stdout, re.M) for o in line.split(", ")
               if o.startswith("results/runs/numpy/")]
    assert sorted(outputs) == sorted(f"results/runs/numpy/{'-'.join(f)}.json" for f in finished), outputs


def test_comment_edit_upstream_reruns_nothing(built_workflow):
    """A comment and a docstring edit in the weight generator: no job runs; the whole rerun is one
    Snakemake start (bench/RESULTS.md records the time)."""
    root, env = built_workflow
    path = root / "src/k2vec/stages/weights.py"
    original = path.read_text()
    edited = original.replace('"""', '"""Edited docstring. ', 1) + "\n# a new comment\n"
    try:
        path.write_text(edited)
        start = time.monotonic()
        res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env)
        elapsed = time.monotonic() - start
    finally:
        path.write_text(original)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Nothing to be done" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    assert "Finished jobid" not in res.stdout + res.stderr
    print(f"comment edit in k2vec/stages/weights.py: no job ran, whole rerun {elapsed:.1f} s")
    assert elapsed < 30


def test_byte_identical_rerun_does_not_cascade(built_workflow):
    """No early cutoff within one invocation, but on the next one: a forced golden rerun writes the
    same bytes, and its readers (bundle, format effect) compare checksums (profile max-checksum-file-size)."""
    root, env = built_workflow
    golden = root / "results/golden/tiny/fp32.kdtr"
    before = golden.read_bytes(), golden.stat().st_mtime_ns
    res = snakemake("--cores", "1", "--force", str(golden.relative_to(root)), snakefile=root / "Snakefile",
                    cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert golden.read_bytes() == before[0] and golden.stat().st_mtime_ns > before[1]
    assert dry_run(root, env) == {}


def dry_run_with(root, env, tmp_path, override):
    """Dry run with `override` merged over the workflow's config.yaml (as users pass --configfile)."""
    return dry_run(root, env, "--configfile", str(write_config(tmp_path / "override.yaml", override)))


@pytest.mark.parametrize("change", [{"group_size": 64}, {"scheme": "k2-checkpoint"}, {"scale_dtype": "bfloat16"}])
def test_quantization_change_reruns_quantization_not_weights(built_workflow, tmp_path, change):
    root, env = built_workflow
    jobs = dry_run_with(root, env, tmp_path, {"quantization": change})
    # The fp32 side stays: weights, prompts, golden, bundle and runs. The int4 prompts are re-checked
    # against the new int4 weights, and the int4 side reruns from there.
    after_quantize = {"quantize": 1, "export_compressed_tensors": 1, "prompts": 1, "golden": 1, "convention": 1,
                      "bundle": 1, "engine_batch_numpy": 1, "format_effect": 1, "report": 1, "all": 1}
    assert jobs == {"case_section": 1, "case": 1, **after_quantize}


def test_model_change_regenerates_weights(built_workflow, tmp_path):
    root, env = built_workflow
    jobs = dry_run_with(root, env, tmp_path, {"models": {"tiny": {"seed": 5}}})
    assert jobs["weights"] == 1


def test_readme_rule_graph_is_current():
    res = snakemake("--rulegraph", "mermaid-js", cwd=REPO)
    assert res.returncode == 0, res.stderr
    def edges(text):
        return sorted(x.strip() for x in text.splitlines() if re.match(r"\s*id\d+(\[.*\]| --> id\d+)$", x))
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", readme, re.S).group(1)
    assert edges(block) == edges(res.stdout)


def test_readme_says_where_the_summary_is_when_nothing_ran():
    # Snakemake calls `onsuccess` (which prints the summary) only when jobs ran: README points to the file.
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "a run with nothing to do prints none: the summary is always in `results/report/summary.txt`" in readme
    assert 'summary="results/report/summary.txt"' in (REPO / "workflow/rules/report.smk").read_text()


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


def test_overlay_disabling_an_unknown_engine_is_refused(tmp_path):
    # A typo when disabling an engine would otherwise be a silent no-op, numpy still running.
    cfg = write_config(tmp_path / "overlay.yaml", {"engines": {"nmpy": None}})
    res = snakemake("--cores", "1", "--directory", str(tmp_path), "--configfile", str(cfg), cwd=tmp_path)
    assert res.returncode != 0
    assert "Invalid configuration" in res.stderr and "engines.nmpy" in res.stderr, res.stderr[-1500:]
    assert ("known engines: gpu_bf16, gpu_fp32, hf_bf16, hf_fp32, llama_cpp, native, numpy, vllm"
            in res.stderr), res.stderr[-1500:]
    assert not (tmp_path / "results").exists()


@pytest.fixture
def built_copy(built_workflow, tmp_path):
    """A private copy of the built workflow, results/ and Snakemake's records included, to run in."""
    copy = tmp_path / "copy"
    shutil.copytree(built_workflow[0], copy, symlinks=True)
    return copy, {"PYTHONPATH": str(copy / "src")}


def test_deleted_files_are_rebuilt_by_a_plain_run(built_copy):
    """README: "to rebuild a damaged file, delete it and rerun". Every stage's output is a target, so a
    plain `snakemake` rebuilds a deleted result, golden and bundle (an up-to-date report used to hide
    them: "Nothing to be done"), byte for byte, and prints the rebuilt report's summary."""
    root, env = built_copy
    deleted = ["results/runs/numpy/tiny-fp32-greedy.json", "results/golden/tiny/int4.kdtr",
               "results/bundles/tiny-fp32.kdtr"]
    before = {f: (root / f).read_bytes() for f in deleted}
    for f in deleted:
        (root / f).unlink()
    jobs = dry_run(root, env)
    assert {"engine_batch_numpy", "golden", "bundle", "report"} <= set(jobs), jobs
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    for f in ("results/golden/tiny/int4.kdtr", "results/bundles/tiny-fp32.kdtr"):
        assert (root / f).read_bytes() == before[f], f
    assert (root / deleted[0]).exists()
    assert "k2vec divergence report:" in res.stdout, res.stdout[-2000:]
    assert dry_run(root, env) == {}


def test_a_targeted_run_does_not_print_a_stale_summary(built_copy):
    root, env = built_copy
    target = "results/runs/numpy/tiny-int4-greedy.json"
    res = snakemake("--cores", "1", "--force", target, snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "k2vec divergence report:" not in res.stdout
    assert "this run did not rebuild the report; the last summary, results/report/summary.txt, predates it" \
        in res.stdout, res.stdout[-2000:]


def test_visible_gpus_reschedule_no_finished_run(built_copy):
    """Which devices are visible is no input of a result (the one used is recorded in it): restricting
    or widening them adds the GPU engines' runs where a pool appears, and reruns no CPU engine's run."""
    root, env = built_copy
    scheduled = {}
    for visible in ("0", "0,1"):
        res = snakemake("-n", snakefile=root / "Snakefile", cwd=root, env={**env, "CUDA_VISIBLE_DEVICES": visible})
        assert res.returncode == 0, res.stderr[-3000:]
        runs = [(rule, w) for rule, w in scheduled_job_wildcards(res.stdout) if rule.startswith("engine_")]
        assert runs and {rule for rule, _ in runs} == {"engine_batch_gpu_fp32", "engine_batch_gpu_bf16"}, runs
        scheduled[visible] = sorted((rule, *w.values()) for rule, w in runs)
    assert scheduled["0"] == scheduled["0,1"]


def test_gpu_engine_without_its_packages_is_left_out_and_named(built_copy, tmp_path):
    """A GPU node (fake nvidia-smi, 2 GPUs) whose environment lacks torch and triton (the [gpu] extra):
    the GPU engines get no run and no failed row, one notice, and the report names them with the reason."""
    from conftest import fake_nvidia_smi

    root, env = built_copy
    env = {"PYTHONPATH": f"{root / 'src'}:{REPO / 'tests/support/hide_modules'}", "K2VEC_HIDE_MODULES": "torch,triton",
           "PATH": f"{fake_nvidia_smi(tmp_path / 'bin', 2)}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": None}
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "k2vec: no run of engine(s) gpu_fp32, gpu_bf16: torch, triton not importable" in res.stderr
    assert "k2vec: no run of GPU engine" not in res.stderr   # the pool has 2 devices
    assert not (root / "results/runs/gpu_fp32").exists() and not (root / "results/runs/gpu_bf16").exists()
    rows = pd.read_csv(root / "results/report/divergence.csv")
    assert set(rows["engine"]) == {"numpy"} and set(rows["class"]) == {"exact"}
    summary = (root / "results/report/summary.txt").read_text()
    for name in ("gpu_fp32", "gpu_bf16"):
        assert f"LEFT OUT: {name}: package(s) missing: torch, triton not importable by" in summary, summary
    assert "OK for the 1 engine that ran: no real divergence, no over-budget row, no failed run; " \
           "2 configured engines left out: gpu_bf16, gpu_fp32" in summary
    engines = pd.read_csv(root / "results/report/engines.csv", keep_default_na=False)
    assert dict(zip(engines["engine"], engines["status"])) == {"gpu_bf16": "left out", "gpu_fp32": "left out",
                                                               "numpy": "ran"}
