"""k2vec.pipeline.code_digest: the code a stage declares (import closure) and the digest of its meaning."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k2vec.pipeline.code_digest import PACKAGE_DIR, code_digest, module_sources

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
