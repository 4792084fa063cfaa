import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
# The pipeline runs the float64 reference on one BLAS thread (the golden rule's threads, the numpy engine's command in
# config.yaml); a test that decodes in its own process and compares with the pipeline's results needs the same:
# OpenBLAS's threaded GEMM rounds some shapes differently on some CPUs (seen on an AMD EPYC, in the numpy engine's
# greedy logits). Set before anything imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# Test files that read the session's `pipeline` fixture (the default run, ~2 minutes): under pytest-xdist (-n, as
# `make test` runs) they share a worker, so that it is built once (pytest_collection_modifyitems keeps the list
# complete).
PIPELINE_FILES = {"test_judge", "test_native_engine", "test_pipeline"}


def worker_scope(nodeid: str) -> str:
    """What runs whole on one xdist worker: a test's file (its module fixtures are built once), the PIPELINE_FILES
    as one."""
    path = nodeid.split("::", 1)[0]
    return "pipeline" if Path(path).stem in PIPELINE_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Tests dealt out by worker_scope. (xdist's own xdist_group marks do not reach its scheduler under pytest
    9.2, whose node ids no longer come from the `_nodeid` that xdist 3.8 rewrites.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ScopeScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per usable core, at most 8 (each imports torch; the heaviest scope takes minutes alone)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable, 8))


def pytest_collection_modifyitems(config, items):
    """A test file reading `pipeline` outside PIPELINE_FILES would build the default run again on its worker."""
    strays = sorted({item.path.name for item in items if "pipeline" in getattr(item, "fixturenames", ())
                     and item.path.stem not in PIPELINE_FILES})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use(s) the `pipeline` fixture: add to tests/conftest.py's "
                                f"PIPELINE_FILES so that a parallel run builds it once")


def bench_module(name: str):
    """bench/<name>.py imported as a module (bench/ is not a package), registered in sys.modules while the test
    session lasts (a dataclass looks its module up there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def default_config() -> dict:
    return yaml.safe_load((REPO / "config.yaml").read_text())


def snakemake(*args: str, cwd: Path, snakefile: Path | None = None, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the snakemake CLI of this interpreter's environment; never raises on a non-zero exit. `env` is
    laid over this process's environment; a variable set to None there is removed."""
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile or REPO / "Snakefile"), *args]
    environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environ)


def copy_workflow(dest: Path) -> Path:
    """A private copy of the workflow and package, so a test may edit sources without touching the repo."""
    for item in ("Snakefile", "config.yaml", "profiles", "workflow", "src", "engines", "include"):
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


def fake_nvidia_smi(bin_dir: Path, n_gpus: int) -> Path:
    """A directory holding an `nvidia-smi` that lists `n_gpus` H200s (fails, as without a driver, for 0),
    to put first on PATH: a GPU node as the pipeline and README's commands see one."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{i}, NVIDIA H200, GPU-{i:04d}aaaa-0000-0000-0000-000000000000\\n" for i in range(n_gpus))
    indices = "".join(f"{i}\\n" for i in range(n_gpus))
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + ('echo "NVIDIA-SMI has failed" >&2; exit 9\n' if not n_gpus else
                      f'case "$*" in\n  *index,name,uuid*) printf "{rows}";;\n  *) printf "{indices}";;\nesac\n'))
    script.chmod(0o755)
    return bin_dir


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
