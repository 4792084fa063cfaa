"""The whole pipeline on the default config: golden properties, bundles, the numpy engine, GPU slots,
failure isolation and engine-edit reruns. One run of the default config is shared by every test (the
session's `pipeline` fixture, tests/conftest.py)."""
import glob
import hashlib
import itertools
import json
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from k2vec.kdtr import open_bundle
from k2vec.report.gate import FAILING_CLASSES, check_strict
from conftest import REPO, copy_workflow, default_config, snakemake, write_config
from test_workflow import scheduled_jobs

FAKE = REPO / "tests" / "engines" / "fake_engine.py"


def golden(root, model, precision):
    return open_bundle(root / f"results/golden/{model}/{precision}.kdtr")


def cases():
    cfg = default_config()
    return [(m, p) for m in cfg["models"] for p in ("fp32", "int4")]


# -------------------------------------------------------------------------------- golden data

@pytest.mark.parametrize("model, precision", cases())
def test_greedy_is_decisive(pipeline, model, precision):
    # From the margins themselves, not the golden's summary of them (which must agree).
    g = golden(pipeline[0], model, precision)
    margins = np.concatenate([g[f"golden.p{i}.margins"] for i in range(g.metadata["prompts"])])
    near_tie = float((margins < 1e-3).mean())   # top-1/top-2 logit gap under 1e-3: a near-tie
    assert margins.size == 4 * 24 and (margins >= 0).all()
    assert near_tie < 0.02, near_tie
    s = g.metadata["summary"]
    assert (s["steps"], s["near_tie_fraction"]) == (margins.size, near_tie)


@pytest.mark.parametrize("model, precision", cases())
def test_ddtree_lossless_and_acceptance_rises(pipeline, model, precision):
    g = golden(pipeline[0], model, precision)
    s = g.metadata["summary"]
    dd = g.metadata["ddtree"]
    # Lossless: DDTree emits the greedy tokens, except after a step whose margin is under 1e-5;
    # compared here token by token, not through the golden's own list of mismatches (which must agree).
    found = []
    for b, a_i, i in itertools.product(dd["budgets"], range(len(dd["accuracies"])), range(g.metadata["prompts"])):
        greedy, tree = g[f"golden.p{i}.tokens"], g[f"ddtree.b{b}.a{a_i}.p{i}.tokens"]
        assert tree.shape == greedy.shape
        diff = np.flatnonzero(tree != greedy)
        if diff.size:
            margin = float(g[f"golden.p{i}.margins"][diff[0]])
            assert margin < 1e-5, (b, dd["accuracies"][a_i], i, int(diff[0]), margin)
            found.append((i, b, dd["accuracies"][a_i], int(diff[0])))
    assert sorted(found) == sorted((m["prompt"], m["budget"], m["accuracy"], m["step"]) for m in s["ddtree_mismatches"])
    acc = s["ddtree_mean_acceptance"]
    budgets = sorted(acc, key=int)
    accuracies = sorted(acc[budgets[0]], key=float)
    table = np.array([[acc[b][a] for a in accuracies] for b in budgets])
    print(f"\n{model}/{precision} mean acceptance (rows: budgets {budgets}, cols: accuracies {accuracies})\n{table}")
    # Rises with budget. A larger tree accepts at least as much in a round from the same start, but
    # later rounds start elsewhere, so on 4 prompts a mean may dip a little (3.52 -> 3.39, tiny fp32).
    assert (np.diff(table, axis=0) >= -0.05 * table[1:]).all() and (table[-1] > table[0]).all()
    assert (np.diff(table, axis=1) > 0).all()  # rises with drafter accuracy


def test_quantization_changes_small_model_tokens(pipeline):
    a, b = golden(pipeline[0], "small", "fp32"), golden(pipeline[0], "small", "int4")
    assert any(not np.array_equal(a[f"golden.p{i}.tokens"], b[f"golden.p{i}.tokens"]) for i in range(4))


