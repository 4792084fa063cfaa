"""Checks of a third-party engine's result against the golden and against the reference under the latent-norm
eps convention (rms_norm_eps in q_a/kv_a layernorms, as llama.cpp and vLLM compute), for the thirdparty tests."""
from pathlib import Path

import numpy as np

from conftest import copy_workflow, default_config, snakemake, write_config


def run_engine_alone(root: Path, models: dict | None, engines: dict) -> Path:
    """The workflow copied to `root` and run to the end (`snakemake --cores 2`) with config.yaml's engines replaced
    by `engines` (and its models by `models`, where given): a third-party engine's pipeline."""
    root = copy_workflow(root)
    config = default_config()
    if models is not None:
        config["models"] = models
    config["engines"] = engines
    write_config(root / "config.yaml", config)
    res = snakemake("--cores", "2", snakefile=root / "Snakefile", cwd=root, env={"PYTHONPATH": str(root / "src")},
                    timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    return root


def eps_variant_reference(bundle_path: Path, mode: str):
    """The reference model under the convention on the bundle: greedy, or forced on the golden tokens (score).
    Returns (the open bundle, the per-prompt results)."""
    from k2vec.engines.numpy_engine import BundleWeights
    from k2vec.kdtr import open_bundle
    from k2vec.reference import ReferenceModel, greedy_generate

    b = open_bundle(bundle_path)
    meta = b.metadata
    n = meta["golden"]["prompts"]
    prompts = [np.asarray(b[f"prompt.p{i}.tokens"]) for i in range(n)]
    forced = [np.asarray(b[f"golden.p{i}.tokens"]) for i in range(n)] if mode == "score" else None
    model = ReferenceModel(meta["hf_config"], BundleWeights(b, meta["quantization"]),
                           latent_norm_eps=meta["hf_config"]["rms_norm_eps"])
    return b, greedy_generate(model, prompts, meta["decoding"]["max_new_tokens"], top_k=meta["decoding"]["top_k"],
                              forced=forced)


def assert_exact_under_the_convention(result: dict, bundle_path: Path, mode: str) -> None:
    """Tokens and top-k ids equal to the golden's and the variant's; logits within float32's budget of the golden
    (not exact: the convention moves them by ~1.5e-4) and within float32 rounding of the variant (<= 5e-5: the
    golden's eps, a float16 KV cache (~1e-2), a bfloat16 model or log-softmax values instead of logits would not
    pass)."""
    assert result["status"] == "ok", result.get("reason")
    b, ref = eps_variant_reference(bundle_path, mode)
    for i, (got, want) in enumerate(zip(result["runs"][0]["prompts"], ref)):
        golden_logits = np.asarray(b[f"golden.p{i}.topk_logits"])
        assert got["tokens"] == np.asarray(b[f"golden.p{i}.tokens"]).tolist() == want.tokens.tolist(), i
        assert got["topk_ids"] == want.topk_ids.tolist() == np.asarray(b[f"golden.p{i}.topk_ids"]).tolist(), i
        assert np.abs(np.asarray(got["topk_logits"]) - golden_logits).max() < 1e-3, i
        assert np.abs(np.asarray(got["topk_logits"]) - want.topk_logits).max() < 5e-5, i
