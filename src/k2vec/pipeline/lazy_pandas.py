"""Snakemake's params serialized without importing pandas where nothing else did.

To decide whether a job's params changed, Snakemake's persistence serializes each param value; where pandas is
installed it does so by `_serialize_param_pandas`, which imports pandas first (0.15 s on the 2-core VM, 15% of a dry
run of this workflow) to ask whether the value is a DataFrame, Series or Index. No value is one unless something in
the process imported pandas, so `install` makes that step import nothing while `pandas` is not in `sys.modules` and
serialize as Snakemake's pandas-free path does; once pandas is imported, Snakemake's own step runs. The strings it
returns are the same either way. Where the installed Snakemake has no such step, nothing is wrapped.
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
