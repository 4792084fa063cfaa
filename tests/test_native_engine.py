"""The native C++ engine (engines/native): built by the pipeline (the default run, conftest's `pipeline`) and by
hand, run on the four default bundles in every mode it implements, and judged `exact` by the report; under
AddressSanitizer + UBSan it runs them clean; a source edit reruns its build and runs only; without cmake or a C++
compiler it is left out."""
import os
import shutil
import subprocess
import time

import pytest

from conftest import REPO, default_config, snakemake, write_config
from test_workflow import scheduled_job_wildcards, scheduled_jobs

from k2vec.config.engines import engines_missing_commands, left_out_engines, resolve_engines
from k2vec.digests import write_record
from k2vec.report import build_report

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None
                                or not os.path.exists("/usr/include/nlohmann/json.hpp"),
                                reason="needs cmake, a C++ compiler and nlohmann-json3-dev")

ENGINE = default_config()["engines"]["native"]
ENGINE_MODES = ENGINE.get("modes", ["greedy", "ddtree", "score"])
MODES = [m for m in ("greedy", "score") if m in ENGINE_MODES] + (
    [f"ddtree-b{b}" for b in default_config()["decoding"]["ddtree"]["budgets"]] if "ddtree" in ENGINE_MODES else [])
CASES = [(m, p) for m in default_config()["models"] for p in ("fp32", "int4")]
NATIVE_RUNS = [f"results/runs/native/{m}-{p}-{mode}.json" for m, p in CASES for mode in MODES]


def build(dest, *options):
    subprocess.run(["cmake", "-S", str(REPO / "engines/native"), "-B", str(dest), "-DCMAKE_BUILD_TYPE=Release",
                    *options], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(dest), "--parallel", "2"], check=True, capture_output=True)
    return dest / "k2vec_native"


@pytest.fixture(scope="session")
def native_binary(tmp_path_factory):
    """The engine built by hand, as README says, once per session."""
    return build(tmp_path_factory.mktemp("native-build") / "build")


def judge(root, results, out_dir):
    """The report's rows for native results [(model, precision, mode, path)], against the run's goldens."""
    runs = [{"engine": "native", "model": m, "precision": p, "mode": mode, "result": str(path)}
            for m, p, mode, path in results]
    goldens = {(m, p): root / f"results/golden/{m}/{p}.kdtr" for m, p in CASES}
    return build_report(runs, goldens, out_dir).rows


def show(rows):
    cols = ["model", "precision", "mode", "prompt", "class", "logit_abs_max", "kl_mean", "fingerprint_rel_max"]
    print("\n" + rows[cols].to_string())


def test_pipeline_runs_of_the_native_engine_are_exact(pipeline, tmp_path, monkeypatch):
    root, _ = pipeline
    monkeypatch.chdir(root)  # where the report rule runs: the results name their bundles relative to it
    results = [(*rel.rsplit("/", 1)[1][:-5].split("-", 2), root / rel) for rel in NATIVE_RUNS]
    rows = judge(root, results, tmp_path / "report")
    show(rows)
    accuracies = len(default_config()["decoding"]["ddtree"]["accuracies"])
    expected = sum(4 * (accuracies if "ddtree" in rel else 1) for rel in NATIVE_RUNS)  # a row per prompt (x accuracy)
    assert len(rows) == expected and set(rows["status"]) == {"ok"}
    assert set(rows["class"]) == {"exact"}, rows[rows["class"] != "exact"].to_string()
    assert rows["logit_abs_max"].max() < 1e-4 and rows["kl_mean"].max() < 1e-11
    stamp = (root / "results/engines/native/build.stamp").read_text()
    assert "engines/native/src/model.cpp" in stamp and "include/kdtr.h" in stamp


@pytest.mark.slow   # the pipeline's own build and runs are judged exact in CI (above); this is README's route
def test_hand_built_engine_is_exact_in_every_mode(pipeline, native_binary, tmp_path):
    """README's by-hand route: build, run on a bundle, judge with the report's Python API."""
    root, _ = pipeline
    results = []
    for model, precision in CASES:
        for mode in MODES:
            kind, _, budget = mode.partition("-b")
            out = tmp_path / f"{model}-{precision}-{mode}.json"
            start = time.monotonic()
            subprocess.run([str(native_binary), "--bundle", str(root / f"results/bundles/{model}-{precision}.kdtr"),
                            "--mode", kind, "--budget", budget or "0", "--output", str(out)], check=True)
            print(f"{model}-{precision}-{mode}: {time.monotonic() - start:.2f} s")
            write_record(out)  # the runner's sha256 record, without which the report calls a result changed
            results.append((model, precision, mode, out))
    rows = judge(root, results, tmp_path / "report")
    assert set(rows["class"]) == {"exact"}, rows[rows["class"] != "exact"].to_string()


