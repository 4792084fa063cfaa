"""`python -m k2vec`: the `k2vec` console script (k2vec.cli) where it is not installed."""
import sys

from k2vec.cli import main

sys.exit(main())
