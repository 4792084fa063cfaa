"""Put on PYTHONPATH, with K2VEC_HIDE_MODULES=torch,triton: this interpreter and every one it starts
behave as if those packages were not installed (an environment without the GPU extra), without
building one. `importlib.util.find_spec` answers None for them, as for an absent package, and
importing them fails as it would there."""
import importlib.abc
import importlib.util
import os
import sys

_HIDDEN = {m for m in os.environ.get("K2VEC_HIDE_MODULES", "").split(",") if m}
_find_spec = importlib.util.find_spec


def _hidden(name: str) -> bool:
    return name.split(".")[0] in _HIDDEN


def find_spec(name, package=None):
    return None if _hidden(name) else _find_spec(name, package)


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _hidden(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


importlib.util.find_spec = find_spec
sys.meta_path.insert(0, _Absent())
