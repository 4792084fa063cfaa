"""k2vec.pipeline.lazy_pandas: Snakemake's params serialized without importing pandas where nothing else did."""
import subprocess
import sys

from k2vec.pipeline import lazy_pandas


class FakePersistence:
    """Snakemake's two param serializers; the pandas one counts its calls."""
    calls = 0

    def _serialize_param_builtin(self, value):
        return repr(value) if isinstance(value, (str, int, float, list, dict)) else "UNREPRESENTABLE"

    def _serialize_param_pandas(self, value):
        FakePersistence.calls += 1
        import pandas as pd
        if isinstance(value, pd.DataFrame):
            return repr(pd.util.hash_pandas_object(value).tolist())
        return self._serialize_param_builtin(value)


def test_once_pandas_is_imported_snakemakes_own_step_serializes(monkeypatch):
    import pandas as pd
    monkeypatch.setattr(lazy_pandas, "_target", lambda: FakePersistence)
    monkeypatch.setattr(FakePersistence, "_serialize_param_pandas", FakePersistence._serialize_param_pandas)
    monkeypatch.setattr(FakePersistence, "calls", 0)
    frame = pd.DataFrame({"a": [1, 2]})
    values = ["results/x.kdtr", 3, [1, 2], object(), frame]
    plain = [FakePersistence()._serialize_param_pandas(v) for v in values]
    assert lazy_pandas.install() and lazy_pandas.install()      # a second install wraps nothing twice
    FakePersistence.calls = 0
    assert [FakePersistence()._serialize_param_pandas(v) for v in values] == plain
    assert FakePersistence.calls == len(values)
    assert plain[-1] == repr(pd.util.hash_pandas_object(frame).tolist())


def test_the_installed_snakemake_serializes_params_without_importing_pandas():
    """With the installed Snakemake: wrapped, the strings of its pandas-free path, and pandas never imported for them
    (a fresh process, since this one may have imported pandas already)."""
    code = """
import functools, sys, types
from k2vec.pipeline import lazy_pandas
assert lazy_pandas._target() is not None and lazy_pandas.install()
import snakemake.persistence as p
cls = getattr(p, "PersistenceBase", None) or p.Persistence
assert getattr(cls._serialize_param_pandas, lazy_pandas._WRAPPED)
self = types.SimpleNamespace()
self._serialize_param_builtin = functools.partial(cls._serialize_param_builtin, self)
values = ["results/bundles/tiny-int4.kdtr", 600, 1e-3, ["greedy", "score"], {"gpus": 0}, None, object()]
got = [cls._serialize_param_pandas(self, v) for v in values]
assert "pandas" not in sys.modules, "pandas imported"
assert got == [cls._serialize_param_builtin(self, v) for v in values], got
assert got[0] == repr(values[0])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
