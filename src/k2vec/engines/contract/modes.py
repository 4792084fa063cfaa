"""The contract's mode names: greedy, score, ddtree-b{budget}; and the name of a batch engine's listing of runs."""

from __future__ import annotations

# What an engine is asked for (its --mode); the pipeline's run names add the DDTree budget: ddtree-b16.
CONTRACT_MODES = ("greedy", "ddtree", "score")
# The `format` of the {batch} listing the runner writes and a batch engine reads (docs/engine-contract.md §2).
BATCH_FORMAT = "k2vec-engine-batch"


def parse_mode(mode: str) -> tuple[str, int]:
    """'greedy' -> ('greedy', 0); 'score' -> ('score', 0); 'ddtree-b16' -> ('ddtree', 16)."""
    if mode in ("greedy", "score"):
        return mode, 0
    if mode.startswith("ddtree-b") and mode[len("ddtree-b"):].isdigit() and int(mode[len("ddtree-b"):]) > 0:
        return "ddtree", int(mode[len("ddtree-b"):])
    raise ValueError(f"unknown mode {mode!r}: expected 'greedy', 'score' or 'ddtree-b<budget>'")
