"""The GPU engine on the CPU: the float32 engine reproduces the golden exactly (tokens, top-k logits to 1e-4,
router choices, DDTree trees), with the Triton kernels run by the interpreter on the int4 bundle; and its
tree mask and KV compaction equal the numpy reference's on random trees."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, snakemake
from k2vec.ddtree import build_tree, compacted_kv_rows, tree_attention_mask
from k2vec.kdtr import open_bundle
from k2vec.reference.model import Dims
from k2vec.reference.model import KVCache as ReferenceCache

ENGINE_ENV = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-engine")
    targets = [f"results/bundles/tiny-{p}.kdtr" for p in ("fp32", "int4")]
    res = snakemake(*targets, "--cores", "2", "--directory", str(work), cwd=work,
                    env={"PYTHONPATH": str(REPO / "src")})
    assert res.returncode == 0, res.stderr[-3000:]
    return {p: work / t for p, t in zip(("fp32", "int4"), targets)}


def run_engine(bundle, mode, budget, out):
    cmd = [sys.executable, "-m", "k2vec.engines.gpu_triton", "--bundle", str(bundle), "--mode", mode,
           "--budget", str(budget), "--output", str(out), "--dtype", "float32", "--device", "cpu"]
    res = subprocess.run(cmd, env=ENGINE_ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def golden_rounds(b, budget, a, i):
    p = f"ddtree.b{budget}.a{a}.p{i}."
    off, aoff = np.asarray(b[p + "node_offsets"]), np.asarray(b[p + "accepted_offsets"])
    cols = {k: np.asarray(b[p + k]) for k in ("round_start", "round_bonus", "node_tokens", "node_parents",
                                               "node_depths", "accepted")}
    return [{"start": int(cols["round_start"][r]), "tokens": cols["node_tokens"][off[r]:off[r + 1]].tolist(),
             "parents": cols["node_parents"][off[r]:off[r + 1]].tolist(),
             "depths": cols["node_depths"][off[r]:off[r + 1]].tolist(),
             "accepted": cols["accepted"][aoff[r]:aoff[r + 1]].tolist(), "bonus": int(cols["round_bonus"][r])}
            for r in range(len(cols["round_start"]))]


def assert_greedy_matches(b, i, got, steps):
    """Tokens and router choices exact; the top-k logits (by rank, so a swap inside a near-tie does not
    count) within 1e-4 of the largest golden logit."""
    g_tokens = np.asarray(b[f"golden.p{i}.tokens"])[:steps]
    assert got["tokens"] == g_tokens.tolist()
    g_logits = np.asarray(b[f"golden.p{i}.topk_logits"])[:steps]
    e_logits = np.asarray(got["topk_logits"])
    assert e_logits.shape == g_logits.shape
    np.testing.assert_allclose(e_logits, g_logits, rtol=0, atol=1e-4 * np.abs(g_logits).max())
    prompt_len = len(b[f"prompt.p{i}.tokens"])
    g_router = np.asarray(b[f"golden.p{i}.router_ids"])[:, prompt_len - 1:prompt_len - 1 + steps]
    assert np.array_equal(np.asarray(got["router_experts"]), g_router.transpose(1, 0, 2))
    g_fp = np.asarray(b[f"golden.p{i}.fingerprints"])[:steps]
    np.testing.assert_allclose(np.asarray(got["fingerprints"]), g_fp, rtol=0, atol=1e-4 * np.abs(g_fp).max())


@pytest.mark.slow  # ~30 s on 2 cores: every prompt, every step, all drafter accuracies, score mode
def test_float32_engine_matches_golden_on_fp32_bundle(bundles, tmp_path):
    b = open_bundle(bundles["fp32"])
    greedy = run_engine(bundles["fp32"], "greedy", 0, tmp_path / "greedy.json")
    assert greedy["runs"][0]["drafter"] is None
    for i, got in enumerate(greedy["runs"][0]["prompts"]):
        assert_greedy_matches(b, i, got, b.metadata["decoding"]["max_new_tokens"])
    ddtree = run_engine(bundles["fp32"], "ddtree", 16, tmp_path / "ddtree.json")
    assert [r["drafter"]["accuracy"] for r in ddtree["runs"]] == b.metadata["golden"]["ddtree"]["accuracies"]
    for a, run in enumerate(ddtree["runs"]):
        for i, got in enumerate(run["prompts"]):
            assert got["tokens"] == np.asarray(b[f"ddtree.b16.a{a}.p{i}.tokens"]).tolist()
            assert got["rounds"] == golden_rounds(b, 16, a, i)
    # score mode: the golden tokens fed through the decode path give the golden's steps again
    score = run_engine(bundles["fp32"], "score", 0, tmp_path / "score.json")
    n = b.metadata["decoding"]["max_new_tokens"]
    for i, got in enumerate(score["runs"][0]["prompts"]):
        routed = np.asarray(got["router_experts"])   # every fed position, prompt included
        assert np.array_equal(routed, np.asarray(b[f"golden.p{i}.router_ids"]).transpose(1, 0, 2))
        got["router_experts"] = routed[len(b[f"prompt.p{i}.tokens"]) - 1:]
        assert_greedy_matches(b, i, got, n)


# The int4 bundle through the Triton kernels in the interpreter (slow: ~1 s per forward), so one prompt,
# a few greedy steps and two DDTree rounds: every packed nibble and scale of every layer is read each step.
INT4_SCRIPT = """
import json, sys
import numpy as np, torch
from k2vec.ddtree.drafter import RecordedDrafts
from k2vec.engines.gpu_triton.__main__ import greedy_decode
from k2vec.engines.gpu_triton.ddtree import ddtree_decode
from k2vec.engines.gpu_triton.model import Transformer
from k2vec.kdtr import open_bundle
b = open_bundle(sys.argv[1]); meta = b.metadata
p = np.asarray(b["prompt.p0.tokens"], np.int64)
model = Transformer(b, meta, torch.float32, "cpu", p.size + 64)
greedy = greedy_decode(model, [p], 3, meta["decoding"]["top_k"])[0]
# score mode on tokens the model would not choose: step j must see prompt + forced[:j]
forced = (np.asarray(b["golden.p0.tokens"][:3], np.int64) + 1 + np.arange(3)) % meta["model"]["vocab_size"]
score = greedy_decode(model, [p], 3, meta["decoding"]["top_k"], [forced])[0]
ids = np.asarray(b["drafts.a0.p0.ids"])
drafts = RecordedDrafts(ids, np.asarray(b["drafts.a0.p0.logprobs"]), np.full(ids.shape[:2], -1, np.int32), p.size)
tokens, rounds = ddtree_decode(model, [p], [drafts], 4, 8)[0]
print(json.dumps({"greedy": greedy, "score": score, "forced": forced.tolist(), "tokens": tokens, \
"rounds": [r.to_json() for r in rounds]}))
"""


def test_float32_engine_with_interpreted_kernels_matches_int4_golden(bundles):
    b = open_bundle(bundles["int4"])
    assert b.metadata["quantization"]["tensors"]  # the kernels really run
    res = subprocess.run([sys.executable, "-c", INT4_SCRIPT, str(bundles["int4"])], env=ENGINE_ENV,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert_greedy_matches(b, 0, out["greedy"], 3)
    assert out["tokens"] == np.asarray(b["golden.p0.tokens"])[:8].tolist()
    expected = golden_rounds(b, 4, 0, 0)
    assert len(out["rounds"]) >= 2 and out["rounds"] == expected[:len(out["rounds"])]
    # score mode against the numpy reference forced on the same tokens
    from k2vec.engines.numpy_engine import BundleWeights
    from k2vec.reference import ReferenceModel, greedy_generate
    meta = b.metadata
    ref = greedy_generate(ReferenceModel(meta["hf_config"], BundleWeights(b, meta["quantization"]),
                                         latent_norm_eps=meta["golden"]["reference"]["latent_norm_eps"]),
                          [np.asarray(b["prompt.p0.tokens"])], 3, top_k=meta["decoding"]["top_k"],
                          forced=[out["forced"]])[0]
    score = out["score"]
    assert score["tokens"] == ref.tokens.tolist()
    assert np.array_equal(score["router_experts"], ref.router_ids.transpose(1, 0, 2))  # prompt rows included
    np.testing.assert_allclose(score["topk_logits"], ref.topk_logits, rtol=0,
                               atol=1e-4 * np.abs(ref.topk_logits).max())


# ------------------------------------------------------------------ tree mask and KV compaction

def random_tree(rng, budget, depth=15, k=8, vocab=64):
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(depth)]).astype(np.int32)
    logprobs = -np.sort(rng.choice(np.arange(1, 200), size=(depth, k)) / 64.0, axis=1).astype(np.float32)
    return build_tree((ids, logprobs), budget)


@pytest.mark.parametrize("seed", range(6))
def test_tree_mask_equals_reference_on_random_trees(seed):
    from k2vec.engines.gpu_triton.ddtree import tree_mask
    rng = np.random.default_rng(seed)
    tree = random_tree(rng, budget=int(rng.integers(1, 64)))
    past = int(rng.integers(0, 20))
    depths = np.concatenate([[0], tree.node_depths])
    mask = tree_mask(torch.as_tensor(tree.parents.astype(np.int64)), int(depths.max()), past).numpy()
    assert np.array_equal(mask[:, past:], tree.visibility())
    assert np.array_equal(mask, tree_attention_mask(tree, past, np.float32) == 0)


@pytest.mark.parametrize("seed", range(6))
def test_kv_compaction_equals_reference_on_random_trees(seed):
    from k2vec.engines.gpu_triton.ddtree import compaction_rows
    from k2vec.engines.gpu_triton.model import KVCache
    from k2vec.ddtree import accept_walk
    rng = np.random.default_rng(100 + seed)
    d = Dims(vocab=64, hidden=8, intermediate=8, moe_intermediate=8, layers=2, heads=2, n_experts=0, n_shared=0,
             top_k=0, n_group=1, topk_group=1, first_dense=2, q_lora_rank=None, kv_lora_rank=4, nope=3, rope=2, v=5,
             eps=1e-6, routed_scaling_factor=1.0, norm_topk_prob=False)
    tree = random_tree(rng, budget=int(rng.integers(1, 40)))
    past, n1 = int(rng.integers(1, 12)), tree.n + 1
    # A target whose argmax follows a random root-to-leaf-ish path: accepted nodes form a real path.
    accepted, _ = accept_walk(tree, rng.integers(0, 64, n1))
    if len(accepted) == 1 and tree.n:  # make it accept at least one node sometimes
        accepted, _ = accept_walk(tree, np.where(np.arange(n1) == 0, tree.node_token_ids[0], -1))
    ref, ours = ReferenceCache(d, np.float32, capacity=past + n1), KVCache(d, past + n1, torch.float32, "cpu")
    rows = {name: rng.standard_normal((d.layers, past + n1) + shape).astype(np.float32)
            for name, shape in (("k_nope", (d.heads, d.nope)), ("k_pe", (d.rope,)), ("v", (d.heads, d.v)))}
    for layer in range(d.layers):
        ref.write(layer, rows["k_nope"][layer].transpose(1, 0, 2), rows["k_pe"][layer],
                  rows["v"][layer].transpose(1, 0, 2))
        ours.write(layer, *(torch.from_numpy(rows[k][layer]) for k in ("k_nope", "k_pe", "v")))
    ref.commit(np.arange(past + n1))
    ours.commit(past + n1)
    keep = compaction_rows(past, np.asarray(accepted), "cpu")
    assert np.array_equal(keep.numpy(), compacted_kv_rows(past, accepted))
    ref.keep(compacted_kv_rows(past, accepted))
    ours.keep(keep)
    assert ours.length == ref.length == past + len(accepted)
    for layer in range(d.layers):
        k_nope, k_pe, v = ref.view(layer, ref.length)
        assert np.array_equal(ours.k_nope[layer, :ours.length].numpy(), k_nope.transpose(1, 0, 2))
        assert np.array_equal(ours.k_pe[layer, :ours.length].numpy(), k_pe)
        assert np.array_equal(ours.v[layer, :ours.length].numpy(), v.transpose(1, 0, 2))
