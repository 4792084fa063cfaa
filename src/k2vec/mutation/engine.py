"""The mutation run's engine: the numpy engine with one fault of the catalogue injected through its hook.

    python -m k2vec.mutation.engine --mutant NAME --bundle B.kdtr --mode M --budget N --output R.json [--precision P]

The same contract as the numpy engine (k2vec.engines.numpy_engine), which never imports the catalogue.
"""

from __future__ import annotations

import sys

from k2vec.engines import numpy_engine
from k2vec.engines.cli import contract_parser, contract_runs, write_output
from k2vec.model.precision import FORMATS
from k2vec.mutation.catalogue import injected


def main(argv: list[str] | None = None) -> int:
    ap = contract_parser(__doc__.splitlines()[0])
    ap.add_argument("--mutant", metavar="NAME", required=True,
                    help="the fault of the mutant catalogue to inject (docs/mutants.md)")
    ap.add_argument("--precision", choices=list(FORMATS),
                    help="the numpy engine's emulated precision (default: float64)")
    args = ap.parse_args(argv)
    for r in contract_runs(ap, args):   # a fresh model per run: a fault may keep state in it
        with injected(args.mutant) as install:
            result = numpy_engine.run(args.bundle, r.mode, r.budget, install, precision=args.precision)
        write_output(r.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
