"""Every default model's fp32 checkpoint loads in transformers' DeepseekV3ForCausalLM and generates."""
import pytest
import torch
import transformers

from k2vec.stages.prompts import candidate
from k2vec.config.expand import expand_config
from k2vec.stages.weights import write_checkpoint
from conftest import default_config

@pytest.mark.parametrize("model_name", sorted(default_config()["models"]))
def test_from_pretrained_no_missing_keys_and_generates(model_name, tmp_path):
    case = expand_config(default_config())[model_name]
    write_checkpoint(case["model"], tmp_path)
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    # HF's view of the architecture equals the spec's.
    cfg = model.config
    m = case["model"]
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (
        m["n_routed_experts"], m["num_experts_per_tok"], m["n_group"], m["topk_group"])
    n_loaded = sum(t.numel() for n, t in model.state_dict().items() if "rotary_emb" not in n)
    assert n_loaded == m["n_parameters"]
    prompt = torch.tensor([candidate(case["prompts"], case["model"], 0, 0)])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 8)
    with torch.no_grad():
        logits = model(out).logits[0]
    assert torch.isfinite(logits).all()
    # Decisive greedy decoding needs logits spread well beyond fp32 noise.
    assert 2.0 < logits.std().item() < 8.0
