import sys

from k2vec.engines.llama_cpp.engine import main

sys.exit(main())