def test_disk_estimate_bounds_the_run_within_twice(pipeline):
    """check_config's disk estimate, from the runs the default config made, is an upper bound of the bytes under
    results/ and at most 2x of them; its file count bounds the files."""
    from k2vec.config.expand import resolve_model
    from k2vec.config.resources import output_disk, output_files

    root, _ = pipeline
    config = default_config()
    estimate = files = 0
    for name, entry in config["models"].items():
        modes = [p.name[len(name) + 1:-len(".json")].split("-", 1)[1]
                 for p in (root / "results/runs").glob(f"*/{name}-*.json")]
        assert modes, name
        m = resolve_model(name, entry)
        estimate += output_disk(m, config, modes).amount
        files += output_files(m, config, len(modes)).amount
    written = [p.stat().st_size for p in (root / "results").rglob("*") if p.is_file()]
    assert sum(written) <= estimate <= 2 * sum(written), (sum(written), estimate)
    assert len(written) <= files, (len(written), files)


# Single-run forms of the batch engines: the same engine, one process per run.
SINGLE_RUN = {
    "numpy": "OPENBLAS_NUM_THREADS=1 {python} -m k2vec.engines.numpy_engine --bundle {bundle} --mode {mode} "
             "--budget {budget} --output {output}",
    "hf_fp32": "OMP_NUM_THREADS=1 {python} -m k2vec.engines.hf --dtype float32 --gpus {gpus} --bundle {bundle} "
               "--mode {mode} --budget {budget} --output {output}",
}


@pytest.mark.parametrize("engine", [e if e == "numpy" else pytest.param(e, marks=pytest.mark.slow) for e in SINGLE_RUN])
def test_batch_results_equal_single_run_results(pipeline, tmp_path, engine):
    """The default run's batch engine (every mode of a bundle in one process) and the same engine run once per
    run write the same results, byte for byte, but for the command and the clock."""
    root, env = pipeline
    config = default_config()
    single = f"{engine}_single"
    config["engines"] = {single: {**config["engines"][engine], "command": SINGLE_RUN[engine]}}
    overlay = write_config(tmp_path / "single.yaml", {"engines": config["engines"]})
    batch = sorted((root / "results/runs" / engine).glob("*.json"))
    assert batch
    targets = [f"results/runs/{single}/{p.name}" for p in batch]
    res = snakemake(*targets, "--cores", "2", "--configfile", str(overlay), snakefile=root / "Snakefile", cwd=root,
                    env=env, timeout=900)   # targets first: --configfile takes every argument after it
    assert res.returncode == 0, res.stderr[-3000:]
    assert "engine_batch" not in res.stdout and f"engine_batch_{engine}" not in res.stderr
    clock = {"engine", "command", "started_at", "ended_at", "wall_s", "timing", "scratch_kept"}
    for p in batch:
        a, b = (json.loads(q.read_text()) for q in (p, root / "results/runs" / single / p.name))
        assert a["status"] == b["status"] == "ok", p.name
        assert "--batch" in a["command"] and "--mode" in b["command"]
        assert {k: v for k, v in a.items() if k not in clock} == {k: v for k, v in b.items() if k not in clock}, p.name
    shutil.rmtree(root / "results/runs" / single)   # later tests count the default run's engines


