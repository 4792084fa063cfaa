"""Snakemake's params serialized without importing pandas where nothing else did.

To decide whether a job's params changed, Snakemake's persistence serializes each param value; where pandas is
installed it does so by `_serialize_param_pandas`, which imports pandas first (0.15 s on the 2-core VM, 15% of a dry
run of this workflow) to ask whether the value is a DataFrame, Series or Index. No value is one unless something in
the process imported pandas, so `install` makes that step import nothing while `pandas` is not in `sys.modules` and
serialize as Snakemake's pandas-free path does; once pandas is imported, Snakemake's own step runs. The strings it
returns are the same either way. Where the installed Snakemake has no such step, nothing is wrapped.

The same import, 0.3-0.45 s, waited in front of every run's first `script:` job: the preamble Snakemake writes into
a job's script holds the job's `snakemake` object, whose `_safely_store_params` imports pandas (and polars) to
convert params that are DataFrames or Series, and numpy arrays, into plain data. `install_script_params` stores
them as it does when no value needs converting (the params as they are, with their names) while neither pandas
nor polars is imported and no value is a numpy array; else Snakemake's own step runs.
"""

from __future__ import annotations

import functools
import sys

_WRAPPED = "__k2vec_lazy_pandas__"


def _target():
    """Snakemake's persistence class where it has the two serializers this wraps, else None."""
    try:
        import snakemake.persistence
    except ImportError:
        return None
    persistence = getattr(snakemake.persistence, "PersistenceBase", None) or getattr(
        snakemake.persistence, "Persistence", None)
    if persistence is None or not all(callable(getattr(persistence, name, None))
                                      for name in ("_serialize_param_pandas", "_serialize_param_builtin")):
        return None
    return persistence


def install() -> bool:
    """Wrap the pandas serializer as the module docstring says; True where it is wrapped (now or before)."""
    persistence = _target()
    if persistence is None:
        return False
    original = persistence._serialize_param_pandas
    if getattr(original, _WRAPPED, False):
        return True

    @functools.wraps(original)
    def serialize(self, value):
        if "pandas" not in sys.modules:     # no value can be a pandas object
            return self._serialize_param_builtin(value)
        return original(self, value)

    setattr(serialize, _WRAPPED, True)
    persistence._serialize_param_pandas = serialize
    return True


def _script_target():
    """Snakemake's module of the script object (`Snakemake`, with `_safely_store_params`, and `Params`), else None."""
    try:
        import snakemake.iocontainers as iocontainers
    except ImportError:
        return None
    script = getattr(iocontainers, "Snakemake", None)
    if script is None or not callable(getattr(script, "_safely_store_params", None)) \
            or getattr(iocontainers, "Params", None) is None:
        return None
    return iocontainers


def _nothing_to_convert(params) -> bool:
    """No value of `params` can be one that Snakemake converts: pandas and polars not imported, no numpy array."""
    if "pandas" in sys.modules or "polars" in sys.modules:
        return False
    numpy = sys.modules.get("numpy")
    return numpy is None or not any(isinstance(value, numpy.ndarray) for value in params)


def install_script_params() -> bool:
    """Wrap the script object's params store as the module docstring says; True where it is wrapped."""
    iocontainers = _script_target()
    if iocontainers is None:
        return False
    script = iocontainers.Snakemake
    original = script._safely_store_params
    if getattr(original, _WRAPPED, False):
        return True

    @functools.wraps(original)
    def store(self, params):
        if not _nothing_to_convert(params):
            return original(self, params)
        self._params_store = iocontainers.Params(toclone=list(params))
        self._params_types = {}
        self._params_store._take_names(params._get_names())

    setattr(store, _WRAPPED, True)
    script._safely_store_params = store
    return True