# The sanitizer run: in CI on the tiny bundles (the build is most of its time); every bundle with -m slow.
SANITIZED = [pytest.param(CASES[:2] if m == "tiny" else CASES, marks=[] if m == "tiny" else pytest.mark.slow,
                          id=f"{m}-bundles") for m in ("tiny", "every")]
assert [c[0] for c in CASES[:2]] == ["tiny", "tiny"]


@pytest.mark.parametrize("cases", SANITIZED)
def test_sanitized_build_runs_the_default_bundles_clean(pipeline, tmp_path, cases):
    """-DK2VEC_SANITIZE=ON: AddressSanitizer + UndefinedBehaviorSanitizer, any finding fatal. DDTree at budget 4
    only (tree masks, node positions and KV compaction all happen there; larger trees only cost time)."""
    root, _ = pipeline
    # -O1 with assertions kept, as the sanitizers' documentation advises: the runs take a third of their unoptimised
    # time for a longer build, the whole test less (bench/RESULTS.md, session 25)
    binary = build(tmp_path / "asan", "-DK2VEC_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug",
                   "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g")
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1"}
    for model, precision in cases:
        for mode in [m for m in MODES if not m.startswith("ddtree") or m == "ddtree-b4"]:
            kind, _, budget = mode.partition("-b")
            out = tmp_path / f"{model}-{precision}-{mode}.json"
            res = subprocess.run([str(binary), "--bundle", str(root / f"results/bundles/{model}-{precision}.kdtr"),
                                  "--mode", kind, "--budget", budget or "0", "--output", str(out)],
                                 capture_output=True, text=True, env=env)
            assert res.returncode == 0 and "runtime error" not in res.stderr, (model, precision, mode, res.stderr)
            assert out.stat().st_size > 0


def test_source_edit_reruns_only_the_native_build_and_runs(pipeline):
    root, env = pipeline
    source = root / "engines/native/src/model.cpp"
    original = source.read_text()
    try:
        source.write_text(original + "\n// an edit\n")
        res = snakemake("-n", snakefile=root / "Snakefile", cwd=root, env=env)   # plain, as a user runs it
    finally:
        source.write_text(original)
    assert res.returncode == 0, res.stderr[-3000:]
    assert scheduled_jobs(res.stdout) == {"engine_build": 1, "engine_run": len(NATIVE_RUNS), "report": 1, "all": 1}
    assert {w.get("engine") for rule, w in scheduled_job_wildcards(res.stdout) if rule == "engine_run"} == {"native"}


def test_missing_commands_leave_the_engine_out(tmp_path):
    cfg = default_config()
    cfg["engines"]["native"]["requires_commands"] = ["cmake", "k2vec_no_such_command"]
    engines = resolve_engines(cfg, str(REPO))
    missing = engines_missing_commands(engines)
    assert missing == {"native": ["k2vec_no_such_command"]}
    why = left_out_engines(cfg["engines"], [], 0, {}, "python", missing)
    assert why == {"native": "command(s) missing: k2vec_no_such_command not on PATH "
                              "(engines.native.requires_commands)"}
    assert_left_out(tmp_path, cfg, "k2vec: no run of engine(s) native: command(s) missing: k2vec_no_such_command")


def test_a_failing_requires_check_leaves_the_engine_out(tmp_path):
    """The native engine's check that the JSON library's headers are there (its build needs them): where it
    fails the engine is left out, named with the check, instead of a build failure stopping the pipeline."""
    cfg = default_config()
    assert failing_checks(cfg) == {}   # the default check passes where the tests run (the module's skipif)
    cfg["engines"]["native"]["requires_check"] = cfg["engines"]["native"]["requires_check"].replace(
        "nlohmann/json.hpp", "nlohmann/k2vec_no_such_header.hpp")
    why = failing_checks(cfg)["native"]
    assert why.startswith("\"printf '#if !__has_include(<nlohmann/k2vec_no_such_header.hpp>)") and \
        why.endswith("failed (exit code 1: <stdin>:2:2: error: "
                     "#error nlohmann/k2vec_no_such_header.hpp not found)"), why
    assert_left_out(tmp_path, cfg, "k2vec: no run of engine native: \"printf '#if !__has_include(<nlohmann/k2vec_no")


def assert_left_out(tmp_path, cfg, notice):
    """A dry run with `cfg`: the notice once on stderr, and no build or run of the native engine scheduled."""
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(write_config(tmp_path / "c.yaml", cfg)),
                    cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count(notice) == 1, res.stderr[-2000:]
    assert "results/runs/native/" not in res.stdout and "engine_build" not in scheduled_jobs(res.stdout)


def failing_checks(cfg):
    from k2vec.config.engines import engines_failing_checks

    return engines_failing_checks(resolve_engines(cfg, str(REPO)))