def test_numpy_batch_decodes_its_ddtree_runs_together_and_an_error_fails_only_its_run(pipeline, tmp_path, monkeypatch):
    """The numpy engine's batch verifies its DDTree runs in one lockstep pass; when that pass raises, the runs are
    decoded one by one, so the runs before the one at fault keep their results and the error names its run."""
    from k2vec.engines import numpy_engine
    from k2vec.engines.contract.modes import BATCH_FORMAT
    from k2vec.errors import K2VecError

    root, _ = pipeline
    bundle = root / "results/bundles/tiny-fp32.kdtr"
    want = {p.name: json.loads(p.read_text())["runs"] for p in (root / "results/runs/numpy").glob("tiny-fp32-*.json")}
    runs = [("greedy", 0), ("ddtree", 4), ("ddtree", 64), ("ddtree", 16), ("score", 0)]
    listing = tmp_path / "listing.json"
    listing.write_text(json.dumps({"format": BATCH_FORMAT, "version": 1, "bundle": str(bundle), "runs": [
        {"mode": m, "budget": b, "output": str(tmp_path / f"tiny-fp32-{m}{f'-b{b}' if b else ''}.json")}
        for m, b in runs]}))   # the pipeline's result names
    passes = []
    generate = numpy_engine.ddtree_generate

    def counted(model, jobs, n):
        passes.append(sorted({j.budget for j in jobs}))
        return generate(model, jobs, n)

    monkeypatch.setattr(numpy_engine, "ddtree_generate", counted)
    assert numpy_engine.main(["--bundle", str(bundle), "--batch", str(listing)]) == 0
    assert passes == [[4, 16, 64]]
    for m, b in runs:
        name = f"tiny-fp32-{m}{f'-b{b}' if b else ''}.json"
        got = json.loads((tmp_path / name).read_text())
        assert got["runs"] == want[name], name

    def failing_at_64(model, jobs, n):
        if any(j.budget == 64 for j in jobs):
            raise K2VecError("budget 64 fails")
        return generate(model, jobs, n)

    for p in tmp_path.glob("tiny-fp32-*.json"):
        p.unlink()
    monkeypatch.setattr(numpy_engine, "ddtree_generate", failing_at_64)
    with pytest.raises(K2VecError, match="budget 64 fails"):
        numpy_engine.main(["--bundle", str(bundle), "--batch", str(listing)])
    written = sorted(p.name for p in tmp_path.glob("tiny-fp32-*.json"))
    assert written == ["tiny-fp32-ddtree-b4.json", "tiny-fp32-greedy.json"]
    assert json.loads((tmp_path / "tiny-fp32-ddtree-b4.json").read_text())["runs"] == want["tiny-fp32-ddtree-b4.json"]


# ------------------------------------------------------------------------------------- bundles

def test_bundles_byte_identical_across_runs(pipeline, tmp_path):
    root, env = pipeline
    other = copy_workflow(tmp_path)
    targets = [f"results/bundles/{m}-{p}.kdtr" for m, p in cases()]
    res = snakemake("--cores", "2", *targets, snakefile=other / "Snakefile", cwd=other,
                    env={"PYTHONPATH": str(other / "src")}, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    for t in targets:
        digest = [hashlib.sha256((d / t).read_bytes()).hexdigest() for d in (root, other)]
        assert digest[0] == digest[1], t


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_c_listing_equals_python_listing(pipeline, tmp_path):
    tool = tmp_path / "kdtr_tool"
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
                    f"-I{REPO / 'include'}", str(REPO / "tools/kdtr_tool.c"), "-o", str(tool)], check=True)
    for path in sorted(glob.glob(str(pipeline[0] / "results/bundles/*.kdtr"))):
        c = subprocess.run([str(tool), "list", path], capture_output=True, text=True)
        py = subprocess.run([sys.executable, "-m", "k2vec.kdtr", "list", path], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO / "src")})
        assert c.returncode == 0 and py.returncode == 0, c.stderr + py.stderr
        assert c.stdout == py.stdout and c.stdout.count("\n") > 100
        v = subprocess.run([str(tool), "verify", path], capture_output=True, text=True)
        assert v.returncode == 0, v.stderr


def test_int4_bundle_holds_packed_weights_only(pipeline):
    b = open_bundle(pipeline[0] / "results/bundles/small-int4.kdtr", verify=True)
    quantized = b.metadata["quantization"]["tensors"]
    assert quantized and all(q + ".qw" in b and q + ".sc" in b and q not in b for q in quantized)
    info = {t.name: t for t in b.tensors}
    assert info[quantized[0] + ".qw"].packing == "int4"
    assert open_bundle(pipeline[0] / "results/bundles/small-fp32.kdtr").metadata["quantization"] is None


