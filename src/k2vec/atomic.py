"""Write files and directories so that nothing half-written ever carries its final name.

A temporary path is `.{final name}.{writer pid}.{random}.tmp` beside its final path: a run killed
mid-write leaves it behind, and `remove_dead_temporaries` deletes it once its writer is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

# Temporaries that carry their writer's pid: ours, and the engine runner's result staging file
# (`.{result}.engine-{runner pid}.partial`, k2vec.engines.runner).
_TEMPORARY_NAME = re.compile(r"^\..+\.(?:(?P<pid>\d+)\.[a-z0-9_]+\.tmp|engine-(?P<runner_pid>\d+)\.partial)$")

# Tests stop a write just before its rename to kill the pipeline there (tests/test_resume.py):
# a path fragment to match, and a file outside results/ that the held writer creates.
HOLD_ENV = "K2VEC_TEST_HOLD_WRITE"
HOLD_SIGNAL_ENV = "K2VEC_TEST_HOLD_SIGNAL"


def _default_mode() -> int:
    """0o666 less the umask: what open() would have given (mkstemp makes owner-only files)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _temporary_prefix(final: Path) -> str:
    return f".{final.name}.{os.getpid()}."


def _hold_if_asked(final: Path) -> None:
    """Test hook: with K2VEC_TEST_HOLD_WRITE naming part of `final`, announce the held write and wait to be killed."""
    fragment = os.environ.get(HOLD_ENV)
    if fragment and fragment in final.as_posix():
        Path(os.environ[HOLD_SIGNAL_ENV]).write_text(f"{os.getpid()} {final}\n")
        while True:
            time.sleep(60)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success fsync it and rename it to `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_temporary_prefix(final), suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _hold_if_asked(final)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, _default_mode())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(final: str | os.PathLike, data: bytes) -> None:
    with atomic_file(final) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(final: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(final, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside `final`; on success it replaces `final` whole."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(final), suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        _hold_if_asked(final)
        for entry in tmp.iterdir():
            if entry.is_file():
                with open(entry, "rb") as fh:
                    os.fsync(fh.fileno())
        os.chmod(tmp, _default_mode() | 0o111)  # mkdtemp makes an owner-only directory
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed writer nobody has reaped yet is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill()
    return stat[stat.rfind(")") + 2] != "Z"


def remove_dead_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete the temporaries under `root` whose writer process is gone; a live writer's are kept.

    A reused pid keeps a dead writer's temporary until a later sweep: never the other way round.
    """
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            m = _TEMPORARY_NAME.match(name)
            if not m or _process_alive(int(m["pid"] or m["runner_pid"])):
                continue
            path = Path(dirpath, name)
            if name in dirnames:
                dirnames.remove(name)  # do not walk into what is being removed
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed
