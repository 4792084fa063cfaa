"""The report's plots, drawn once per content: PNGs kept by a key of what they show and of the code that draws them.

Drawing the six plots is most of the report's time (matplotlib's layout and text, ~5 s on 2 cores), yet an
edit of the report's tables, HTML or verdict rules, or a rerun that changed nothing they plot, draws the
same pixels again. A plot's key is the sha256 of its name, the meaning of the code that draws it
(k2vec.pipeline.code_digest: PLOT_CODE, the plots module and the package modules it imports), the versions of
matplotlib, numpy and pandas, and the pickled arguments; its PNG is kept as `<key>.<sha256 of the PNG>.png`
(k2vec/entry_store.py; a damaged file is drawn again). The runs' clock columns are taken out of
what a plot is given (CLOCK_COLUMNS). The cache keeps the entries of the last report only. The bytes written are those a
fresh drawing gives (tests/test_report_plot_cache.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pickle
from typing import Any

import numpy as np
import pandas as pd

from k2vec.pipeline.code_digest import PACKAGE_DIR, code_digest
from k2vec.entry_store import EntryStore

# The code that draws the plots: the plots module and the package modules it imports, not the packages'
# __init__ modules (importing k2vec.report.plots runs k2vec/report/__init__.py, hence the metrics, which no plot
# calls: their output reaches a plot as its arguments). tests/test_report_plot_cache.py keeps the list whole.
PLOT_CODE = ("k2vec.report.plots", "k2vec.report.classes", "k2vec.report.figures", "k2vec.report.words")
# A run's clock (metrics.py's run columns): different on every run of the same code, and drawn by no plot. They are
# taken out of what a plot is given, so that a rerun that changed only them draws nothing, and a plot that read
# them would fail at once rather than be kept stale.
CLOCK_COLUMNS = ("tokens_per_s", "decode_tokens_per_s", "wall_s")


def _without_clock(value: Any) -> Any:
    if isinstance(value, pd.DataFrame):
        return value.drop(columns=[c for c in CLOCK_COLUMNS if c in value.columns])
    return value


def plot_code_files() -> list[str]:
    return [str(PACKAGE_DIR.joinpath(*m.split(".")[1:]).with_suffix(".py")) for m in PLOT_CODE]


def _code_key() -> str:
    return code_digest(plot_code_files(), str(PACKAGE_DIR.parent))


def _draw(name: str, *args: Any) -> bytes:
    from k2vec.report import plots   # matplotlib, imported only when a plot is drawn

    return getattr(plots, name)(*args)


class PlotCache:
    """Draw through `draw(name, *args)`, `name` a plot of report/plots.py; `directory` None draws every time."""

    def __init__(self, directory: str | os.PathLike | None):
        self.store = None if directory is None else EntryStore(directory, "png")
        self._prefix = None
        if self.store is not None:
            versions = (f"matplotlib {importlib.metadata.version('matplotlib')} numpy {np.__version__} "
                        f"pandas {pd.__version__}")
            self._prefix = f"{_code_key()}\0{versions}\0".encode()

    def draw(self, name: str, *args: Any) -> bytes:
        args = tuple(_without_clock(a) for a in args)
        if self.store is None:
            return _draw(name, *args)
        try:
            data = pickle.dumps(args, protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError):
            return _draw(name, *args)
        key = hashlib.sha256(self._prefix + name.encode() + b"\0" + data).hexdigest()
        png = self.store.get(key)
        if png is None:
            png = _draw(name, *args)
            self.store.put(key, png)
        return png

    def prune(self) -> None:
        """Remove every entry this report did not use."""
        if self.store is not None:
            self.store.prune()
