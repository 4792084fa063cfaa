import sys

from k2vec.report import main

sys.exit(main())
