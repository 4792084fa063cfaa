"""The run wrapper under hostile conditions, and what it records about each run (GPU identity, times)."""
import json
import os
import textwrap
import time

import numpy as np
import pandas as pd
import pytest

from test_report_metrics import make_goldens
from test_runner import EXPECT, SCORE_EXPECT, fake_engine, good_result, tiny_bundle

from k2vec.engines.contract.expectations import expectations_from_bundle
from k2vec.engines.contract import files
from k2vec.engines.contract.files import MAX_RESULT_NESTING, json_nesting
from k2vec.engines.runner import run_engine
from k2vec.digests import write_record
from k2vec.kdtr.writer import write_bundle
from k2vec.engines.gpus import identify, short_uuid
from k2vec.report import build_report
from support.synthetic import perfect_result

UUID0 = "GPU-0a1b2c3d-1111-2222-3333-444455556666"
UUID1 = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"


def fake_nvidia_smi(tmp_path, monkeypatch, body: str | None = None) -> None:
    """Put an `nvidia-smi` on PATH that lists two H200s (or runs `body`); it checks it was asked the right query."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "nvidia-smi"
    script.write_text(textwrap.dedent(body or f"""\
        #!/bin/bash
        [ "$*" = "--query-gpu=index,name,uuid --format=csv,noheader" ] || {{ echo "bad args: $*" >&2; exit 2; }}
        echo "0, NVIDIA H200, {UUID0}"
        echo "1, NVIDIA H200, {UUID1}"
        """))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)


def run_on(tmp_path, command, gpus=0, devices=(), timeout_s=10.0, max_result_mb=1.0, expect=EXPECT,
           bundle=None):
    out = tmp_path / "results" / "run.json"
    result = run_engine(engine="fake", command=command, bundle=bundle or tiny_bundle(tmp_path), mode="greedy",
                        output=str(out), expect=expect, gpus=gpus, devices=list(devices),
                        lock_dir=str(tmp_path / "locks"),
                        timeout_s=timeout_s, stderr_path=str(tmp_path / "stderr.log"), max_result_mb=max_result_mb,
                        scratch_dir=str(tmp_path / "scratch"))
    assert json.loads(out.read_text()) == result
    # no partial file left, whatever it was: only the result and its sha256 record
    assert sorted(p.name for p in out.parent.iterdir()) == ["run.json", "run.json.sha256"]
    return result


def sees(tmp_path) -> str:
    """An engine that writes a good result and records in tmp_path/seen.json what it saw and when it ran."""
    return (f"seen = {{'t': time.time(), 'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), "
            f"'order': os.environ.get('CUDA_DEVICE_ORDER'), 'cwd': os.getcwd(), 'tmp': os.environ['TMPDIR'], "
            f"'out': out, 'bundle': sys.argv[2] if len(sys.argv) > 2 else None}}\n"
            f"json.dump(seen, open({str(tmp_path / 'seen.json')!r}, 'w'))\n"
            f"time.sleep(0.2)\njson.dump({good_result()!r}, open(out, 'w'))\n")


# ---------------------------------------------------------------------------- GPU identity and timing


def test_gpu_run_records_the_physical_gpu_and_its_times(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    r = run_on(tmp_path, fake_engine(tmp_path, sees(tmp_path)), gpus=1, devices=["1"])
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert r["status"] == "ok" and r["gpus"] == ["1"]
    assert r["gpu_devices"] == [{"id": "1", "index": 1, "name": "NVIDIA H200", "uuid": UUID1}]
    assert r["gpu_identity_error"] is None
    # the engine sees its device numbered as nvidia-smi numbers it
    assert seen["visible"] == "1" and seen["order"] == "PCI_BUS_ID"
    # epoch times around the engine process: it ran between them, and they agree with the wall time
    assert r["started_at"] < seen["t"] < r["ended_at"] <= time.time()
    assert r["ended_at"] - r["started_at"] == pytest.approx(r["wall_s"], abs=0.05)


def test_failed_gpu_run_still_names_its_gpu(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    r = run_on(tmp_path, fake_engine(tmp_path, "sys.exit(7)"), gpus=2, devices=["0", "1"])
    assert r["status"] == "failed" and "code 7" in r["reason"]
    assert [d["uuid"] for d in r["gpu_devices"]] == [UUID0, UUID1]
    assert r["started_at"] <= r["ended_at"]


def test_cpu_run_records_times_and_no_gpu(tmp_path):
    before = time.time()
    r = run_on(tmp_path, fake_engine(tmp_path, f"time.sleep(0.3); json.dump({good_result()!r}, open(out, 'w'))"))
    assert r["gpu_devices"] == [] and r["gpu_identity_error"] is None
    assert before < r["started_at"] and r["ended_at"] - r["started_at"] >= 0.3


def test_devices_given_by_uuid_are_identified(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    assert identify([UUID1, "0"]) == ([{"id": UUID1, "index": 1, "name": "NVIDIA H200", "uuid": UUID1},
                                       {"id": "0", "index": 0, "name": "NVIDIA H200", "uuid": UUID0}], None)


@pytest.mark.parametrize("body, reason", [
    ("#!/bin/bash\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver'; exit 9\n",
     "nvidia-smi exited with code 9: NVIDIA-SMI has failed"),
    ("#!/bin/bash\nexec sleep 30\n", "did not answer within 0.5 s"),
    (f"#!/bin/bash\necho '0, NVIDIA H200, {UUID0}'\n", "device(s) 1 not among the GPUs nvidia-smi lists (0)"),
])
def test_gpu_identity_failures_are_recorded_not_raised(tmp_path, monkeypatch, body, reason):
    fake_nvidia_smi(tmp_path, monkeypatch, body)
    t = time.monotonic()
    devices, why = identify(["1"], timeout_s=0.5)
    assert time.monotonic() - t < 10
    assert devices == [{"id": "1", "index": None, "name": None, "uuid": None}] and reason in why


def test_missing_nvidia_smi_is_recorded_in_the_result(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None if name == "nvidia-smi" else "/bin/" + name)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    r = run_on(tmp_path, fake_engine(tmp_path, f"json.dump({good_result()!r}, open(out, 'w'))"), gpus=1,
               devices=["3"])
    assert r["status"] == "ok"
    assert r["gpu_devices"] == [{"id": "3", "index": None, "name": None, "uuid": None}]
    assert r["gpu_identity_error"] == "nvidia-smi not found on PATH"


def test_too_few_devices_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    r = run_on(tmp_path, fake_engine(tmp_path, dump_with("")), gpus=2, devices=["0"])
    assert r["status"] == "failed" and "needs 2 GPU(s) but the pool has 1 (0)" in r["reason"]


def test_short_uuid():
    assert short_uuid(UUID0) == "GPU-0a1b2c3d" and short_uuid("MIG-12345678-9abc") == "MIG-12345678"


def test_report_shows_each_runs_gpu(tmp_path):
    goldens = make_goldens(tmp_path / "goldens")
    gpu = perfect_result(goldens[("tiny", "fp32")], "greedy")
    gpu.update(gpu_devices=[{"id": "1", "index": 1, "name": "NVIDIA H200", "uuid": UUID1}], gpu_identity_error=None)
    lost = {**gpu, "status": "failed", "reason": "engine exited with code 1", "runs": [],
            "gpu_devices": [{"id": "5", "index": None, "name": None, "uuid": None}],
            "gpu_identity_error": "nvidia-smi not found on PATH"}
    cpu = perfect_result(goldens[("tiny", "fp32")], "greedy")
    runs = []
    for name, res in (("gpu", gpu), ("lost", lost), ("cpu", cpu)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
        runs.append({"engine": name, "model": "tiny", "precision": "fp32", "mode": "greedy",
                     "result": str(tmp_path / f"{name}.json")})
    rep = build_report(runs, goldens, tmp_path / "out")
    df = pd.read_csv(rep.paths["csv"])
    by = df.groupby("engine")
    assert set(by["gpu"].unique()["gpu"]) == {"NVIDIA H200 GPU-9f8e7d6c"}
    assert set(by["gpu_uuid"].unique()["gpu"]) == {UUID1}
    assert set(by["gpu"].unique()["lost"]) == {"GPU 5 (unidentified: nvidia-smi not found on PATH)"}
    assert df[df["engine"] == "cpu"]["gpu"].isna().all()
    summary = rep.paths["html"].read_text().split('id="summary-table"', 1)[1].split("</table>", 1)[0]
    assert "<th" in summary and ">GPU<" in summary
    assert "NVIDIA H200 GPU-9f8e7d6c" in summary and "GPU 5 (unidentified: nvidia-smi not found on PATH)" in summary


# ------------------------------------------------------------------- every engine output: ok or failed


def dump_with(edit: str) -> str:
    """Engine body: a good greedy result `r`, edited by `edit`, written with Python's json."""
    return f"r = {good_result()!r}\n{edit}\njson.dump(r, open(out, 'w'))\n"


