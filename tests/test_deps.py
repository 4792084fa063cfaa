"""k2vec.pipeline.code_digest: the code a stage declares (import closure) and the digest of its meaning."""
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from k2vec.pipeline.code_digest import PACKAGE_DIR, code_digest, module_sources, with_imports

MODULE = '''"""A module docstring."""
import os


def f(x):
    """Its docstring."""
    return x + 1  # a comment
'''


def digest_of(tmp_path, text, name="m.py"):
    path = tmp_path / name
    path.write_text(text)
    return code_digest([str(path)], str(tmp_path))


def test_digest_ignores_comments_docstrings_and_layout(tmp_path):
    base = digest_of(tmp_path, MODULE)
    assert digest_of(tmp_path, MODULE.replace("# a comment", "# another comment\n# and more")) == base
    assert digest_of(tmp_path, MODULE.replace("Its docstring.", "Reworded.")) == base
    assert digest_of(tmp_path, MODULE.replace('"""A module docstring."""\n', "")) == base
    assert digest_of(tmp_path, MODULE.replace("x + 1", "(x\n            + 1)")) == base


def test_digest_changes_with_code(tmp_path):
    base = digest_of(tmp_path, MODULE)
    assert digest_of(tmp_path, MODULE.replace("x + 1", "x + 2")) != base
    assert digest_of(tmp_path, MODULE + "\n\ndef g():\n    return 0\n") != base
    # the same meaning under another name is another file
    assert digest_of(tmp_path, MODULE, "n.py") != base


def test_docstrings_count_where_the_module_reads_them(tmp_path):
    text = MODULE + "\nHELP = __doc__\n"
    assert digest_of(tmp_path, text.replace("A module", "Another")) != digest_of(tmp_path, text)


def test_non_python_files_count_by_bytes(tmp_path):
    assert digest_of(tmp_path, "x = (", "k.py") != digest_of(tmp_path, "x = ( ", "k.py")
    assert digest_of(tmp_path, "// c", "k.cu") != digest_of(tmp_path, "// d", "k.cu")


