"""An engine's optional build step: run its build command, then write a stamp naming what was built."""

from __future__ import annotations

import hashlib
import logging
import subprocess
from pathlib import Path

from ..atomic import write_text_atomic
from ..errors import K2VecError


class BuildError(K2VecError):
    pass


log = logging.getLogger("k2vec.engine_build")


def build_engine(command: str, sources: list[str], stamp: str, *, log_path: str, timeout_s: float) -> None:
    log.info("build: %s", command)
    try:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BuildError(f"build command timed out after {timeout_s:g} s: {command}") from None
    for stream in (proc.stdout, proc.stderr):
        if stream:
            log.info("%s", stream.rstrip("\n"))
    if proc.returncode != 0:
        raise BuildError(f"build command exited with code {proc.returncode}: {command} (see {log_path})")
    lines = [f"{hashlib.sha256(Path(s).read_bytes()).hexdigest()}  {s}" for s in sorted(sources)]
    write_text_atomic(stamp, f"build: {command}\n" + "\n".join(lines) + "\n")
