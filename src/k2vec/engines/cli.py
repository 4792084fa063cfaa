"""The command-line arguments every shipped engine takes from the contract's placeholders
(docs/engine-contract.md §2), and how it writes its results; each engine adds its own options to the parser.

An engine is run either once per run (--mode, --budget, --output) or once per bundle (--batch LISTING: the
runs of the bundle, each with its mode, budget and output, done in order; docs/engine-contract.md §2,
"Several runs in one process")."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from k2vec.engines.contract.modes import BATCH_FORMAT, CONTRACT_MODES
from k2vec.errors import K2VecError


@dataclass(frozen=True)
class Run:
    """One run an engine is asked for: `mode` greedy | ddtree | score, `budget` (DDTree nodes, 0 otherwise),
    `output` where its result goes."""

    mode: str
    budget: int
    output: str


def contract_parser(description: str, modes: Sequence[str] = CONTRACT_MODES) -> argparse.ArgumentParser:
    """--bundle, and either --mode (one of `modes`), --budget (DDTree node budget, 0 otherwise), --output, or
    --batch (a listing of runs)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--mode", choices=list(modes))
    ap.add_argument("--budget", type=int, default=0, help="DDTree node budget ({budget}; 0 outside ddtree)")
    ap.add_argument("--output", help="where the one run's result goes")
    ap.add_argument("--batch", help="a listing of runs ({batch}) to make in order, one result file each")
    return ap


def contract_runs(ap: argparse.ArgumentParser, args: argparse.Namespace,
                  modes: Sequence[str] = CONTRACT_MODES) -> list[Run]:
    """The runs the command line asks for: the one of --mode/--budget/--output, or those of --batch."""
    if args.batch is None:
        if args.mode is None or args.output is None:
            ap.error("give --mode and --output (one run), or --batch (several)")
        return [Run(args.mode, args.budget, args.output)]
    if args.mode is not None or args.output is not None:
        ap.error("--batch lists the runs: it takes no --mode or --output")
    return read_batch(args.batch, modes)


def read_batch(path: str, modes: Sequence[str] = CONTRACT_MODES) -> list[Run]:
    """The runs of a batch listing (written by the runner), checked: K2VecError naming the file and the run."""
    try:
        with open(path) as fh:
            listing = json.load(fh)
    except (OSError, ValueError) as err:
        raise K2VecError(f"cannot read the batch listing {path}: {err}") from None
    if not isinstance(listing, dict) or listing.get("format") != BATCH_FORMAT or listing.get("version") != 1:
        raise K2VecError(f"{path} is not a version 1 {BATCH_FORMAT} listing")
    runs = []
    for i, r in enumerate(listing.get("runs") or []):
        ok = (isinstance(r, dict) and r.get("mode") in modes and isinstance(r.get("budget"), int)
              and isinstance(r.get("output"), str))
        if not ok:
            raise K2VecError(f"{path}: run {i} is not a mode of {', '.join(modes)} with an integer budget and an "
                             f"output path: {str(r)[:120]}")
        runs.append(Run(r["mode"], r["budget"], r["output"]))
    if not runs:
        raise K2VecError(f"{path} lists no run")
    return runs


def write_output(path: str, result: dict[str, Any]) -> None:
    """The result JSON at its output path, renamed into place when complete: the runner starts a batch's next
    run's time limit when a result appears. json.dumps, not json.dump: dump streams through the pure-Python
    encoder, about twice as slow on a multi-MB result."""
    partial = f"{path}.part"
    with open(partial, "w") as fh:
        fh.write(json.dumps(result))
    os.replace(partial, path)
