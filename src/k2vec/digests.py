"""sha256 records of the files stages hand on: written beside a file when it is written, checked before use.

A record is a sidecar `<file>.sha256` in `sha256sum` format (`<hex>  <file name>`), so `sha256sum -c`
checks it too. Goldens, bundles and engine results carry one; checkpoint shards and INT4 files are
recorded in their directory's index instead. sha256 rather than the CRC-32 KDTR already holds: a CRC
is checked against a value stored in the same file, so a rewritten file with fresh CRCs passes; the
sidecar was written by the stage that made the file. Cost: 0.92 s per GB on the 2-core CI machine
(CRC-32: 0.46 s), see bench/RESULTS.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError

SUFFIX = ".sha256"
_CHUNK = 1 << 24
_LINE = re.compile(r"([0-9a-f]{64})  (\S.*)\n?")


class IntegrityError(K2VecError):
    """A file differs from what the stage that wrote it recorded, or fails its own checksums."""


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def record_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def write_record(path: str | os.PathLike, digest: str | None = None) -> str:
    """Write `<path>.sha256` for the file as it is now (or for `digest`, computed by the writer)."""
    digest = digest or sha256_file(path)
    write_text_atomic(record_path(path), f"{digest}  {Path(path).name}\n")
    return digest


def recorded(path: str | os.PathLike) -> str:
    """The sha256 recorded beside `path`; IntegrityError when there is no valid record."""
    rec = record_path(path)
    try:
        text = rec.read_text()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: no sha256 record ({rec}); it was not written by its stage, "
                             f"or the record was removed") from None
    except (OSError, UnicodeDecodeError) as err:
        raise IntegrityError(f"{rec}: unreadable sha256 record: {err}") from None
    m = _LINE.fullmatch(text)
    if not m or m.group(2) != Path(path).name:
        raise IntegrityError(f"{rec}: not a sha256 record of {Path(path).name} "
                             f"(expected one line '<64 hex digits>  {Path(path).name}')")
    return m.group(1)


def check_record(path: str | os.PathLike) -> str:
    """sha256 of `path`, which must equal its record; IntegrityError naming both otherwise."""
    want = recorded(path)
    got = sha256_file(path)
    if got != want:
        raise IntegrityError(f"{path}: sha256 {got} differs from the one recorded when it was written "
                             f"({want}, in {record_path(path).name}): the file changed since")
    return got


def verify_kdtr(path: str | os.PathLike) -> str:
    """Every check a KDTR file offers, then its sha256 against its record; returns the sha256.

    The KDTR checks come first: when both fail, their message names the tensor and byte offset."""
    from k2vec.kdtr import KdtrError, open_bundle

    try:
        with open_bundle(path, verify=True):
            pass
    except KdtrError as err:
        where = f"byte offset {err.offset} ({err.field})" if err.offset is not None else err.field
        raise IntegrityError(f"{path} is corrupted at {where}: {err.reason}") from None
    except OSError as err:
        raise IntegrityError(f"{path}: cannot read: {err}") from None
    return check_record(path)
