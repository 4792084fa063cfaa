"""The `k2vec` console script: one subcommand per tool, each a thin hand-off to the package that owns it.

    k2vec judge --bundle results/bundles/tiny-fp32.kdtr --result my-engine/tiny-fp32-greedy.json

judge: one engine result judged as the report would (k2vec.report.judge)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

COMMANDS = {"judge": "judge one engine result as the divergence report would, with its strict verdict "
                     "(k2vec judge --help)"}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k2vec", description="k2vec's tools. " + "; ".join(
        f"{name}: {what}" for name, what in COMMANDS.items()))
    ap.add_argument("command", choices=list(COMMANDS))
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    # imported here: each command loads only its own package (the judge's pandas, numpy)
    from k2vec.report.judge import main as judge

    return judge(a.args, prog="k2vec judge")
