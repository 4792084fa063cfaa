"""Every stage verifies what it reads, and the report notices inputs that changed under a run.

Damage is done as a careless user or a hostile engine would: one byte inverted in place, the file's
timestamps kept (so Snakemake sees nothing). Unit tests cover each reader; the Snakemake tests follow
the user's path on a tiny config: rerun a stage over a damaged input, or run an engine that damages
what the judge reads.
"""
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, copy_workflow, default_config, snakemake, write_config
from test_quant import make_fp32_checkpoint, make_spec
from test_report_metrics import make_goldens

from k2vec.model.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, write_shards
from k2vec.digests import (IntegrityError, check_keyed_record, check_record, integrity_key_path, load_or_create_key,
                           read_key, sha256_file, verify_kdtr, write_keyed_record, write_record)
from k2vec.engines.contract.expectations import Expectations
from k2vec.engines.isolation import sandbox_problem
from k2vec.engines.runner import run_engine
from k2vec.model.int4_checkpoint import open_int4
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.kdtr import open_bundle, write_bundle
from k2vec.model.int4 import QuantError
from k2vec.report.metrics import ReportError, compute_metrics
from support.synthetic import perfect_result, write_result

TAMPER = REPO / "tests" / "engines" / "tamper_engine.py"


def flip_byte(path: Path, offset: int | None = None) -> int:
    """Invert one byte (the middle one by default) in place, keeping the file's timestamps."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return offset


def tensor_offset(path: Path, name: str) -> int:
    with open_bundle(path) as b:
        return b.info(name).offset


# ------------------------------------------------------------------------------- checkpoint, int4


def test_changed_checkpoint_shard_is_named(tmp_path):
    shards = [[("a", np.arange(64, dtype=np.float32))], [("b", np.ones(64, np.float32))]]
    write_shards(tmp_path, shards, 2)
    (tmp_path / "config.json").write_text("{}")
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["sha256"]["model-00002-of-00002.safetensors"] == \
        sha256_file(tmp_path / "model-00002-of-00002.safetensors")
    flip_byte(tmp_path / "model-00002-of-00002.safetensors", -4)   # inside tensor b's data
    ckpt = Checkpoint(tmp_path)
    assert ckpt["a"][5] == 5   # the intact shard still reads
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: sha256 .* changed since"):
        ckpt["b"]
    # an index that records no hashes cannot be verified
    del index["metadata"]["sha256"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="no sha256 recorded"):
        Checkpoint(tmp_path)


def test_changed_int4_file_is_named(tmp_path):
    fp32 = make_fp32_checkpoint(tmp_path / "fp32")
    out = tmp_path / "int4"
    quantize_checkpoint(fp32, out, make_spec(fp32))
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    flip_byte(out / f"{name}.sc", 0)  # same size: only the hash can tell
    q = open_int4(out)
    with pytest.raises(QuantError, match=rf"{name}\.sc: tensor {name}: sha256 .* changed since"):
        q[name]
    assert q["model.layers.1.mlp.experts.1.up_proj.weight"].packed.shape[0] > 0  # the others still read


# ------------------------------------------------------------------------------------- runner


def tiny_bundle(path: Path) -> str:
    write_bundle(path, {"x": np.arange(512, dtype=np.float32)}, {"kind": "test"}, alignment=64)
    write_record(path)
    return str(path)


def run_with(tmp_path, bundle: str, body: str):
    """Run a python engine (`body`, with `out` and `bundle` set) that leaves a marker when it starts."""
    script = tmp_path / "engine.py"
    marker = tmp_path / "engine-started"
    script.write_text(f"import json, os, sys\nopen({str(marker)!r}, 'w').close()\nout, bundle = sys.argv[1:3]\n"
                      + body)
    out = tmp_path / "run.json"
    result = run_engine(engine="e", command=f"{sys.executable} {script} {{output}} {{bundle}}", bundle=bundle,
                        mode="greedy", output=str(out), expect=Expectations(1, 2, 10), gpus=0, devices=[],
                        lock_dir=str(tmp_path / "locks"), timeout_s=30, stderr_path=str(tmp_path / "stderr"),
                        max_result_mb=1.0, scratch_dir=str(tmp_path / "scratch"))
    assert check_record(out) and json.loads(out.read_text()) == result   # written with its record
    return result, marker.exists()


GOOD = "json.dump({'format': 'k2vec-engine-result', 'version': 1, 'runs': [{'drafter': None, " \
       "'prompts': [{'tokens': [1, 2]}]}]}, open(out, 'w'))\n"


@pytest.mark.parametrize("damage, words", [
    ("flip", r"b\.kdtr is corrupted at byte offset \d+ \(dir\[0\]\.crc32\): tensor 'x'"),
    ("truncate", r"b\.kdtr is corrupted at byte offset 16 \(header\.file_size\).*truncated"),
    ("no record", r"b\.kdtr: no sha256 record"),
])
def test_damaged_bundle_is_a_failed_run_and_the_engine_never_starts(tmp_path, damage, words):
    bundle = Path(tiny_bundle(tmp_path / "b.kdtr"))
    if damage == "flip":
        flip_byte(bundle, -100)
    elif damage == "truncate":
        bundle.write_bytes(bundle.read_bytes()[:-64])
    else:
        os.unlink(str(bundle) + ".sha256")
    r, started = run_with(tmp_path, str(bundle), GOOD)
    assert r["status"] == "failed" and not started
    assert "the input bundle failed verification, so the engine was not run" in r["reason"]
    assert re.search(words, r["reason"]), r["reason"]


def test_engine_that_changes_its_bundle_fails(tmp_path):
    bundle = tiny_bundle(tmp_path / "b.kdtr")
    before = sha256_file(bundle)
    body = "d = bytearray(open(bundle, 'rb').read()); d[-8] ^= 1; open(bundle, 'wb').write(d)\n" + GOOD
    r, started = run_with(tmp_path, bundle, body)
    assert started and r["status"] == "failed"
    assert f"the input bundle {bundle} changed during the run (sha256 {before} before" in r["reason"]
    assert r["inputs"]["bundle"] == {"path": bundle, "sha256": before}


def test_good_run_records_the_bundle_hash(tmp_path):
    bundle = tiny_bundle(tmp_path / "b.kdtr")
    r, _ = run_with(tmp_path, bundle, GOOD)
    assert r["status"] == "ok" and r["inputs"]["bundle"] == {"path": bundle, "sha256": sha256_file(bundle)}


# ------------------------------------------------------------------------------------- report


@pytest.fixture(scope="session")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("report-goldens"))


def judge(tmp_path, goldens, result: dict, *, tamper=None):
    path = write_result(tmp_path / "e.json", result)
    if tamper:
        tamper(Path(path))
    runs = [{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": path}]
    return compute_metrics(runs, {("tiny", "fp32"): goldens[("tiny", "fp32")]})


def rows_of(m, engine="e"):
    return m.rows[m.rows["engine"] == engine]


def test_perfect_result_with_intact_records_is_exact(tmp_path, goldens):
    m = judge(tmp_path, goldens, perfect_result(goldens[("tiny", "fp32")], "greedy"))
    assert (rows_of(m)["class"] == "exact").all() and m.strict_problem is None


def test_result_rewritten_after_the_run_is_changed_not_blamed(tmp_path, goldens):
    def rewrite(path):   # another process plants a real divergence, keeping the timestamps
        st = os.stat(path)
        res = json.loads(path.read_text())
        res["runs"][0]["prompts"][0]["tokens"][0] += 1
        path.write_text(json.dumps(res))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    m = judge(tmp_path, goldens, perfect_result(goldens[("tiny", "fp32")], "greedy"), tamper=rewrite)
    rows = rows_of(m)
    assert (rows["class"] == "changed").all() and not (rows["class"] == "real").any()
    assert rows["reason"].str.contains("result changed after the engine runner wrote it").all()
    assert rows["reason"].str.contains("e.json: sha256").all()
    assert m.strict_problem is not None   # strict mode does not pass a run it could not judge


def test_result_overwritten_with_garbage_is_changed(tmp_path, goldens):
    m = judge(tmp_path, goldens, perfect_result(goldens[("tiny", "fp32")], "greedy"),
              tamper=lambda p: p.write_text("{\"runs\": ["))
    assert (rows_of(m)["class"] == "changed").all()
    assert rows_of(m)["reason"].str.contains("result changed after the engine runner wrote it").all()


def test_result_without_record_is_changed(tmp_path, goldens):
    m = judge(tmp_path, goldens, perfect_result(goldens[("tiny", "fp32")], "greedy"),
              tamper=lambda p: os.unlink(str(p) + ".sha256"))
    assert (rows_of(m)["class"] == "changed").all()
    assert rows_of(m)["reason"].str.contains("no sha256 record").all()


def test_keyed_record_catches_a_result_rewritten_with_a_fresh_sha256_record(tmp_path, goldens):
    """The runner's keyed record (HMAC-SHA256 under the results directory's key): rewriting the result
    and its sha256 record is `changed`; so is a result whose key is gone. Without a key the report
    checks sha256 records and says no verdict is tamper-proof."""
    key_file = integrity_key_path(tmp_path / "results")
    key = load_or_create_key(key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and load_or_create_key(key_file) == key
    golden = goldens[("tiny", "fp32")]
    path = Path(write_result(tmp_path / "e.json", {**perfect_result(golden, "greedy"), "sandbox": True}))
    write_keyed_record(path, key)
    runs = [{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": str(path)}]
    rows = rows_of(compute_metrics(runs, {("tiny", "fp32"): golden}, integrity_key=key_file))
    assert (rows["class"] == "exact").all() and rows["tamper_proof"].all()
    unkeyed = rows_of(compute_metrics(runs, {("tiny", "fp32"): golden}))
    assert (unkeyed["class"] == "exact").all() and not unkeyed["tamper_proof"].any()
    assert unkeyed["tamper_note"].str.contains("given no integrity key").all()

    res = json.loads(path.read_text())
    res["runs"][0]["prompts"][0]["tokens"][0] += 1
    path.write_text(json.dumps(res))
    write_record(path)   # the forger's fresh sha256 record
    rows = rows_of(compute_metrics(runs, {("tiny", "fp32"): golden}, integrity_key=key_file))
    assert (rows["class"] == "changed").all()
    assert rows["reason"].str.contains("its HMAC-SHA256 under the integrity key differs").all()
    key_file.unlink()
    rows = rows_of(compute_metrics(runs, {("tiny", "fp32"): golden}, integrity_key=key_file))
    assert (rows["class"] == "changed").all() and rows["reason"].str.contains("integrity key .* is missing").all()


def test_runner_writes_a_keyed_record_with_the_results_directory_key(tmp_path):
    bundle = tiny_bundle(tmp_path / "b.kdtr")
    out = tmp_path / "results" / "runs" / "e.json"
    script = tmp_path / "engine.py"
    script.write_text("import json, sys\nout = sys.argv[1]\n" + GOOD)
    r = run_engine(engine="e", command=f"{sys.executable} {script} {{output}} {{bundle}}",
                   bundle=bundle, mode="greedy", output=str(out), expect=Expectations(1, 2, 10), gpus=0, devices=[],
                   lock_dir=str(tmp_path / "locks"), timeout_s=30, stderr_path=str(tmp_path / "stderr"),
                   max_result_mb=1.0, scratch_dir=str(tmp_path / "scratch"), results_dir=str(tmp_path / "results"))
    assert r["status"] == "ok", r
    key_file = integrity_key_path(tmp_path / "results")
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert check_keyed_record(out, read_key(key_file)) and check_record(out)
    with pytest.raises(IntegrityError, match="differs"):
        check_keyed_record(out, b"x" * 32)


def bundle_for(tmp_path, golden: Path, golden_sha256: str | None = None) -> dict:
    """A bundle as the bundle stage leaves it (its record, the golden's hash in its metadata), and the
    `inputs` entry the runner writes for a run on it."""
    path = tmp_path / "tiny-fp32.kdtr"
    write_bundle(path, {"x": np.zeros(256, np.float32)}, {"golden_sha256": golden_sha256 or sha256_file(golden)},
                 alignment=64)
    return {"bundle": {"path": str(path), "sha256": write_record(path)}}


@pytest.mark.parametrize("what", ["intact", "flipped", "rebuilt", "other golden"])
def test_run_whose_bundle_changed_is_changed(tmp_path, goldens, what):
    golden = goldens[("tiny", "fp32")]
    inputs = bundle_for(tmp_path, golden, "0" * 64 if what == "other golden" else None)
    bundle = Path(inputs["bundle"]["path"])
    if what == "flipped":
        flip_byte(bundle, -8)
    elif what == "rebuilt":   # a new bundle (with its record) after the run
        write_bundle(bundle, {"x": np.ones(256, np.float32)}, {"golden_sha256": sha256_file(golden)}, alignment=64)
        write_record(bundle)
    m = judge(tmp_path, goldens, {**perfect_result(golden, "greedy"), "inputs": inputs})
    rows = rows_of(m)
    if what == "intact":
        assert (rows["class"] == "exact").all()
        return
    assert (rows["class"] == "changed").all(), rows["reason"].tolist()
    expected = {"flipped": "changed since this run used it", "rebuilt": "changed since this run used it",
                "other golden": "was built from another golden"}[what]
    assert rows["reason"].str.contains(f"input bundle {bundle} {expected}", regex=False).all()


def test_damaged_golden_stops_the_report_naming_file_and_tensor(tmp_path, goldens):
    golden = tmp_path / "fp32.kdtr"
    shutil.copy2(goldens[("tiny", "fp32")], golden)
    shutil.copy2(str(goldens[("tiny", "fp32")]) + ".sha256", str(golden) + ".sha256")
    flip_byte(golden)
    runs = [{"engine": "e", "model": "tiny", "precision": "fp32", "mode": "greedy",
             "result": write_result(tmp_path / "e.json", perfect_result(golden, "greedy"))}]
    with pytest.raises(ReportError, match=r"model 'tiny' precision 'fp32' .* so no run was judged: .*fp32\.kdtr is "
                                          r"corrupted at byte offset \d+ \(dir\[\d+\]\.crc32\): tensor '"):
        compute_metrics(runs, {("tiny", "fp32"): golden})


def test_golden_rewritten_with_valid_checksums_is_caught_by_its_record(tmp_path, goldens):
    """A KDTR file rewritten whole passes its own CRCs; only the record written with it tells."""
    golden = tmp_path / "fp32.kdtr"
    shutil.copy2(goldens[("tiny", "fp32")], golden)
    write_record(golden, "f" * 64)
    with pytest.raises(IntegrityError, match=r"fp32\.kdtr: sha256 [0-9a-f]{64} differs from the one recorded"):
        verify_kdtr(golden)


# --------------------------------------------------------------------------- through Snakemake


def engine(behaviour: str, target: str = "-", precisions=("fp32",), sandbox: bool | None = None,
           extra: str = "") -> dict:
    e = {"command": f"{{python}} {TAMPER} {behaviour} {target} --bundle {{bundle}} --mode {{mode}} "
                    f"--output {{output}} {extra}",
         "models": ["tiny"], "precisions": list(precisions), "modes": ["greedy"], "timeout_s": 60}
    if sandbox is not None:
        e["sandbox"] = sandbox
    return e


def tiny_config(engines: dict) -> dict:
    config = default_config()
    config["models"] = {"tiny": {"preset": "tiny"}}
    config["prompts"].update(count=1, min_length=4, max_length=5)
    config["decoding"].update(max_new_tokens=4, ddtree={"block_size": 4, "budgets": [1], "accuracies": [0.9]})
    config["engines"] = engines
    config["gpus"] = {"devices": [], "lock_dir": "/tmp/k2vec-gpu-locks"}
    return config


VICTIM = "results/runs/victim/tiny-fp32-greedy.json"
VICTIM_INT4 = "results/runs/victim/tiny-int4-greedy.json"
BUNDLE = "results/bundles/tiny-fp32.kdtr"
BUNDLE_INT4 = "results/bundles/tiny-int4.kdtr"
GOLDEN = "results/golden/tiny/fp32.kdtr"
VICTIM_ENGINE = engine("exact", precisions=("fp32", "int4"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny pipeline, run to the end with one engine that reproduces the golden exactly."""
    root = copy_workflow(tmp_path_factory.mktemp("integrity"))
    write_config(root / "config.yaml", tiny_config({"victim": VICTIM_ENGINE}))
    env = {"PYTHONPATH": str(root / "src")}
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert set(pd.read_csv(root / "results/report/divergence.csv")["class"]) == {"exact"}
    return root


def workdir(built, tmp_path, engines: dict | None = None) -> tuple[Path, dict]:
    """A copy of the built pipeline (timestamps kept: nothing is out of date), with extra engines."""
    root = tmp_path / "wf"
    shutil.copytree(built, root, symlinks=True)
    if engines:
        write_config(root / "config.yaml", tiny_config({"victim": VICTIM_ENGINE, **engines}))
    return root, {"PYTHONPATH": str(root / "src")}


def smk(root, env, *args, cores: int = 1):
    return snakemake("--cores", str(cores), *args, snakefile=root / "Snakefile", cwd=root, env=env)


def report_rows(root) -> pd.DataFrame:
    return pd.read_csv(root / "results/report/divergence.csv").set_index(["engine", "precision"])


@pytest.mark.parametrize("damaged, words", [
    (GOLDEN, rf"refusing to build {BUNDLE} from a damaged golden: {GOLDEN} is corrupted at byte offset \d+ "
             r"\(dir\[\d+\]\.crc32\): tensor 'golden\.p0\.tokens'"),
    ("results/models/tiny/fp32/model-00002-of-00004.safetensors",
     r"results/models/tiny/fp32/model-00002-of-00004\.safetensors: sha256 [0-9a-f]{64} differs from the one "
     r"model\.safetensors\.index\.json recorded"),
])
def test_bundle_stage_refuses_damaged_inputs(built, tmp_path, damaged, words):
    root, env = workdir(built, tmp_path)
    flip_byte(root / damaged, tensor_offset(root / damaged, "golden.p0.tokens") if damaged == GOLDEN else None)
    res = smk(root, env, "--forcerun", "bundle", "--", BUNDLE)
    assert res.returncode != 0
    assert re.search(words, res.stderr), res.stderr[-3000:]
    assert "Traceback" not in res.stderr   # the message, not a traceback (that is in the stage log)
    assert not (root / BUNDLE).exists()


def test_damaged_bundle_makes_a_failed_row(built, tmp_path):
    root, env = workdir(built, tmp_path)
    flip_byte(root / BUNDLE, tensor_offset(root / BUNDLE, "golden.p0.tokens"))
    res = smk(root, env, "--forcerun", "engine_run")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = report_rows(root)
    assert rows.loc[("victim", "int4"), "class"] == "exact"   # the other run goes on
    victim = rows.loc[("victim", "fp32")]
    assert victim["class"] == "failed"
    assert "the input bundle failed verification, so the engine was not run" in victim["reason"]
    assert re.search(rf"{BUNDLE} is corrupted at byte offset \d+ \(dir\[\d+\]\.crc32\): tensor 'golden\.p0\.tokens'",
                     victim["reason"]), victim["reason"]


def test_engines_damaging_what_the_judge_reads_are_caught(built, tmp_path):
    """One run, two unsandboxed hostile engines that keep the timestamps of what they damage: `evil`
    rewrites the victim's fp32 result with a real divergence; `flipper` flips a byte of the int4
    bundle, which the victim's int4 run used before."""
    root, env = workdir(built, tmp_path, {"evil": engine("rewrite", VICTIM, sandbox=False),
                                          "flipper": engine("flip", BUNDLE_INT4, ["int4"], sandbox=False)})
    stamps = {p: os.stat(root / p).st_mtime_ns for p in (VICTIM, BUNDLE_INT4)}
    res = smk(root, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p: os.stat(root / p).st_mtime_ns for p in stamps} == stamps   # Snakemake saw nothing
    rows = report_rows(root)
    assert rows.loc[("victim", "fp32"), "class"] == "changed"   # judged, it would be a real divergence
    assert f"result changed after the engine runner wrote it, not judged: {VICTIM}: its HMAC-SHA256" in \
        rows.loc[("victim", "fp32"), "reason"]
    assert rows.loc[("evil", "fp32"), "class"] == "exact"
    assert rows.loc[("flipper", "int4"), "class"] == "failed"
    assert f"the input bundle {BUNDLE_INT4} changed during the run" in rows.loc[("flipper", "int4"), "reason"]
    assert rows.loc[("victim", "int4"), "class"] == "changed"
    assert f"input bundle {BUNDLE_INT4} changed since this run used it" in rows.loc[("victim", "int4"), "reason"]
    summary = (root / "results/report/summary.txt").read_text()
    assert "CHANGED: victim tiny/fp32 greedy" in summary and "CHANGED: victim tiny/int4 greedy" in summary
    assert not rows["tamper_proof"].any() and "NOT TAMPER-PROOF" in summary


def engine_log(root, name: str, precision: str = "fp32") -> dict:
    """What the tamper engine tried and what came of it (its last stderr line)."""
    return json.loads((root / f"results/logs/runs/{name}/tiny-{precision}-greedy.engine.log").read_text()
                      .strip().splitlines()[-1])


needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason="bubblewrap cannot sandbox here")


