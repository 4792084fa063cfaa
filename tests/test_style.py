"""The code stays as the community tools want it: ruff's lint (pyproject.toml [tool.ruff]) on the Python,
snakefmt on the Snakefile and the rule files. `ruff check --fix .` and `snakefmt Snakefile workflow/rules`
fix most of what these report."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_finds_nothing():
    res = run("ruff", "check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_snakefmt_would_change_nothing():
    res = run("snakefmt", "--check", "Snakefile", "workflow/rules")
    assert res.returncode == 0, res.stdout + res.stderr