def raw(text_expr: str) -> str:
    return f"open(out, 'w').write({text_expr})\n"


HEAD = '{"format": "k2vec-engine-result", "version": 1, "runs": [{"drafter": null, "prompts": '


@pytest.mark.parametrize("what, body, reason", [
    ("nested 200,000 deep", raw(f"{HEAD!r} + '[' * 200000 + ']' * 200000 + '}}]}}'"),
     f"nests arrays/objects 200003 deep (reached at byte {len(HEAD) + 199999}); the limit is {MAX_RESULT_NESTING}"),
    ("nested 300 deep in a free key", dump_with("r['timing'] = {'x': json.loads('[' * 300 + ']' * 300)}"),
     "nests arrays/objects 302 deep"),
    ("5,000-digit integer",
     raw(f"{HEAD!r} + '[{{\"tokens\": [' + '9' * 5000 + ', 1, 1]}}, {{\"tokens\": [2, 2, 2]}}]}}]}}'"),
     "holds a number the JSON reader refuses: Exceeds the limit (4300 digits)"),
    ("output is a directory", "os.mkdir(out); open(os.path.join(out, 'x.json'), 'w').write('{}')", "is a directory"),
    ("output is a symlink", "os.symlink('/etc/hostname', out)", "is a symbolic link"),
    ("output is a FIFO", "os.mkfifo(out)", "is not a regular file"),
    ("NaN logits", dump_with("r['runs'][0]['prompts'][0]['topk_logits'] = [[float('nan')]] * 3"),
     "result holds NaN: every number must be finite"),
    ("Infinity logits", dump_with("r['runs'][0]['prompts'][1]['topk_logits'] = [[1.0], [float('-inf')], [0.5]]"),
     "result holds -Infinity"),
    ("1e999 logits",
     raw(f"{HEAD!r} + '[{{\"tokens\": [1, 1, 1], \"topk_logits\": [[1e999]]}}, {{\"tokens\": [2, 2, 2]}}]}}]}}'"),
     "schema at runs/0/prompts/0/topk_logits/0/0: inf is not a finite number"),
    ("1e999 in a free key", dump_with("r['timing'] = {'load_s': 1.0, 'mine': 7}") +
     "t = open(out).read(); open(out, 'w').write(t.replace('7', '1e999'))",
     "too large for a float (read as infinity)"),
    ("float token id", dump_with("r['runs'][0]['prompts'][1]['tokens'][2] = 5.0"),
     "schema at runs/0/prompts/1/tokens/2: 5.0 is not a JSON integer"),
    ("boolean token id", dump_with("r['runs'][0]['prompts'][0]['tokens'][0] = True"),
     "schema at runs/0/prompts/0/tokens/0: True is not a JSON integer"),
    ("float expert id", dump_with("r['runs'][0]['prompts'][0]['router_experts'] = [[[1, 2.0]]] * 3"),
     "router_experts/0/0/1: 2.0 is not a JSON integer"),
    ("over the size limit", dump_with("r['device'] = 'x' * (1 << 20)"), "bytes, over the limit of 1,048,576"),
    ("not UTF-8", "open(out, 'wb').write(b'{\"runs\": \"\\xff\"}')",
     "not UTF-8 at byte 10"),
])
def test_hostile_outputs_become_failed_rows(tmp_path, what, body, reason):
    r = run_on(tmp_path, fake_engine(tmp_path, body))
    assert r["status"] == "failed" and reason in r["reason"], r["reason"]
    assert r["runs"] == []


