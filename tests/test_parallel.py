"""The parallel suite (`make test` runs pytest-xdist with -n auto): what runs whole on one worker, and the guard that
keeps the default run's session fixture built once."""
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import REPO, worker_scope


@dataclass(frozen=True)
class Scope:
    name: str
    a: str
    b: str
    same: bool


SCOPES = [
    Scope("one file", "tests/test_workflow.py::test_a", "tests/test_workflow.py::test_b[x-1]", True),
    Scope("two files", "tests/test_workflow.py::test_a", "tests/test_resume.py::test_a", False),
    Scope("the default run's readers", "tests/test_judge.py::test_a", "tests/test_pipeline.py::test_b[numpy]", True),
    Scope("native engine with the default run", "tests/test_native_engine.py::T::test_c", "tests/test_judge.py::d",
          True),
    Scope("a reader and another file", "tests/test_pipeline.py::test_a", "tests/test_report_html.py::test_a", False),
]


@pytest.mark.parametrize("case", SCOPES, ids=[s.name for s in SCOPES])
def test_worker_scope(case):
    assert (worker_scope(case.a) == worker_scope(case.b)) is case.same


def test_a_new_reader_of_the_default_run_is_refused_until_listed(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "tests" / "test_new.py").write_text("def test_reads(pipeline):\n    pass\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_new.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "test_new.py use(s) the `pipeline` fixture" in res.stdout + res.stderr
