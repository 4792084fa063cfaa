"""The run wrapper under hostile conditions, and what it records about each run (GPU identity, times)."""
import json
import os
import sys
import textwrap
import time

import pandas as pd
import pytest

from test_report_metrics import make_goldens
from test_runner import EXPECT, fake_engine, good_result

from k2vec.engines.runner import run_engine
from k2vec.gpus import identify, short_uuid
from k2vec.report import build_report
from k2vec.report.synthetic import perfect_result

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


def run_on(tmp_path, command, gpus=0, devices=(), timeout_s=10.0):
    out = tmp_path / "results" / "run.json"
    result = run_engine(engine="fake", command=command, bundle="b.kdtr", mode="greedy", output=str(out),
                        expect=EXPECT, gpus=gpus, devices=list(devices), lock_dir=str(tmp_path / "locks"),
                        timeout_s=timeout_s, stderr_path=str(tmp_path / "stderr.log"))
    assert json.loads(out.read_text()) == result
    return result


# An engine that writes a good result and records, beside it, what it saw and when it ran.
SEES = (f"seen = {{'t': time.time(), 'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), "
        f"'order': os.environ.get('CUDA_DEVICE_ORDER')}}\n"
        f"json.dump(seen, open(os.path.join(os.path.dirname(out), '..', 'seen.json'), 'w'))\n"
        f"time.sleep(0.2)\njson.dump({good_result()!r}, open(out, 'w'))\n")


# ---------------------------------------------------------------------------- GPU identity and timing


def test_gpu_run_records_the_physical_gpu_and_its_times(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch)
    r = run_on(tmp_path, fake_engine(tmp_path, SEES), gpus=1, devices=["1"])
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