def test_result_of_exactly_the_limit_is_accepted(tmp_path):
    body = dump_with("") + "size = os.path.getsize(out); r['device'] = 'x' * ((1 << 20) - size + len(r['device']))\n" \
        "json.dump(r, open(out, 'w'))\nassert os.path.getsize(out) == 1 << 20\n"
    r = run_on(tmp_path, fake_engine(tmp_path, body))
    assert r["status"] == "ok", r["reason"]


def _depth_by_walk(v, d=0):
    return max([_depth_by_walk(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)], default=d + 1) \
        if isinstance(v, (dict, list)) else d


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 20])
def test_json_nesting_ignores_strings_and_escapes_across_chunks(monkeypatch, chunk):
    monkeypatch.setattr(files, "_SCAN_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    pieces = ['[', ']', '{', '}', '"', '\\', '\\"', 'a', '[[[', '\\\\']

    def value(depth):
        kind = rng.integers(4) if depth < 12 else 3
        if kind == 0:
            return [value(depth + 1) for _ in range(rng.integers(0, 3))]
        if kind == 1:
            return {"".join(rng.choice(pieces, 3)): value(depth + 1) for _ in range(rng.integers(0, 3))}
        return "".join(rng.choice(pieces, rng.integers(0, 6)))
    for _ in range(40):
        v = value(0)
        text = json.dumps(v, ensure_ascii=False).encode()
        got, at = json_nesting(text)
        assert got == _depth_by_walk(v), text
        if got:
            assert text[at:at + 1] in (b"[", b"{")
    text = b'{"a": "[[[\\"[[[", "b\\\\": [[1]]}'
    assert json_nesting(text) == (3, text.index(b"[[1") + 1)


# ------------------------------------------------------------------------------- the bundle, verified


def make_bundle(path) -> None:
    meta = {"golden": {"prompts": 2, "ddtree": {"accuracies": [0.9, 0.3]}}, "decoding": {"max_new_tokens": 3},
            "model": {"vocab_size": 100},
            "hf_config": {"num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 8,
                          "num_experts_per_tok": 2}}
    write_bundle(path, [("w", np.arange(4096, dtype=np.float32)), ("prompt.p0.tokens", np.arange(4, dtype=np.int32)),
                        ("prompt.p1.tokens", np.arange(2, dtype=np.int32))], meta)
    write_record(path)


def test_verified_bundle_gives_the_expectations(tmp_path):
    make_bundle(tmp_path / "b.kdtr")
    assert expectations_from_bundle(tmp_path / "b.kdtr") == SCORE_EXPECT
    r = run_on(tmp_path, fake_engine(tmp_path, dump_with("")), expect=None, bundle=str(tmp_path / "b.kdtr"))
    assert r["status"] == "ok", r["reason"]


@pytest.mark.parametrize("damage, reason", [
    ("truncated", "failed verification, so the engine was not run"),
    ("flipped byte", "failed verification, so the engine was not run"),
    ("missing", "failed verification, so the engine was not run"),
    ("not a k2vec bundle", "metadata golden.prompts is None, expected a positive integer"),
])
def test_damaged_bundle_is_a_failed_row_and_the_engine_never_starts(tmp_path, damage, reason):
    b = tmp_path / "b.kdtr"
    make_bundle(b)
    data = bytearray(b.read_bytes())
    if damage == "truncated":
        b.write_bytes(data[: len(data) - 100])
    elif damage == "flipped byte":
        data[-200] ^= 0x01   # inside the tensor data: only its checksum can tell
        b.write_bytes(bytes(data))
    elif damage == "missing":
        b.unlink()
    else:
        write_bundle(b, [("w", np.zeros(4, np.float32))], {"x": 1})
        write_record(b)
    marker = tmp_path / "engine-ran"
    r = run_on(tmp_path, fake_engine(tmp_path, f"open({str(marker)!r}, 'w')\n" + dump_with("")), expect=None,
               bundle=str(b))
    assert r["status"] == "failed" and reason in r["reason"] and str(b) in r["reason"], r["reason"]
    assert not marker.exists()


# -------------------------------------------------------------------------- through the pipeline


HOSTILE = {"deep": "nests arrays/objects 200001 deep", "bigint": "holds a number the JSON reader refuses",
           "dir": "is a directory", "nanlogits": "result holds NaN", "floattok": "5.0 is not a JSON integer",
           "huge": "over the limit of 1,048,576"}


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    """A tiny config whose engines misbehave in every way, beside a good one, a detaching one and two
    sandboxed ones (where bubblewrap works): one plain `snakemake` run."""
    from conftest import REPO, copy_workflow, default_config, snakemake, write_config
    from k2vec.engines.isolation import sandbox_problem

    root = copy_workflow(tmp_path_factory.mktemp("hostile"))
    records = root / "records"
    records.mkdir()
    config = default_config()
    numpy_engine = config["engines"]["numpy"]
    config["models"] = {"tiny": config["models"]["tiny"]}
    config["prompts"]["count"] = 2
    config["decoding"]["max_new_tokens"] = 4
    config["decoding"]["ddtree"].update(budgets=[1], accuracies=[0.9])
    fake = REPO / "tests" / "engines" / "fake_engine.py"
    one = {"models": ["tiny"], "precisions": ["fp32"], "modes": ["greedy"]}
    # unsandboxed (they report to `records`, outside results/), but for `escape` and numpy below
    config["engines"] = {b: {"command": f"{{python}} {fake} {b} {records} --bundle {{bundle}} --mode {{mode}} "
                                        f"--budget {{budget}} --output {{output}}", **one, "sandbox": False}
                         for b in ["ok", "detach", *HOSTILE, *(["escape"] if sandbox_problem() is None else [])]}
    config["engines"]["huge"]["max_result_mb"] = 1
    if sandbox_problem() is None:
        config["engines"]["escape"]["sandbox"] = True
        config["engines"]["numpy"] = {**numpy_engine, **one, "sandbox": True}
    write_config(root / "config.yaml", config)
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env={"PYTHONPATH": str(root / "src")})
    assert res.returncode == 0, res.stderr[-4000:]
    return root, records


