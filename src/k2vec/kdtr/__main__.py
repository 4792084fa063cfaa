import sys

from k2vec.kdtr.cli import main

sys.exit(main())
