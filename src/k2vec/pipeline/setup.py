"""What the Snakefile sets up when it is parsed: the checkout's package for every job, and a plain
rerun after a killed run (what dead runs left in the working directory is cleared).

Snakemake writes its lock as `.snakemake/locks/{n}.input.lock` / `{n}.output.lock` (lists of paths,
no owner) and removes them on exit; a SIGKILLed run leaves them, and Snakemake then refuses every
later run until `--unlock`. It never records who took a lock, so each Snakemake process that parses
the Snakefile holds an flock on `.snakemake/k2vec-owners/{pid}.lock` for its whole life (the kernel
releases it when the process dies, however it dies). When no other holder is alive, the Snakemake
locks present can only be a dead run's, and are removed; while one is alive they are kept, so
Snakemake's own check still refuses a second run that would write the same files.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from k2vec.atomic import remove_dead_temporaries

OWNERS_DIR = Path(".snakemake/k2vec-owners")
SNAKEMAKE_LOCKS_DIR = Path(".snakemake/locks")

_held: dict[Path, int] = {}  # owner file -> open descriptor holding its flock, per working directory


@dataclass
class Cleanup:
    """What `claim_working_directory` found and removed, for the messages Snakemake's output shows."""

    live_owners: list[int] = field(default_factory=list)
    stale_locks: list[Path] = field(default_factory=list)
    kept_locks: list[Path] = field(default_factory=list)
    temporaries: list[Path] = field(default_factory=list)

    def messages(self) -> list[str]:
        out = []
        if self.stale_locks:
            out.append(f"k2vec: removed the Snakemake lock left by a killed run: "
                       f"{', '.join(map(str, self.stale_locks))}")
        if self.kept_locks:
            out.append(f"k2vec: Snakemake process(es) {', '.join(map(str, self.live_owners))} still running in "
                       f"this directory; their lock ({', '.join(map(str, self.kept_locks))}) is kept")
        if self.temporaries:
            out.append(f"k2vec: removed {len(self.temporaries)} temporary file(s) or directories of killed runs: "
                       f"{', '.join(map(str, self.temporaries))}")
        return out


def put_checkout_first(src: str) -> None:
    """Put `src` first on this process's sys.path and on the PYTHONPATH its jobs inherit: PYTHONPATH
    entries precede site-packages, so an editable install of another checkout cannot win."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != src]
    os.environ["PYTHONPATH"] = os.pathsep.join([src, *rest])
    if not sys.path or sys.path[0] != src:
        sys.path.insert(0, src)


def _hold_owner_file(workdir: Path) -> Path:
    """Create this process's owner file already locked (made under a temporary name, then renamed),
    so that a visible owner file is locked for as long as its process lives."""
    owners = workdir / OWNERS_DIR
    mine = owners / f"{os.getpid()}.lock"
    if mine in _held:
        return mine
    owners.mkdir(parents=True, exist_ok=True)
    staging = owners / f".{os.getpid()}.staging"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # not inherited by jobs
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staging, mine)
    if not _held:
        atexit.register(release)
    _held[mine] = fd
    return mine


def _live_owners(workdir: Path, mine: Path) -> list[int]:
    """Pids whose owner file is still locked; the files of dead owners are removed."""
    live = []
    for path in sorted((workdir / OWNERS_DIR).glob("*.lock")):
        if path == mine:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # its owner exited and removed it meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(int(path.stem))
        else:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return live


def claim_working_directory(workdir: str | os.PathLike = ".", results: str = "results") -> Cleanup:
    """Mark this Snakemake process as alive in `workdir`; remove a dead run's Snakemake lock (only when no
    other Snakemake process of this workflow is alive there) and every temporary whose writer is dead."""
    workdir = Path(workdir)
    mine = _hold_owner_file(workdir)
    report = Cleanup(live_owners=_live_owners(workdir, mine))
    locks = sorted((workdir / SNAKEMAKE_LOCKS_DIR).glob("*.lock"))
    if report.live_owners:
        report.kept_locks = locks
    else:
        for lock in locks:
            lock.unlink(missing_ok=True)
        report.stale_locks = locks
    if (workdir / results).is_dir():
        report.temporaries = remove_dead_temporaries(workdir / results)
    return report


def cancel_timers() -> int:
    """Cancel the `threading.Timer`s still waiting in this process; returns how many. Snakemake's scheduler starts
    one (its job rate limit's re-evaluation, 1 s) on every pass that finds nothing to start, as non-daemon threads:
    Python waits for the last one before it exits, up to a second after every run that ran a job. Called where the
    run has ended (the Snakefile's onsuccess and onerror), when no scheduler pass is left to wake."""
    timers = [thread for thread in threading.enumerate() if isinstance(thread, threading.Timer)]
    for timer in timers:
        timer.cancel()
    return len(timers)


def release() -> None:
    """Remove this process's owner files at a normal exit (a killed process's are removed by the next claim)."""
    for path, fd in list(_held.items()):
        path.unlink(missing_ok=True)
        os.close(fd)
        del _held[path]


def print_summary(summary: str, started: float) -> None:
    """The epilogue of a successful invocation: the report's summary when this invocation rebuilt it,
    else one line saying where the last one is (after a targeted run it predates what just ran)."""
    path = Path(summary)
    if not path.exists():
        return
    if path.stat().st_mtime >= started:
        print(path.read_text())
    else:
        print(f"k2vec: this run did not rebuild the report; the last summary, {path}, predates it and may be "
              f"stale: a plain `snakemake` brings it up to date")