def result_of(root, engine):
    run_dir = root / "results" / "runs" / engine
    # nothing else left beside the result and its sha256 record
    assert sorted(f.name for f in run_dir.iterdir()) == ["tiny-fp32-greedy.json", "tiny-fp32-greedy.json.hmac",
                                                         "tiny-fp32-greedy.json.sha256"]
    return json.loads((run_dir / "tiny-fp32-greedy.json").read_text())


def test_hostile_engines_are_failed_rows_in_the_report_and_the_rest_completes(hostile_run):
    root, _ = hostile_run
    rows = pd.read_csv(root / "results" / "report" / "divergence.csv")
    for engine, reason in HOSTILE.items():
        r = result_of(root, engine)
        assert r["status"] == "failed" and reason in r["reason"], (engine, r["reason"])
        mine = rows[rows["engine"] == engine]
        assert len(mine) == 2 and (mine["class"] == "failed").all() and mine["reason"].str.contains(reason).all()
        assert (root / "results" / "scratch" / engine / "tiny-fp32-greedy").is_dir()   # kept for inspection
    for engine in ("ok", "detach"):
        assert result_of(root, engine)["status"] == "ok"
        assert not (root / "results" / "scratch" / engine / "tiny-fp32-greedy").exists()
    html = (root / "results" / "report" / "divergence.html").read_text()
    assert "nests arrays/objects 200001 deep" in html and "is a directory" in html


