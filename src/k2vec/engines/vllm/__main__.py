import sys

from k2vec.engines.vllm.engine import main

sys.exit(main())
