"""The int4 golden is what transformers computes on the dequantized .qw/.sc weights."""
import numpy as np
import pytest
import torch
import transformers

from k2vec.model.checkpoint import Checkpoint, write_shards
from k2vec.stages.golden import make_golden, open_weights, reference_model
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.stages.prompts import draw_prompts
from k2vec.config.expand import expand_config
from k2vec.model.checkpoint import shard_groups
from k2vec.stages.weights import write_checkpoint
from conftest import default_config

@pytest.mark.parametrize("model_name", ["tiny", "small"])
def test_hf_on_dequantized_weights_reproduces_int4_golden(model_name, tmp_path):
    config = default_config()
    config["decoding"]["ddtree"].update(budgets=[1], accuracies=[0.5])  # the greedy part is what is checked
    case = expand_config(config)[model_name]
    write_checkpoint(case["model"], tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "int4", case["quantization"])
    weights = open_weights("int4", tmp_path / "fp32", tmp_path / "int4")
    case["prompts"] = draw_prompts(case["prompts"], case["model"], {"int4": reference_model(case["model"], weights)})
    tensors, meta = make_golden(case, weights, "int4")

    # Replace every quantized weight by its dequantized value in an HF checkpoint, load it in transformers.
    hf_dir = tmp_path / "hf-dequantized"
    hf_dir.mkdir()
    groups = shard_groups(case["model"])
    write_shards(hf_dir, ([(n, np.asarray(weights[n])) for n in g] for g in groups), len(groups))
    (hf_dir / "config.json").write_text((tmp_path / "fp32" / "config.json").read_text())
    fp32 = Checkpoint(tmp_path / "fp32")
    quantized = case["quantization"]["tensors"]
    assert all(not np.array_equal(weights[n], fp32[n]) for n in list(quantized)[:5])
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    n_new = case["decoding"]["max_new_tokens"]
    for i, prompt in enumerate(case["prompts"]["tokens"]):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        hf_tokens = out.sequences[0, len(prompt):].numpy()
        golden = tensors[f"golden.p{i}.tokens"]
        diff = np.flatnonzero(hf_tokens != golden)
        if diff.size:
            step = diff[0]
            top2 = torch.topk(out.logits[step][0], 2).values
            margin = float(top2[0] - top2[1])
            print(f"prompt {i}: first difference at step {step}, HF margin {margin:.2e}")
            assert margin < 1e-4, "int4 golden differs from transformers on the dequantized weights"
