"""Engine results parsed once per content: the runner leaves the parse of each result it writes, the report reads it.

A greedy or score result holds its hidden-state fingerprints and top-k logits as JSON text (2 MB for a small
bundle's four prompts); parsing the default run's 64 results is a third of the report's time, and after an edit
of the report, or of one engine, most of them are the bytes the last report parsed. Each parse is kept as
`<key>.<sha256 of the entry>.marshal` (k2vec/entry_store.py), the key the sha256 of the Python version and the
result's bytes: marshal holds JSON's types exactly, loads them ~9x faster than json and runs no code when it
does. A damaged entry is parsed again, and the cache keeps the entries of the last report only (`prune`). Every
load parses afresh from the entry, so no caller shares another's objects.

The runner (k2vec.engines.runner) parses each result it has just written into the cache of its results directory
(`report_cache_dir`), while the other engine jobs still run, so that the report, which runs after all of them,
finds the parses of an edited engine's results ready. The entry is the parse of the written bytes, as the report
would make it; an engine, sandboxed away from the results directory, never reaches it.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import sys
from pathlib import Path
from typing import Any

from k2vec.entry_store import EntryStore

_VERSION = f"{sys.version}\0marshal {marshal.version}\0".encode()


def report_cache_dir(results_dir: str | os.PathLike) -> Path:
    """Where the report of `results_dir` keeps what a later report reuses: these parses and its plots
    (k2vec/report/plot_cache.py)."""
    return Path(results_dir) / "report-cache"


class ResultCache:
    """`load(path)`: the JSON of `path`, as json.load gives it (and raising as it does); `directory` None parses
    every time."""

    def __init__(self, directory: str | os.PathLike | None):
        self.store = None if directory is None else EntryStore(directory, "marshal")

    def load(self, path: str | os.PathLike) -> Any:
        return self.parse(Path(path).read_bytes())

    def parse(self, data: bytes) -> Any:
        """json.loads(data), from the cache where it holds the parse of these bytes, else parsed and kept."""
        if self.store is None:
            return json.loads(data)
        key = hashlib.sha256(_VERSION + data).hexdigest()
        stored = self.store.get(key)
        if stored is not None:
            return marshal.loads(stored)
        value = json.loads(data)
        self.store.put(key, marshal.dumps(value))
        return value

    def prune(self) -> None:
        """Remove every entry this report did not use."""
        if self.store is not None:
            self.store.prune()