@needs_sandbox
def test_sandboxed_root_forger_cannot_reach_another_engines_result(built, tmp_path):
    """The attack of issue 28, as root (like CI): umount results/ and /proc, remount / read-write,
    then rewrite the victim's result with a divergence and its records. Sandboxed, every step fails:
    the victim's result is untouched and judged exact, every verdict tamper-proof."""
    root, env = workdir(built, tmp_path, {"forger": engine("forge", VICTIM, sandbox=True)})
    before = {p: (root / p).read_bytes() for p in (VICTIM, VICTIM + ".sha256", VICTIM + ".hmac") if (root / p).exists()}
    res = smk(root, env)
    assert res.returncode == 0, res.stderr[-3000:]
    tried = engine_log(root, "forger")
    assert tried["umount -l"] != 0 and tried["mount -o"] != 0 and tried["forge"] != "done", tried
    assert {p: (root / p).read_bytes() for p in before} == before
    rows = report_rows(root)
    assert rows.loc[("victim", "fp32"), "class"] == "exact" and rows.loc[("forger", "fp32"), "class"] == "exact"
    assert rows["tamper_proof"].all(), rows["tamper_note"].tolist()
    assert "tamper-proof: all 3 runs" in (root / "results/report/summary.txt").read_text()


def test_unsandboxed_forgers_make_every_row_not_tamper_proof(built, tmp_path):
    """Unsandboxed, an engine runs as the pipeline's user. `naive` rewrites the victim's fp32 result and
    its sha256 record (the issue's forger): the keyed record catches it. `keyed` also reads the
    integrity key and writes a valid keyed record for the int4 result: nothing can tell, so the report
    says on every row that its verdict is not tamper-proof, and why."""
    root, env = workdir(built, tmp_path, {"naive": engine("forge", VICTIM, sandbox=False, extra="--no-key"),
                                          "keyed": engine("forge", VICTIM_INT4, sandbox=False)})
    res = smk(root, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert engine_log(root, "naive")["forge"] == "done" and engine_log(root, "keyed")["key"] == "read"
    rows = report_rows(root)
    victim = rows.loc[("victim", "fp32")]
    assert victim["class"] == "changed" and "its HMAC-SHA256 under the integrity key differs" in victim["reason"]
    assert rows.loc[("victim", "int4"), "class"] not in ("exact", "changed")   # fooled: judged on the forgery
    assert not rows["tamper_proof"].any()
    assert "engine(s) keyed, naive ran unsandboxed" in rows.loc[("victim", "int4"), "tamper_note"]
    assert "it ran unsandboxed (sandbox: false)" in rows.loc[("naive", "fp32"), "tamper_note"]
    summary = (root / "results/report/summary.txt").read_text()
    assert "NOT TAMPER-PROOF: 4 of 4 runs" in summary


@needs_sandbox
def test_sandboxed_engine_cannot_swap_the_bundle_under_a_concurrent_run(built, tmp_path):
    """Issue 28's bundle swap: `swapper` replaces the fp32 bundle in place by one whose golden tokens
    differ, holds it while `waiter` (started with it, `--cores 2`) reads, then restores every byte and
    the timestamps, so the hashes before and after both runs match. Sandboxed, the bundle is bound
    read-only and the escape fails: the swap never happens and the waiter is exact."""
    root, env = workdir(built, tmp_path, {
        "waiter": engine("exact", sandbox=True, extra="--after swapped.marker"),
        "swapper": engine("swap", BUNDLE, sandbox=True, extra="--hold 4 --marker swapped.marker")})
    before = sha256_file(root / BUNDLE)
    res = smk(root, env, cores=2)
    assert res.returncode == 0, res.stderr[-3000:]
    tried = engine_log(root, "swapper")
    assert tried["swap"] != "done", tried
    assert engine_log(root, "waiter")["after"] is False   # no marker: nothing was swapped
    assert sha256_file(root / BUNDLE) == before
    rows = report_rows(root)
    assert rows.loc[("waiter", "fp32"), "class"] == "exact" and rows["tamper_proof"].all()


def test_engine_flipping_the_golden_stops_the_report(built, tmp_path):
    # unsandboxed: a sandboxed engine sees no golden (results/ is hidden from it)
    root, env = workdir(built, tmp_path, {"flipper": engine("flip", GOLDEN, sandbox=False)})
    res = smk(root, env)
    assert res.returncode != 0
    assert re.search(rf"{GOLDEN} is corrupted at byte offset \d+ \(dir\[\d+\]\.crc32\): tensor '",
                     res.stderr), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not (root / "results/report/divergence.csv").exists()
