"""Write files and directories so that nothing half-written ever carries its final name."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def _default_mode() -> int:
    """0o666 less the umask: what open() would have given (mkstemp makes owner-only files)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


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
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
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
