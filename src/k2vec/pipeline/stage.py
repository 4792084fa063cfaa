"""What every pipeline stage script shares: logging to the rule's `log:` file."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def stage_logging(log_path: str, stage: str) -> Iterator[logging.Logger]:
    """Send the stage's log records, warnings and any traceback to the rule's log file."""
    logger = logging.getLogger(f"k2vec.{stage}")
    handler = logging.FileHandler(log_path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("k2vec")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    start = time.perf_counter()
    # Which checkout's code this stage runs (the Snakefile puts its own src/ first on PYTHONPATH).
    logger.info("stage %s: package k2vec from %s", stage, Path(__file__).resolve().parents[1])
    try:
        yield logger
    except BaseException:
        logger.exception("stage %s failed", stage)
        raise
    else:
        logger.info("stage %s done in %.2f s", stage, time.perf_counter() - start)
    finally:
        root.removeHandler(handler)
        handler.close()


def fail_to_stderr() -> None:
    """Make uncaught errors print their message only: they are already in the log with a traceback."""
    def hook(exc_type, exc, tb):
        print(f"{exc_type.__name__}: {exc}", file=sys.stderr)
    sys.excepthook = hook
