"""Write files and directories so that nothing half-written ever carries its final name.

A temporary path is `.{final name}.{writer pid}.{random}.tmp` beside its final path: a run killed
mid-write leaves it behind, and `remove_dead_temporaries` deletes it once its writer is gone. A
working directory (an engine run's scratch directory) is claimed with an in-use marker
`.in-use.{pid}` inside it: once that process is gone without removing its marker, the directory goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

# Temporaries that carry their writer's pid, and the marker of a directory in use by a process.
_TEMPORARY_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.[a-z0-9_]+\.tmp$")
_IN_USE_NAME = re.compile(r"^\.in-use\.(?P<pid>\d+)$")

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


def _syncfs(path: Path) -> bool:
    """Flush the whole filesystem holding `path` with one syncfs(2) call (Linux); False where unavailable."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None, use_errno=True)
            _LIBC.syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    if not _LIBC:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return _LIBC.syncfs(fd) == 0
    finally:
        os.close(fd)


_LIBC: ctypes.CDLL | bool | None = None


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
        # One syncfs for the whole directory: an int4 directory of a K2 layer holds 2,304 files, and an
        # fsync each cost minutes; fsync per file only where syncfs is unavailable.
        if not _syncfs(tmp):
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


def claim_directory(path: str | os.PathLike) -> Path:
    """Mark `path` as in use by this process (`.in-use.{pid}`); remove the marker when done with it, or
    the next `remove_dead_temporaries` after this process dies removes the whole directory."""
    marker = Path(path, f".in-use.{os.getpid()}")
    marker.touch()
    return marker


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + os.sep)


def kill_processes_in(directory: str | os.PathLike) -> list[int]:
    """SIGKILL every process (of this user, or any as root) that works in `directory` or keeps its
    temporary files there (cwd, or TMPDIR in its environment, below it), and return their pids.

    A directory whose claimant died is a killed run's: an engine started in its own session outlives a
    SIGKILL of the pipeline's process group, re-parented to init, and would go on writing beside the
    rerun. The engine runner starts every engine in its scratch directory with TMPDIR there, which is
    how such an orphan is found again."""
    target = os.path.realpath(directory)
    killed = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                tmpdir = next((v[7:].decode("utf-8", "replace") for v in fh.read().split(b"\0")
                               if v.startswith(b"TMPDIR=")), "")
        except OSError:   # gone meanwhile, or another user's
            continue
        if _inside(cwd, target) or (tmpdir and _inside(os.path.realpath(tmpdir), target)):
            try:
                os.kill(int(entry.name), 9)
                killed.append(int(entry.name))
            except OSError:
                pass
    return killed


def remove_dead_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete the temporaries under `root` whose writer process is gone, and the directories whose
    in-use marker names a dead process, after killing what still works in them (kill_processes_in);
    a live writer's are kept.

    A reused pid keeps a dead writer's temporary until a later sweep: never the other way round.
    """
    removed = []
    for dirpath, dirnames, filenames in os.walk(root):
        in_use = [m for m in map(_IN_USE_NAME.match, filenames) if m]
        if in_use and not any(_process_alive(int(m["pid"])) for m in in_use):
            kill_processes_in(dirpath)
            shutil.rmtree(dirpath, ignore_errors=True)
            dirnames.clear()
            removed.append(Path(dirpath))
            continue
        for name in [*dirnames, *filenames]:
            m = _TEMPORARY_NAME.match(name)
            if not m or _process_alive(int(m["pid"])):
                continue
            path = Path(dirpath, name)
            if name in dirnames:
                dirnames.remove(name)  # do not walk into what is being removed
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed
