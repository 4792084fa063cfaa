"""Result files: read with limits on size and nesting (hostile JSON fails, never hangs), written atomically with their
digest."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from k2vec.atomic import write_text_atomic
from k2vec.digests import sha256_bytes, write_keyed_record, write_record
from k2vec.engines.contract.errors import InvalidResult

# A valid result nests 8 deep ({runs: [{prompts: [{fingerprints: [[[ ... ); the limit leaves room for
# free-form keys while keeping every later step (schema check, JSON writer, report) far from
# Python's recursion limit.
MAX_RESULT_NESTING = 32
_SCAN_CHUNK = 1 << 22
_BYTE_KIND = np.zeros(256, np.uint8)
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = 1, 2, 3, 4
_BYTE_KIND[[ord("["), ord("{")]] = _OPEN
_BYTE_KIND[[ord("]"), ord("}")]] = _CLOSE
_BYTE_KIND[ord('"')] = _QUOTE
_BYTE_KIND[ord("\\")] = _BACKSLASH


def json_nesting(data: bytes, stop_above: int | None = None) -> tuple[int, int]:
    """(deepest nesting of arrays and objects, byte offset where it is first reached) of JSON text,
    brackets inside strings not counted; before parsing, so that no depth can exhaust the parser.

    Vectorised over chunks, on the bracket, quote and backslash bytes only. Carried between chunks:
    the depth, whether a string is open, and how many backslashes end the chunk (an odd run escapes
    the quote right after it). With `stop_above`, stops after the first chunk deeper than that."""
    depth, in_string, slashes, best = 0, 0, 0, (0, -1)
    for lo in range(0, len(data), _SCAN_CHUNK):
        kinds = _BYTE_KIND[np.frombuffer(data, np.uint8, count=min(_SCAN_CHUNK, len(data) - lo), offset=lo)]
        pos = np.flatnonzero(kinds)
        if pos.size == 0:
            slashes = 0
            continue
        kind = kinds[pos]
        bs = kind == _BACKSLASH
        ids = np.arange(pos.size)
        # adjacent[i]: element i directly follows element i-1 (element 0: the previous chunk's last byte)
        adjacent = np.concatenate(([pos[0] == 0], np.diff(pos) == 1))
        prev_bs = np.concatenate(([slashes > 0], bs[:-1]))
        run_start = np.maximum.accumulate(np.where(bs & ~(adjacent & prev_bs), ids, -1))
        run = np.where(run_start >= 0, ids - run_start + 1, ids + 1 + slashes)   # backslashes ending here
        before = np.where(adjacent & prev_bs, np.concatenate(([slashes], run[:-1])), 0)
        quote = (kind == _QUOTE) & (before % 2 == 0)
        outside = (np.cumsum(quote) + in_string) % 2 == 0   # a quote is never a bracket: its parity is moot
        step = ((kind == _OPEN) & outside).astype(np.int64) - ((kind == _CLOSE) & outside)
        level = depth + np.cumsum(step)
        top = int(level.argmax())
        if level[top] > best[0]:
            best = (int(level[top]), lo + int(pos[top]))
            if stop_above is not None and best[0] > stop_above:
                break
        depth, in_string = int(level[-1]), (in_string + int(quote.sum())) % 2
        slashes = int(run[-1]) if bs[-1] and pos[-1] == kinds.size - 1 else 0
    return best


def _non_finite(token: str) -> Any:
    raise InvalidResult(f"result holds {token}: every number must be finite")


def read_result(path: Path, max_bytes: int) -> Any:
    """The engine's result file, parsed, or InvalidResult saying why it cannot be: missing, not a
    regular file (a directory, a link, a FIFO), over `max_bytes` (checked before reading), not UTF-8,
    nested deeper than MAX_RESULT_NESTING, not JSON, numbers the reader refuses (NaN, Infinity,
    integers of thousands of digits)."""
    try:
        # O_NOFOLLOW: a link could point anywhere; O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidResult(f"engine exited 0 but wrote no result file at {path}") from None
    except OSError as err:
        kind = "a symbolic link" if os.path.islink(path) else "unreadable"
        raise InvalidResult(f"the result at {path} is {kind} ({err.strerror}); write a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidResult(f"the result at {path} is {kind}; write a regular file")
        if st.st_size > max_bytes:
            raise InvalidResult(f"result file is {st.st_size:,} bytes, over the limit of {max_bytes:,} "
                                f"(engine setting max_result_mb)")
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, min(max_bytes + 1 - size, 1 << 24))):
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:   # still growing: a process of the engine is writing it
        raise InvalidResult(f"result file grew past the limit of {max_bytes:,} bytes while read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidResult(f"result file is not valid JSON: not UTF-8 at byte {err.start}") from None
    deepest, at = json_nesting(data, stop_above=MAX_RESULT_NESTING)
    if deepest > MAX_RESULT_NESTING:
        raise InvalidResult(f"result file nests arrays/objects {deepest} deep (reached at byte {at}); "
                            f"the limit is {MAX_RESULT_NESTING}")
    try:
        return json.loads(text, parse_constant=_non_finite)
    except json.JSONDecodeError as err:
        raise InvalidResult(f"result file is not valid JSON: {err}") from None
    except ValueError as err:   # e.g. an integer of more digits than Python converts
        raise InvalidResult(f"result file holds a number the JSON reader refuses: {err}") from None


def write_result(output: Path, text: str, key: bytes | None = None) -> None:
    """The final result, its sha256 record `<output>.sha256` and, with the integrity `key`, its keyed
    record `<output>.hmac`, by which the report notices a result rewritten after the runner wrote it
    (the sha256 record alone is rewritten as easily as the result)."""
    data = text.encode("utf-8")
    write_text_atomic(output, text)
    write_record(output, sha256_bytes(data))
    if key is not None:
        write_keyed_record(output, key, data)
