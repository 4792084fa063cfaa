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


def test_a_script_jobs_params_are_stored_as_snakemake_stores_them_without_importing_pandas():
    """The installed Snakemake's script object: plain params stored byte for byte (pickled) as its own step stores
    them, without importing pandas; a numpy array, and once pandas is imported a DataFrame, are converted by its
    own step (a fresh process, since this one may have imported pandas already)."""
    code = """
import pickle, sys, types
from k2vec.pipeline import lazy_pandas
assert lazy_pandas._script_target() is not None and lazy_pandas.install_script_params()
assert lazy_pandas.install_script_params()   # a second install wraps nothing twice
import snakemake.iocontainers as io
store = io.Snakemake._safely_store_params
assert getattr(store, lazy_pandas._WRAPPED) and not getattr(store.__wrapped__, lazy_pandas._WRAPPED, False)

def params(*values, names=("code", "runs")):
    p = io.Params(list(values))
    for i, name in enumerate(names[:len(values)]):
        p._set_name(name, i)
    return p

def stored(method, p):
    job = types.SimpleNamespace()
    method(job, p)
    return pickle.dumps(vars(job))

plain = params("code-meaning-2:ab12", [{"engine": "numpy", "mode": "greedy"}], 600, 1e-3, None)
fast = stored(store, plain)
assert "pandas" not in sys.modules, "pandas imported"
import numpy as np
array = params("x", np.arange(3))
assert pickle.loads(stored(store, array))["_params_types"] == {1: "np.ndarray"}
assert "pandas" in sys.modules   # Snakemake's own step ran for the array, and it imports pandas
import pandas as pd
assert fast == stored(store.__wrapped__, plain)
frame = params("x", pd.DataFrame({"a": [1]}))
assert pickle.loads(stored(store, frame))["_params_types"] == {1: "pd.DataFrame"}
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
