"""Run llama.cpp's `convert_hf_to_gguf.py` on a checkpoint that has no tokenizer (run in a process of its own).

A synthetic model has token ids but no tokenizer, and the converter's DeepSeek-V3 class insists on one: it
tries a GPT-2 style tokenizer.json, then transformers' AutoTokenizer, and a stub tokenizer is refused by its
pre-tokenizer hash check. The one change made here: the architecture's `set_vocab` becomes the converter's
own `_set_vocab_none` (the GGUF tokenizer model "none", llama.cpp's vocabulary-less mode). Every tensor and
hyperparameter is mapped by the converter's code, which then runs as its command line does (its `main`).

    python -m k2vec.engines.llama_cpp.vocabless CONVERTER_DIR MODEL_DIR OUTFILE [converter options...]
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    tree, model_dir, outfile, *options = argv
    script = Path(tree) / "convert_hf_to_gguf.py"
    # What the script does to its own sys.path (its directory, and gguf-py unless NO_LOCAL_GGUF), done
    # before `conversion` is imported here, so that the patched class is the one the script then uses.
    sys.path[0:0] = [tree] + ([] if "NO_LOCAL_GGUF" in os.environ else [str(Path(tree) / "gguf-py")])
    from conversion import get_model_class
    from conversion.base import TextModel

    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    get_model_class(architecture).set_vocab = TextModel._set_vocab_none
    sys.argv = [str(script), model_dir, "--outfile", outfile, *options]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
