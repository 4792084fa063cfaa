"""An engine's build step that fails or runs past build_timeout_s: the error names the engine, the
step and the log, no stamp is written, and nothing the build started is left running."""
import logging
import os
import time

import pytest

from conftest import default_config, snakemake, write_config
from k2vec.engines.build import BuildError, build_engine

FAILING = "echo compiling gemm.cu; echo 'gemm.cu:12: error: expected ;' >&2; exit 3"


def test_failing_build_names_engine_step_and_log(tmp_path, caplog):
    stamp, log_path = tmp_path / "build.stamp", tmp_path / "build.log"
    with caplog.at_level(logging.INFO, logger="k2vec.engine_build"), pytest.raises(BuildError) as err:
        build_engine("mycc", FAILING, [], str(stamp), log_path=str(log_path), timeout_s=30)
    assert str(err.value) == f"engine 'mycc': build command exited with code 3: {FAILING} (see {log_path})"
    assert not stamp.exists()
    assert "gemm.cu:12: error: expected ;" in caplog.text   # the compiler's words reach the build log


def test_timed_out_build_is_killed_with_its_children(tmp_path):
    stamp, pidfile = tmp_path / "build.stamp", tmp_path / "cc.pid"
    command = f"sleep 60 & echo $! > {pidfile}; wait"   # a compiler started by the build script
    t = time.monotonic()
    with pytest.raises(BuildError) as err:
        build_engine("slowcc", command, [], str(stamp), log_path="build.log", timeout_s=1)
    assert time.monotonic() - t < 10
    assert str(err.value) == f"engine 'slowcc': build command timed out after 1 s (killed): {command} (see build.log)"
    assert not stamp.exists()
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while os.path.exists(f"/proc/{pid}") and b") Z" not in open(f"/proc/{pid}/stat", "rb").read():
        assert time.monotonic() < deadline, "the build's child outlived its time limit"
        time.sleep(0.02)


def test_failing_build_step_as_snakemake_reports_it(tmp_path):
    config = default_config()
    config["engines"] = {"mycc": {"command": "run {bundle} {output}", "build": FAILING}}
    cfg = write_config(tmp_path / "user.yaml", config)
    res = snakemake("--cores", "1", "results/engines/mycc/build.stamp", "--directory", str(tmp_path),
                    "--configfile", str(cfg), "--replace-workflow-config", cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert (f"BuildError: engine 'mycc': build command exited with code 3: {FAILING} "
            f"(see results/logs/engines/mycc/build.log)") in out, out[-3000:]
    assert "gemm.cu:12: error: expected ;" in (tmp_path / "results/logs/engines/mycc/build.log").read_text()
    assert not (tmp_path / "results/engines/mycc/build.stamp").exists()
