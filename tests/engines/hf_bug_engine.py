"""The transformers engine (k2vec.engines.hf) with one real bug injected, for tests of the verdicts:

    python hf_bug_engine.py no-routed-scaling|no-shared-expert <k2vec.engines.hf arguments>

no-routed-scaling: routed experts' weights left unscaled (routed_scaling_factor ignored);
no-shared-expert: the shared expert's output dropped.
"""
import sys

import torch

from k2vec.engines import hf

BUGS = ("no-routed-scaling", "no-shared-expert")


def with_bug(load_model, bug: str):
    def load(*args, **kwargs):
        model = load_model(*args, **kwargs)
        for layer in model.model.layers:
            if not hasattr(layer.mlp, "gate"):
                continue
            if bug == "no-routed-scaling":
                layer.mlp.gate.routed_scaling_factor = 1.0
            else:
                layer.mlp.shared_experts.forward = torch.zeros_like
        return model
    return load


if __name__ == "__main__":
    bug, argv = sys.argv[1], sys.argv[2:]
    assert bug in BUGS, f"unknown bug {bug!r}; choose one of {BUGS}"
    hf.load_model = with_bug(hf.load_model, bug)
    sys.exit(hf.main(argv))
