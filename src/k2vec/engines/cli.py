"""The command-line arguments every shipped engine takes from the contract's placeholders
(docs/engine-contract.md §2), and how it writes its result; each engine adds its own options to the parser."""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from k2vec.engines.contract.modes import CONTRACT_MODES


def contract_parser(description: str, modes: Sequence[str] = CONTRACT_MODES) -> argparse.ArgumentParser:
    """--bundle, --mode (one of `modes`), --budget (DDTree node budget, 0 otherwise), --output."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--mode", required=True, choices=list(modes))
    ap.add_argument("--budget", type=int, default=0, help="DDTree node budget ({budget}; 0 outside ddtree)")
    ap.add_argument("--output", required=True)
    return ap


def write_output(path: str, result: dict[str, Any]) -> None:
    """The result JSON at --output. json.dumps, not json.dump: dump streams through the pure-Python
    encoder, about twice as slow on a multi-MB result."""
    with open(path, "w") as fh:
        fh.write(json.dumps(result))
