"""A directory of content-addressed cache entries, shared by the results' parses (engines/contract/result_cache.py,
put by the runners and the report) and the report's plots (report/plot_cache.py).

An entry is the file `<key>.<sha256 of its bytes>.<suffix>`: it is returned only where its bytes still give that
digest (a damaged one counts as absent and is written again), it is written under its final name whole or not
at all (so several processes may put entries at once), and `prune` removes every entry of the suffix that this
process did not get or put, so the directory holds the last report's entries only.

`cache_dir` is where an engine keeps what outlives a run (XDG_CACHE_HOME: a sandboxed run's is results/cache/<engine>).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from k2vec.atomic import write_bytes_atomic


def cache_dir(name: str) -> Path | None:
    """$XDG_CACHE_HOME (else ~/.cache)/`name`, made if need be; None where it cannot be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


class EntryStore:
    def __init__(self, directory: str | os.PathLike, suffix: str):
        self.directory = Path(directory)
        self.suffix = suffix
        self.used: set[Path] = set()
        self._listed: dict[str, list[Path]] | None = None

    def _stored(self, key: str) -> list[Path]:
        if self._listed is None:   # one listing of the directory per process
            self._listed = {}
            if self.directory.is_dir():
                for path in self.directory.glob(f"*.{self.suffix}"):
                    self._listed.setdefault(path.name.split(".", 1)[0], []).append(path)
        return self._listed.get(key, [])

    def get(self, key: str) -> bytes | None:
        """The bytes kept under `key`, None where there are none that match their digest."""
        for path in self._stored(key):
            data = path.read_bytes()
            if path.name == self._name(key, data):
                self.used.add(path)
                return data
        return None

    def put(self, key: str, data: bytes) -> None:
        path = self.directory / self._name(key, data)
        write_bytes_atomic(path, data)
        self._stored(key)   # the listing made before the entry is added to it
        self._listed.setdefault(key, []).append(path)
        self.used.add(path)

    def prune(self) -> None:
        """Remove every entry this process did not use."""
        if self.directory.is_dir():
            for path in self.directory.glob(f"*.{self.suffix}"):
                if path not in self.used:
                    path.unlink(missing_ok=True)

    def _name(self, key: str, data: bytes) -> str:
        return f"{key}.{hashlib.sha256(data).hexdigest()}.{self.suffix}"
