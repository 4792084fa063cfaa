"""An engine's optional build step: run its build command, then write a stamp naming what was built."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
from pathlib import Path

from k2vec.atomic import write_text_atomic
from k2vec.errors import K2VecError


class BuildError(K2VecError):
    pass


log = logging.getLogger("k2vec.engine_build")


def build_engine(engine: str, command: str, sources: list[str], stamp: str, *, log_path: str,
                 timeout_s: float, repo: str | None = None) -> None:
    """Run `engine`'s build command; BuildError naming the engine, the step and the log if it fails or
    runs past `timeout_s`. At the limit its whole process group is killed (make and its compilers,
    not only the shell). The command sees K2VEC_WORKDIR (the working directory it runs in, where results/
    is) and, given `repo`, K2VEC_REPO: the checkout holding the workflow and the engines' sources, which
    differs from the working directory under `snakemake --directory`."""
    log.info("build: %s", command)
    env = {**os.environ, "K2VEC_WORKDIR": os.getcwd(), **({"K2VEC_REPO": repo} if repo else {})}
    with subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, start_new_session=True, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise BuildError(f"engine {engine!r}: build command timed out after {timeout_s:g} s (killed): {command} "
                             f"(see {log_path})") from None
    for stream in (out, err):
        if stream:
            log.info("%s", stream.rstrip("\n"))
    if proc.returncode != 0:
        raise BuildError(f"engine {engine!r}: build command exited with code {proc.returncode}: {command} "
                         f"(see {log_path})")
    lines = [f"{hashlib.sha256(Path(s).read_bytes()).hexdigest()}  {s}" for s in sorted(sources)]
    write_text_atomic(stamp, f"build: {command}\n" + "\n".join(lines) + "\n")
