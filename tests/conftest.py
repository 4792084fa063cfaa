import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def default_config() -> dict:
    return yaml.safe_load((REPO / "config.yaml").read_text())


def snakemake(*args: str, cwd: Path, snakefile: Path | None = None, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the snakemake CLI of this interpreter's environment; never raises on a non-zero exit."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile or REPO / "Snakefile"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def copy_workflow(dest: Path) -> Path:
    """A private copy of the workflow and package, so a test may edit sources without touching the repo."""
    for item in ("Snakefile", "config.yaml", "profiles", "workflow", "src"):
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, dest / item, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dest / item)
    return dest


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def config() -> dict:
    return default_config()


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    """The default config's whole pipeline (about 2 minutes), run once per session for every test that reads
    it (test_pipeline.py, test_judge.py): (root, env). results/report is rerun by later tests with other
    engines; default-report/ keeps the default run's."""
    root = copy_workflow(tmp_path_factory.mktemp("pipeline"))
    env = {"PYTHONPATH": str(root / "src")}
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    shutil.copytree(root / "results/report", root / "default-report")
    return root, env
