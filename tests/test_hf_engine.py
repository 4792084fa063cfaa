"""The transformers engine (k2vec.engines.hf): its own INT4 decoder, its weight layout, and its entries being
left out with one notice where its packages are missing. Its runs against the golden are in test_pipeline.py."""
import numpy as np
import pytest
import torch

from conftest import REPO, default_config, snakemake, write_config
from test_workflow import scheduled_jobs

from k2vec.model import int4 as quant
from k2vec.engines import hf
from k2vec.config.engines import engine_runs, engines_missing_modules, resolve_engines

HF_ENGINES = ["hf_fp32", "hf_bf16"]


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_decode_int4_equals_the_quantizers_dequantization(scale_dtype):
    w = np.random.default_rng(3).normal(size=(24, 96)).astype(np.float32)
    codes, scales = quant.quantize(w, 32, scale_dtype)
    stored = quant.bf16_bits(scales) if scale_dtype == "bfloat16" else scales  # the bundle keeps bf16 bits
    decoded = hf.decode_int4(quant.pack(codes), stored, 32, scale_dtype == "bfloat16", "w").numpy()
    # Exact: a swapped nibble order, a missing offset or a scale applied to the wrong group all differ.
    np.testing.assert_array_equal(decoded, quant.dequantize(codes, scales, 32))


def test_decode_int4_names_the_tensor_whose_scales_do_not_fit():
    packed = np.zeros((4, 16), np.uint8)  # K = 32
    with pytest.raises(ValueError, match=r"model\.x\.weight\.sc: shape \(4, 2\) .* \(expected \(4, 1\)\)"):
        hf.decode_int4(packed, np.ones((4, 2), np.float32), 32, False, "model.x.weight")


def test_experts_are_fused_gate_rows_first():
    """transformers >= 5 keeps experts as gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    cfg = {"vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "moe_intermediate_size": 4,
           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
           "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
           "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
           "qk_rope_head_dim": 2, "v_head_dim": 4}
    with torch.device("meta"):
        model = hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(**cfg))
    rng = np.random.default_rng(0)
    tensors = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model.state_dict().items()
               if ".experts." not in k or "shared" in k}
    for e in range(4):
        for proj, shape in (("gate_proj", (4, 8)), ("up_proj", (4, 8)), ("down_proj", (8, 4))):
            tensors[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = rng.normal(size=shape).astype(np.float32)
    state = hf.bundle_state_dict(tensors, {"quantization": None, "hf_config": cfg}, model)
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"].numpy()
    assert gate_up.shape == (4, 8, 8)
    np.testing.assert_array_equal(gate_up[2, :4], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"])
    np.testing.assert_array_equal(gate_up[2, 4:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"])
    np.testing.assert_array_equal(state["model.layers.1.mlp.experts.down_proj"].numpy()[3],
                                  tensors["model.layers.1.mlp.experts.3.down_proj.weight"])
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight"):
        hf.bundle_state_dict(tensors, {"quantization": None, "hf_config": cfg}, model)


def test_engines_missing_a_package_are_listed_with_it():
    cfg = default_config()
    for name in ("llama_cpp", "vllm"):   # installed or not, depending on the environment (their test files)
        del cfg["engines"][name]
    cfg["engines"]["hf_bf16"]["requires"] = ["torch", "k2vec_no_such_package"]
    engines = resolve_engines(cfg, str(REPO))
    assert engines_missing_modules(engines) == {"hf_bf16": ["k2vec_no_such_package"]}
    kept = engine_runs(engines, cfg["decoding"]["ddtree"]["budgets"], list(engines_missing_modules(engines)))
    assert {r[0] for r in kept if r[0].startswith("hf")} == {"hf_fp32"}
    # Installed here: the default entries run, greedy and score on both models and precisions.
    assert not [n for n in engines_missing_modules(resolve_engines(default_config(), str(REPO))) if n.startswith("hf")]
    runs = engine_runs(resolve_engines(default_config(), str(REPO)), [1])
    assert sorted(r[3] for r in runs if r[0] == "hf_fp32") == ["greedy"] * 4 + ["score"] * 4


def test_dry_run_without_transformers_leaves_hf_engines_out_with_one_notice(tmp_path):
    cfg = default_config()
    for name in HF_ENGINES:
        cfg["engines"][name]["requires"] = ["k2vec_no_such_package"]
    for name in ("llama_cpp", "vllm"):   # their own notices where their packages are missing (their test files)
        cfg["engines"][name] = None
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(write_config(tmp_path / "c.yaml", cfg)),
                    cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr[-2000:]
    notice = "k2vec: no run of engine(s) hf_fp32, hf_bf16: k2vec_no_such_package not importable by"
    assert res.stderr.count(notice) == 1, res.stderr[-2000:]
    assert "results/runs/hf_" not in res.stdout
    plain = default_config()
    plain["engines"].update(llama_cpp=None, vllm=None)
    with_hf = snakemake("-n", "--directory", str(tmp_path),
                        "--configfile", str(write_config(tmp_path / "d.yaml", plain)),
                        cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert not [line for line in with_hf.stderr.splitlines() if line.startswith("k2vec: no run of") and "hf_" in line]
    # each transformers engine: one batch job per bundle (its greedy and score runs); none while left out
    jobs = scheduled_jobs(with_hf.stdout)
    assert jobs["engine_batch_hf_fp32"] == jobs["engine_batch_hf_bf16"] == 4, jobs
    assert not any(rule.startswith("engine_batch_hf") for rule in scheduled_jobs(res.stdout))