# ------------------------------------------------------------------------------- numpy engine

def test_numpy_engine_matches_golden_exactly(pipeline):
    root = pipeline[0]
    results = sorted((root / "results/runs/numpy").glob("*.json"))
    assert len(results) == 2 * 2 * 6
    for path in results:
        r = json.loads(path.read_text())
        assert r["status"] == "ok", (path.name, r.get("reason"))
        model, precision, mode = path.stem.split("-", 2)
        g = golden(root, model, precision)
        for a, run in enumerate(r["runs"]):
            for i, p in enumerate(run["prompts"]):
                if mode == "greedy":
                    assert p["tokens"] == g[f"golden.p{i}.tokens"].tolist(), (path.name, i)
                    continue
                if mode == "score":
                    assert_score_equals_golden(p, g, i, steps=slice(None), where=(path.name, i))
                    continue
                pre = f"ddtree.b{mode[len('ddtree-b'):]}.a{a}.p{i}."
                rounds = p["rounds"]
                assert p["tokens"] == g[pre + "tokens"].tolist()
                assert [x["start"] for x in rounds] == g[pre + "round_start"].tolist()
                assert [x["bonus"] for x in rounds] == g[pre + "round_bonus"].tolist()
                for field, name in (("tokens", "node_tokens"), ("parents", "node_parents"),
                                    ("depths", "node_depths"), ("accepted", "accepted")):
                    assert sum((x[field] for x in rounds), []) == g[pre + name].tolist(), (path.name, field)


def assert_score_equals_golden(p: dict, g, i: int, steps: slice, where, rel: float = 0.0) -> None:
    """A score-mode prompt equals golden `g`'s prompt i on `steps` (router: on the positions those steps
    feed, prompt positions included): bit for bit, or logits and fingerprints within `rel` of their largest."""
    P = g[f"prompt.p{i}.tokens"].size
    pre = f"golden.p{i}."
    assert np.array_equal(np.array(p["tokens"])[steps], g[pre + "tokens"][steps]), where
    assert np.array_equal(np.array(p["topk_ids"])[steps], g[pre + "topk_ids"][steps]), where
    # float32 fingerprints: a 1e-16 change of the float64 value may round to the next float32
    for key, dtype, tol in (("topk_logits", np.float64, rel), ("fingerprints", np.float32, rel and 1e-6)):
        got, want = np.array(p[key], dtype)[steps], g[pre + key][steps]
        assert got.shape == want.shape, where
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), (where, key)
    stop = g[pre + "tokens"].size if steps.stop is None else steps.stop
    routed = np.array(p["router_experts"])
    assert routed.shape[0] == P + g[pre + "tokens"].size - 1, where
    assert np.array_equal(routed[: P - 1 + stop], g[pre + "router_ids"].transpose(1, 0, 2)[: P - 1 + stop]), where


