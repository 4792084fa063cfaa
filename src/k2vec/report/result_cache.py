"""The engine results a report reads, parsed once per content.

A greedy or score result holds its hidden-state fingerprints and top-k logits as JSON text (2 MB for a small
bundle's four prompts); parsing the default run's 64 results is a third of the report's time, and after an edit
of the report, or of one engine, most of them are the bytes the last report parsed. Each parse is kept as
`<key>.<sha256 of the entry>.marshal`, the key the sha256 of the Python version and the result's bytes:
marshal holds JSON's types exactly, loads them ~9x faster than json and runs no code when it does. An entry is
read only where its name's digest holds (a damaged one is parsed again), and the cache keeps the entries of the
last report only (`prune`). Every load parses afresh from the entry, so no caller shares another's objects.
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import sys
from pathlib import Path
from typing import Any

from k2vec.atomic import write_bytes_atomic

_VERSION = f"{sys.version}\0marshal {marshal.version}\0".encode()


class ResultCache:
    """`load(path)`: the JSON of `path`, as json.load gives it (and raising as it does); `directory` None parses
    every time."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else Path(directory)
        self.used: set[Path] = set()
        self._entries: dict[str, list[Path]] | None = None

    def _stored(self, key: str) -> list[Path]:
        if self._entries is None:   # one listing of the directory per report
            self._entries = {}
            if self.directory is not None and self.directory.is_dir():
                for path in self.directory.glob("*.marshal"):
                    self._entries.setdefault(path.name.split(".", 1)[0], []).append(path)
        return self._entries.get(key, [])

    def load(self, path: str | os.PathLike) -> Any:
        data = Path(path).read_bytes()
        if self.directory is None:
            return json.loads(data)
        key = hashlib.sha256(_VERSION + data).hexdigest()
        for entry in self._stored(key):
            stored = entry.read_bytes()
            if entry.name == f"{key}.{hashlib.sha256(stored).hexdigest()}.marshal":
                self.used.add(entry)
                return marshal.loads(stored)
        value = json.loads(data)
        stored = marshal.dumps(value)
        entry = self.directory / f"{key}.{hashlib.sha256(stored).hexdigest()}.marshal"
        write_bytes_atomic(entry, stored)
        self._entries.setdefault(key, []).append(entry)
        self.used.add(entry)
        return value

    def prune(self) -> None:
        """Remove every entry this report did not use."""
        if self.directory is None or not self.directory.is_dir():
            return
        for path in self.directory.glob("*.marshal"):
            if path not in self.used:
                path.unlink(missing_ok=True)