def test_detached_process_is_gone_after_the_run(hostile_run):
    root, records = hostile_run
    (pid,) = [r["pid"] for r in (json.loads(p.read_text()) for p in records.glob("*.json"))
              if r["behaviour"] == "detach"]
    marker = f"1000.{pid}".encode()
    alive = [p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(p)]
    assert alive == []
    assert result_of(root, "detach")["leftover_processes_killed"] == 1


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def test_sandboxed_engines_write_nothing_outside_and_a_real_engine_still_passes(hostile_run):
    from k2vec.engines.isolation import sandbox_problem

    if sandbox_problem() is not None:
        pytest.skip(f"bubblewrap cannot sandbox here: {sandbox_problem()}")
    root, _ = hostile_run
    r = result_of(root, "escape")
    assert r["status"] == "ok" and r["sandbox"] is True
    log = (root / "results" / "logs" / "runs" / "escape" / "tiny-fp32-greedy.engine.log").read_text()
    assert log.count("could not write") == 4 and "wrote " not in log, log
    assert "tampered" not in (root / "src" / "k2vec" / "__init__.py").read_text()
    assert "tampered" not in (root / "results" / "runs" / "ok" / "tiny-fp32-greedy.json").read_text()
    assert not (root / "results" / "planted.json").exists()
    # the numpy engine, sandboxed, still matches the golden exactly
    assert result_of(root, "numpy")["status"] == "ok"
    rows = pd.read_csv(root / "results" / "report" / "divergence.csv")
    assert (rows[rows["engine"] == "numpy"]["class"] == "exact").all() and len(rows[rows["engine"] == "numpy"]) == 2