def test_format_effect_run_reproduces_the_int4_golden(pipeline):
    """The int4 model forced on the fp32 golden tokens: up to and including the first step where the
    two goldens' tokens differ both saw the same tokens, so there it equals the int4 golden bit for bit
    (every figure of the fp32-vs-int4 comparison comes from those steps), and it diverges from the fp32
    golden exactly where the int4 golden does."""
    root = pipeline[0]
    for model in default_config()["models"]:
        r = json.loads((root / f"results/format-effect/{model}.json").read_text())
        assert r["status"] == "ok" and r["engine"] == "int4-format" and r["precision"] == "fp32"
        fp, q = golden(root, model, "fp32"), golden(root, model, "int4")
        assert r["inputs"]["forced_golden"]["sha256"] == hashlib.sha256(
            (root / f"results/golden/{model}/fp32.kdtr").read_bytes()).hexdigest()
        diverged = 0
        for i, p in enumerate(r["runs"][0]["prompts"]):
            differ = np.flatnonzero(fp[f"golden.p{i}.tokens"] != q[f"golden.p{i}.tokens"])
            k = int(differ[0]) if differ.size else len(p["tokens"]) - 1
            # not bit for bit: the batch's other prompts feed other tokens than in the int4 golden's run,
            # so its MoE row blocks differ (BLAS blocking: measured 7e-16 of the largest logit)
            assert_score_equals_golden(p, q, i, steps=slice(0, k + 1), where=(model, i), rel=1e-12)
            forced_differ = np.flatnonzero(np.array(p["tokens"]) != fp[f"golden.p{i}.tokens"])
            assert (forced_differ[0] if forced_differ.size else None) == (differ[0] if differ.size else None)
            diverged += differ.size > 0
        assert diverged > 0, model  # else the check above says nothing about the steps after it


# ---------------------------------------------------------------------------- transformers engine

HF_RUNS = 2 * 2 * 2  # tiny, small x fp32, int4 x greedy, score
HF_BUG_ENGINE = REPO / "tests" / "engines" / "hf_bug_engine.py"
HF_BUGS = ["no-routed-scaling", "no-shared-expert"]


def test_hf_fp32_engine_matches_the_golden_on_every_run(pipeline):
    """transformers in float32 (k2vec.engines.hf): the golden's tokens (score mode: its argmax on the golden
    sequence) and top-k ids, logits within float32 rounding, the same hidden states, and the same experts
    at every routed position, prompt positions included in score mode."""
    root = pipeline[0]
    results = sorted((root / "results/runs/hf_fp32").glob("*.json"))
    assert len(results) == HF_RUNS
    for path in results:
        r = json.loads(path.read_text())
        assert r["status"] == "ok", (path.name, r.get("reason"))
        model, precision, mode = path.stem.split("-", 2)
        g = golden(root, model, precision)
        for i, p in enumerate(r["runs"][0]["prompts"]):
            pre, where = f"golden.p{i}.", (path.name, i)
            assert p["tokens"] == g[pre + "tokens"].tolist(), where
            assert np.array_equal(p["topk_ids"], g[pre + "topk_ids"]), where
            assert np.abs(np.array(p["topk_logits"]) - g[pre + "topk_logits"]).max() < 1e-4, where
            fp, gfp = np.array(p["fingerprints"]), g[pre + "fingerprints"]
            assert (np.linalg.norm(fp - gfp, axis=-1) / np.linalg.norm(gfp, axis=-1)).max() < 1e-5, where
            routed = g[pre + "router_ids"].transpose(1, 0, 2)  # [P + N - 1 fed positions, MoE layers, k]
            if mode == "greedy":  # the token fed at each step: the last prompt token, then generated ones
                routed = routed[g[f"prompt.p{i}.tokens"].size - 1:]
            assert np.array_equal(np.sort(p["router_experts"], axis=-1), np.sort(routed, axis=-1)), where


def test_hf_engines_in_the_default_report(pipeline, tmp_path):
    """float32: exact on every row; bfloat16: no real row, within its declared budget, so the gate passes;
    both engines' score statistics are in the score table."""
    root = pipeline[0]
    rows = pd.read_csv(root / "default-report/divergence.csv")
    fp32, bf16 = rows[rows["engine"] == "hf_fp32"], rows[rows["engine"] == "hf_bf16"]
    assert len(fp32) == len(bf16) == HF_RUNS * 4
    assert set(fp32["class"]) == {"exact"} and set(fp32["precision_class"]) == {"float32"}
    assert set(bf16["precision_class"]) == {"bfloat16"}
    assert not bf16["class"].isin(FAILING_CLASSES).any(), bf16[["model", "precision", "mode", "prompt", "class",
                                                                "over_budget"]].to_string()
    only_hf = tmp_path / "hf.csv"
    rows[rows["engine"].isin(["hf_fp32", "hf_bf16"])].to_csv(only_hf, index=False)
    check_strict(str(only_hf), str(tmp_path / "strict.ok"))  # raises StrictFailure on a failing row
    score = pd.read_csv(root / "default-report/score.csv")
    for engine in ("hf_fp32", "hf_bf16"):
        mine = score[score["engine"] == engine]
        assert len(mine) == 4 and mine[["same_top1", "kl_mean", "kl_p99"]].notna().all().all(), engine
    assert (score.loc[score["engine"] == "hf_fp32", "same_top1"] == 1).all()