def test_a_moved_checkout_has_the_same_digest(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b" / "deeper"
    for root in (a, b):
        (root / "src").mkdir(parents=True)
        (root / "src" / "m.py").write_text(MODULE)
    assert code_digest([str(a / "src/m.py")], str(a)) == code_digest([str(b / "src/m.py")], str(b))


def _names(paths):
    return {str(Path(p).relative_to(PACKAGE_DIR.parent)) for p in paths}


def test_fp32_stages_do_not_declare_the_quantizer():
    for stage in ("k2vec.stages.golden", "k2vec.stages.bundle"):
        fp32 = _names(module_sources(stage, without=("k2vec.model.int4_checkpoint",)))
        int4 = _names(module_sources(stage))
        assert "k2vec/model/int4.py" not in fp32 and "k2vec/model/int4_checkpoint.py" not in fp32
        assert {"k2vec/model/int4.py", "k2vec/model/int4_checkpoint.py"} <= int4


def test_leaving_out_a_module_imported_at_load_time_is_an_error():
    # int4_checkpoint imports the quantizer when it loads: a stage running it runs the quantizer
    with pytest.raises(ValueError, match="int4_checkpoint.py imports k2vec.model.int4 at module level"):
        module_sources("k2vec.model.int4_checkpoint", without=("k2vec.model.int4",))


@pytest.mark.parametrize("modules, without", [
    (("k2vec.stages.golden", "k2vec.config.cases", "k2vec.pipeline.stage"), ("k2vec.model.int4_checkpoint",)),
    (("k2vec.stages.bundle", "k2vec.config.cases", "k2vec.pipeline.stage"), ("k2vec.model.int4_checkpoint",)),
    (("k2vec.stages.weights", "k2vec.config.cases", "k2vec.pipeline.stage"), ()),
    (("k2vec.report", "k2vec.pipeline.stage"), ()),
])
def test_declared_code_covers_what_importing_the_stage_loads(modules, without):
    """Importing a stage's modules in a fresh interpreter loads no package file it does not declare."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
            " if n.split('.')[0] == 'k2vec' and getattr(m, '__file__', None))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(PACKAGE_DIR.parent)})
    loaded = _names(json.loads(res.stdout))
    assert loaded <= _names(module_sources(*modules, without=without))
    if without:
        assert "k2vec/model/int4.py" not in loaded


# ------------------------------------------------------------------ files a module reads beside itself

@dataclass(frozen=True)
class DataCase:
    name: str
    line: str
    found: bool


DATA_CASES = [
    DataCase("with_name, a literal", 'SOURCE = Path(__file__).with_name("kernel.cu")', True),
    DataCase("parent / a literal", 'SCHEMA = Path(__file__).parent / "kernel.cu"', True),
    DataCase("inside a function", 'def f():\n    return Path(__file__).with_name("kernel.cu").read_text()', True),
    DataCase("a name, not a literal", 'NAME = "kernel.cu"\nSOURCE = Path(__file__).with_name(NAME)', False),
    DataCase("another path's neighbour", 'SOURCE = Path("/elsewhere/x.py").with_name("kernel.cu")', False),
    DataCase("a named file that is not there", 'SOURCE = Path(__file__).with_name("missing.cu")', False),
]


@pytest.mark.parametrize("case", DATA_CASES, ids=[c.name for c in DATA_CASES])
def test_data_files_a_module_names(tmp_path, case):
    from k2vec.pipeline.code_digest import _data_files
    (tmp_path / "kernel.cu").write_text("// a kernel\n")
    module = tmp_path / "m.py"
    module.write_text(f"from pathlib import Path\n{case.line}\n")
    assert _data_files(module) == ([str(tmp_path / "kernel.cu")] if case.found else [])


def _package_files():
    return {p for p in PACKAGE_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and not p.name.startswith(".")}


def test_every_data_file_of_the_package_is_read_by_a_module():
    """A file in the package that no module names beside itself (Path(__file__).with_name) would be in no stage's or
    engine's code: an edit of it would rerun nothing."""
    modules = [".".join(p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts).removesuffix(".__init__")
               for p in _package_files() if p.suffix == ".py"]
    data = {p for p in _package_files() if p.suffix != ".py"}
    assert data, "the package ships data files (a CUDA kernel, a schema)"
    assert data <= {Path(p) for p in module_sources(*modules)}


def test_the_runner_s_code_covers_the_result_schema():
    assert PACKAGE_DIR / "engines/contract/result.schema.json" in {Path(p) for p in module_sources(
        "k2vec.engines.runner")}


def _shipped_python_engines():
    import yaml
    from k2vec.config.engines import source_glob
    config = yaml.safe_load((PACKAGE_DIR.parents[1] / "config.yaml").read_text())
    out = {}
    for name, entry in config["engines"].items():
        m = re.search(r"-m (k2vec\.engines\.[\w.]+)", entry["command"])
        if m:
            files = [f for pattern in entry["sources"]
                     for f in source_glob(pattern, str(PACKAGE_DIR.parents[1]), f"engines.{name}.sources")]
            main = m.group(1) if m.group(1).endswith("_engine") else f"{m.group(1)}.__main__"   # what -m runs
            out[name] = (main, [f for f in files if f.endswith(".py")])
    return out


PYTHON_ENGINES = _shipped_python_engines()


@pytest.mark.parametrize("engine", sorted(PYTHON_ENGINES))
def test_an_engine_s_code_covers_what_its_module_runs(engine):
    """What an engine's runs are rerun by (common.smk engine_code: its Python sources with_imports) holds every
    package file its module imports or reads: the GPU engines' CUDA kernel source among them."""
    main, python = PYTHON_ENGINES[engine]
    covered = {Path(p) for p in with_imports(python)}
    assert {Path(p) for p in module_sources(main)} <= covered
    if main == "k2vec.engines.gpu_triton.__main__":
        assert PACKAGE_DIR / "engines/gpu_triton/kernels/w4a16_cuda.cu" in covered


@pytest.mark.parametrize("engine, needs", [("numpy", ()), ("gpu_bf16", ("torch", "triton"))])
def test_importing_an_engine_loads_nothing_its_code_leaves_out(engine, needs):
    for name in needs:
        pytest.importorskip(name)
    main, python = PYTHON_ENGINES[engine]
    code = ("import importlib, json, sys\n"
            f"importlib.import_module({main!r})\n"
            "print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()"
            " if n.split('.')[0] == 'k2vec' and getattr(m, '__file__', None))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)})
    assert _names(json.loads(res.stdout)) <= _names(with_imports(python))


def test_an_engine_s_own_python_outside_the_package_stands_for_itself(tmp_path):
    """A user's engine file (not a module of the package): digested as it is, its imports not followed."""
    mine = tmp_path / "my_engine.py"
    mine.write_text("import k2vec.reference.model\n")
    assert with_imports([str(mine)]) == [str(mine)]
