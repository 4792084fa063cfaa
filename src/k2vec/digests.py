"""sha256 records of the files stages hand on: written beside a file when it is written, checked before use.

A record is a sidecar `<file>.sha256` in `sha256sum` format (`<hex>  <file name>`), so `sha256sum -c`
checks it too. Goldens, bundles and engine results carry one; checkpoint shards and INT4 files are
recorded in their directory's index instead. sha256 rather than the CRC-32 KDTR already holds: a CRC
is checked against a value stored in the same file, so a rewritten file with fresh CRCs passes; the
sidecar was written by the stage that made the file. Cost: 0.92 s per GB on the 2-core CI machine
(CRC-32: 0.46 s), see bench/RESULTS.md.

A sha256 record can be rewritten by whoever rewrites the file. Engine results therefore also carry a
keyed record `<file>.hmac` (HMAC-SHA256), written by the engine runner with the results directory's
integrity key (`<results>/.integrity.key`, 0600, hidden from sandboxed engines with the rest of
results/): without the key no one can write a record the report accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import re
from pathlib import Path

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError

SUFFIX = ".sha256"
KEYED_SUFFIX = ".hmac"
KEY_NAME = ".integrity.key"
_KEY_LINE = re.compile(r"([0-9a-f]{64})\n?")
_KEYED_LINE = re.compile(r"hmac-sha256:([0-9a-f]{64})  (\S.*)\n?")
_CHUNK = 1 << 24
_LINE = re.compile(r"([0-9a-f]{64})  (\S.*)\n?")


class IntegrityError(K2VecError):
    """A file differs from what the stage that wrote it recorded, or fails its own checksums."""


def sha256_bytes(data) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    return _file_digest(path, hashlib.sha256())


def _file_digest(path: str | os.PathLike, h) -> str:
    """`h` (a hashlib or hmac object) fed the file at `path` in chunks: its hex digest."""
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
    return _read_record(path, record_path(path), _LINE, "sha256 record", "its stage",
                        f" (expected one line '<64 hex digits>  {Path(path).name}')")


def _read_record(path, rec: Path, line: re.Pattern, what: str, writer: str, expected: str = "") -> str:
    """The digest in the record `rec` of `path` (one line: digest, two spaces, the file's name);
    IntegrityError naming the record when it is missing, unreadable or not of `path`."""
    try:
        text = rec.read_text()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: no {what} ({rec}); it was not written by {writer}, "
                             f"or the record was removed") from None
    except (OSError, UnicodeDecodeError) as err:
        raise IntegrityError(f"{rec}: unreadable {what}: {err}") from None
    m = line.fullmatch(text)
    if not m or m.group(2) != Path(path).name:
        raise IntegrityError(f"{rec}: not a {what} of {Path(path).name}{expected}")
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


# ------------------------------------------------------------------------------------ keyed records


def integrity_key_path(results_dir: str | os.PathLike) -> Path:
    """Where the integrity key of a results directory lives (inside it, hidden with it from sandboxed engines)."""
    return Path(results_dir) / KEY_NAME


def read_key(path: str | os.PathLike) -> bytes:
    """The integrity key at `path`; IntegrityError when it is missing or malformed."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise IntegrityError(f"integrity key {path} is missing (deleted since the runs were recorded?)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise IntegrityError(f"integrity key {path} is unreadable: {err}") from None
    m = _KEY_LINE.fullmatch(text)
    if not m:
        raise IntegrityError(f"integrity key {path} is malformed (expected 64 hex digits)")
    return bytes.fromhex(m.group(1))


def load_or_create_key(path: str | os.PathLike) -> bytes:
    """The integrity key at `path`, created (32 random bytes, mode 0600, atomically: concurrent runners
    all get the one that won) when there is none yet."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (secrets.token_hex(32) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)   # fails if another runner made one meanwhile: theirs is the key
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return read_key(path)


def keyed_digest(data: bytes, key: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def keyed_file_digest(path: str | os.PathLike, key: bytes) -> str:
    return _file_digest(path, hmac.new(key, digestmod=hashlib.sha256))


def keyed_record_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + KEYED_SUFFIX)


def write_keyed_record(path: str | os.PathLike, key: bytes, data: bytes | None = None) -> str:
    """Write `<path>.hmac` for `data` (the bytes the writer just wrote to `path`) or the file as it is now."""
    digest = keyed_digest(data, key) if data is not None else keyed_file_digest(path, key)
    write_text_atomic(keyed_record_path(path), f"hmac-sha256:{digest}  {Path(path).name}\n")
    return digest


def check_keyed_record(path: str | os.PathLike, key: bytes) -> str:
    """HMAC-SHA256 of `path` under `key`, which must equal its keyed record; IntegrityError otherwise."""
    expected = _read_record(path, keyed_record_path(path), _KEYED_LINE, "keyed record", "the engine runner")
    got = keyed_file_digest(path, key)
    if not hmac.compare_digest(got, expected):
        raise IntegrityError(f"{path}: its HMAC-SHA256 under the integrity key differs from the one the engine "
                             f"runner recorded in {keyed_record_path(path).name}: "
                             "the file, or the record, changed since")
    return got