@pytest.fixture(scope="module")
def hf_bug_run(pipeline, tmp_path_factory):
    """The default config's hf_bf16 beside two copies with a real bug each (small model, int4), strict."""
    root, env = pipeline
    work = tmp_path_factory.mktemp("hfbug")
    config = default_config()
    bf16 = config["engines"]["hf_bf16"]
    config["engines"] = {"hf_bf16": bf16}
    for bug in HF_BUGS:
        config["engines"]["hf_bug_" + bug.replace("-", "_")] = {
            **bf16, "command": bf16["command"].replace("-m k2vec.engines.hf", f"{HF_BUG_ENGINE} {bug}"),
            "sources": [str(HF_BUG_ENGINE), "src/k2vec/engines/hf.py"], "models": ["small"], "precisions": ["int4"]}
    config["report"]["strict"] = True
    cfg = write_config(work / "bug.yaml", config)
    res = snakemake("--cores", "2", "--configfile", str(cfg), "--replace-workflow-config",
                    snakefile=root / "Snakefile", cwd=root, env=env, timeout=900)
    return res, pd.read_csv(root / "results/report/divergence.csv")


@pytest.mark.parametrize("bug", HF_BUGS)
def test_hf_bf16_engine_with_a_real_bug_is_real_and_fails_the_gate(hf_bug_run, bug):
    """The precision-aware classification is no blindfold: a bfloat16 engine whose routed experts go
    unscaled, or whose shared expert is dropped, diverges for real, and strict mode fails naming it,
    while the correct bfloat16 engine beside it is not named."""
    res, rows = hf_bug_run
    engine = "hf_bug_" + bug.replace("-", "_")
    assert res.returncode != 0
    failing = "\n".join(line for line in res.stderr.splitlines() if "report.strict:" in line)  # the runs it names
    assert f"{engine}/small-int4-greedy: real" in failing, res.stderr[-3000:]
    assert f"{engine}/small-int4-score: over-budget" in failing, res.stderr[-3000:]
    assert "hf_bf16/" not in failing
    mine = rows[rows["engine"] == engine]
    assert set(mine.loc[mine["mode"] == "greedy", "class"]) == {"real"}
    assert set(mine["precision_class"]) == {"bfloat16"}


# ------------------------------------------------------------------ GPU slots, failure isolation

def fake_engines(record_dir, kernel):
    cmd = (f"{{python}} {FAKE} {{behaviour}} {record_dir} --bundle {{bundle}} --mode {{mode}} --budget {{budget}} "
           f"--output {{output}}")
    # unsandboxed: they record where and when they ran in `record_dir`, outside their scratch
    one = {"models": ["tiny"], "precisions": ["fp32"], "modes": ["greedy"], "sandbox": False}
    return {
        # and a package module that compiles the file beside it at run time (test_kernel_edit_reruns_only_...)
        "fakegpu": {"command": cmd.replace("{behaviour}", "ok"), "gpus": 1, "sandbox": False,
                    "sources": [str(kernel), "src/k2vec/engines/gpu_triton/kernels/w4a16_cuda.py"],
                    "build": f"echo compiling {kernel.name} && test -s {kernel}"},
        "crash": {"command": cmd.replace("{behaviour}", "crash"), **one},
        "hang": {"command": cmd.replace("{behaviour}", "hang"), "timeout_s": 2, **one},
        "badjson": {"command": cmd.replace("{behaviour}", "badjson"), **one},
        "short": {"command": cmd.replace("{behaviour}", "short"), **one},
    }


@pytest.fixture(scope="module")
def fake_run(pipeline, tmp_path_factory):
    root, env = pipeline
    work = tmp_path_factory.mktemp("fake")
    records = work / "records"
    records.mkdir()
    kernel = work / "gemm_w4a16.cu"
    kernel.write_text("// a kernel\n")
    config = default_config()
    config["engines"] = fake_engines(records, kernel)
    config["gpus"] = {"devices": [0, 1, 2, 3], "lock_dir": str(work / "locks")}
    cfg = write_config(work / "fake.yaml", config)
    res = snakemake("--cores", "8", "--resources", "gpu=4", "--configfile", str(cfg), "--replace-workflow-config",
                    snakefile=root / "Snakefile", cwd=root, env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return root, env, cfg, records, kernel


def test_gpu_slots_all_used_never_shared(fake_run):
    records = [r for r in (json.loads(p.read_text()) for p in fake_run[3].glob("*.json")) if r["behaviour"] == "ok"]
    assert len(records) == 24  # tiny, small x fp32, int4 x greedy + 4 DDTree budgets + score
    devices = [r["cuda_visible_devices"] for r in records]
    assert set(devices) == {"0", "1", "2", "3"}
    for i, a in enumerate(records):
        for b in records[i + 1:]:
            if a["cuda_visible_devices"] == b["cuda_visible_devices"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], "one GPU given to two jobs at once"
    # Concurrency really happened: at some moment several jobs ran together.
    starts = sorted(r["start"] for r in records)
    assert any(any(r["start"] <= s < r["end"] for r in records if r["start"] != s) for s in starts)


@pytest.mark.parametrize("engine, reason", [
    ("crash", "exited with code 3"), ("hang", "timed out after 2 s"),
    ("badjson", "not valid JSON"), ("short", "23 tokens, expected max_new_tokens = 24"),
])
def test_failing_engines_give_failed_results(fake_run, engine, reason):
    root = fake_run[0]
    out = root / f"results/runs/{engine}"
    # no partial files; the result and its sha256 record
    assert sorted(p.name for p in out.iterdir()) == ["tiny-fp32-greedy.json", "tiny-fp32-greedy.json.hmac",
                                                     "tiny-fp32-greedy.json.sha256"]
    r = json.loads((out / "tiny-fp32-greedy.json").read_text())
    assert r["status"] == "failed" and reason in r["reason"], r["reason"]
    if engine == "crash":
        assert "illegal memory access" in r["stderr_tail"]
    ok = [json.loads(p.read_text())["status"] for p in (root / "results/runs/fakegpu").glob("*.json")]
    assert ok == ["ok"] * 24


@pytest.mark.parametrize("edited", ["the kernel it names", "the CUDA source its Python module compiles"])
def test_kernel_edit_reruns_only_that_engine(fake_run, edited):
    """fakegpu's sources: a kernel file, and w4a16_cuda.py, which compiles w4a16_cuda.cu beside it at run time
    (common.smk engine_code, code_digest.with_imports). Editing either reruns fakegpu's build and runs only."""
    root, env, cfg, _, kernel = fake_run
    if edited != "the kernel it names":
        kernel = root / "src/k2vec/engines/gpu_triton/kernels/w4a16_cuda.cu"
    original = kernel.read_text()
    try:
        kernel.write_text(original + "// faster now\n")
        res = snakemake("-n", "--configfile", str(cfg), "--replace-workflow-config", snakefile=root / "Snakefile",
                        cwd=root, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        assert scheduled_jobs(res.stdout) == {"engine_build": 1, "engine_run": 24, "report": 1, "all": 1}
        assert all("results/runs/fakegpu/" in line for line in res.stdout.splitlines()
                   if line.strip().startswith("output: results/runs/"))
    finally:
        kernel.write_text(original)


def test_build_step_ran_once_and_stamped_the_sources(fake_run):
    root, _, _, _, kernel = fake_run
    stamp = (root / "results/engines/fakegpu/build.stamp").read_text()
    assert stamp.startswith("build: echo compiling") and str(kernel) in stamp
    assert "compiling gemm_w4a16.cu" in (root / "results/logs/engines/fakegpu/build.log").read_text()
    assert not (root / "results/engines/crash").exists()  # engines without a build step have no stamp


def test_one_engine_setting_reruns_only_that_engine(fake_run, tmp_path):
    root, env, cfg, _, _ = fake_run
    import yaml
    config = yaml.safe_load(cfg.read_text())
    config["engines"]["crash"]["timeout_s"] = 30
    changed = write_config(tmp_path / "changed.yaml", config)
    res = snakemake("-n", "--configfile", str(changed), "--replace-workflow-config",
                    snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert scheduled_jobs(res.stdout) == {"engine_run": 1, "report": 1, "all": 1}
    assert "output: results/runs/crash/tiny-fp32-greedy.json" in res.stdout


# ------------------------------------------------------------------------------------ strict mode

def strict_run(fake_run, tmp_path, engines, near_tie, budgets=None):
    root, env, cfg, _, _ = fake_run
    import yaml
    config = yaml.safe_load(cfg.read_text())
    config["engines"] = {k: v for k, v in config["engines"].items() if k in engines}
    config["report"].update(strict=True, near_tie=near_tie)
    if budgets:
        config["report"]["budgets"] = budgets
    path = write_config(tmp_path / "strict.yaml", config)
    return snakemake("--cores", "2", "--resources", "gpu=4", "--configfile", str(path),
                     "--replace-workflow-config", snakefile=root / "Snakefile", cwd=root, env=env, timeout=900)


def test_strict_fails_on_real_divergence_and_failure(fake_run, tmp_path):
    # The `ok` fake engine emits token 0 everywhere: a real divergence; `crash` fails.
    res = strict_run(fake_run, tmp_path, ["fakegpu", "crash"], near_tie=1e-3)
    assert res.returncode != 0
    assert "report.strict" in res.stderr and "crash/tiny-fp32-greedy: failed" in res.stderr
    assert (fake_run[0] / "results/report/divergence.html").exists()  # the report is still there


def test_strict_passes_when_divergences_are_near_ties_only(fake_run, tmp_path):
    # A near-tie threshold above every golden margin turns each divergence into a near-tie. The fake
    # engine's logits (one 0.0 per step) are nowhere near the golden's: its budget checks nothing here.
    res = strict_run(fake_run, tmp_path, ["fakegpu"], near_tie=1e9, budgets={"float32": dict.fromkeys(
        ("logit_abs", "hidden_rel", "same_top1", "kl_mean", "kl_p99"))})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "strict: ok" in (fake_run[0] / "results/report/strict.ok").read_text()


# ------------------------------------------------------------------------------------- the report

def test_default_report_renders_in_chromium(pipeline, tmp_path):
    from test_report_html import CHROMIUM, render_in_chromium
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    root = pipeline[0]
    html = root / "default-report/divergence.html"
    rgb = render_in_chromium(html, tmp_path)
    green = (rgb[..., 1] > 0.5) & (rgb[..., 0] < 0.4) & (rgb[..., 2] < 0.4)
    assert green.sum() > 200  # the numpy engine is exact: green badges and bars
    summary = (root / "default-report/summary.txt").read_text()
    # 192 trees (2 models x 2 precisions x 4 budgets x 3 accuracies x 4 prompts) for each DDTree engine that
    # runs on the CPU: numpy and native
    assert "real 0 | failed 0" in summary and "0 of 384 trees differ" in summary
