"""KV cache, masks, cache.keep, routing and generation bookkeeping of the numpy reference (no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from k2vec.reference import (ReferenceModelError, ReferenceModel, Segment, greedy_generate, logits_no_cache, route,
                             top_k_sorted)
from k2vec.reference.model import Dims, to_float

CFG = dict(
    vocab_size=300, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=3, n_group=3, topk_group=2,
    first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
    rope_theta=50000.0, rms_norm_eps=1e-5, routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
)
REL = 1e-5


def random_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """fp32 DeepSeek-V3-named weights, ~N(0, 1/fan_in), so logits are O(1) and well separated."""
    rng = np.random.default_rng(seed)
    h, n_exp, mi = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    rope, v = cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    w: dict[str, np.ndarray] = {}

    def mat(name, out, inp, scale=1.0):
        w[name] = (rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(np.float32)

    def norm(name, n):
        w[name] = rng.uniform(0.8, 1.2, n).astype(np.float32)

    def mlp(prefix, inter):
        mat(prefix + "gate_proj.weight", inter, h)
        mat(prefix + "up_proj.weight", inter, h)
        mat(prefix + "down_proj.weight", h, inter)

    w["model.embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], h)).astype(np.float32)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", h)
        norm(p + "post_attention_layernorm.weight", h)
        a = p + "self_attn."
        if cfg["q_lora_rank"] is None:
            mat(a + "q_proj.weight", heads * (nope + rope), h)
        else:
            mat(a + "q_a_proj.weight", cfg["q_lora_rank"], h)
            norm(a + "q_a_layernorm.weight", cfg["q_lora_rank"])
            mat(a + "q_b_proj.weight", heads * (nope + rope), cfg["q_lora_rank"])
        mat(a + "kv_a_proj_with_mqa.weight", cfg["kv_lora_rank"] + rope, h)
        norm(a + "kv_a_layernorm.weight", cfg["kv_lora_rank"])
        mat(a + "kv_b_proj.weight", heads * (nope + v), cfg["kv_lora_rank"])
        mat(a + "o_proj.weight", h, heads * v)
        if i < cfg["first_k_dense_replace"]:
            mlp(p + "mlp.", cfg["intermediate_size"])
        else:
            mat(p + "mlp.gate.weight", n_exp, h)
            w[p + "mlp.gate.e_score_correction_bias"] = (rng.standard_normal(n_exp) * 0.1).astype(np.float32)
            for e in range(n_exp):
                mlp(f"{p}mlp.experts.{e}.", mi)
            mlp(p + "mlp.shared_experts.", mi * cfg["n_shared_experts"])
    norm("model.norm.weight", h)
    mat("lm_head.weight", cfg["vocab_size"], h, scale=3.0)
    return w


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(CFG, random_weights(CFG))


def close(a, b, rel=REL):
    assert np.abs(a - b).max() <= rel * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


SEQ = [7, 150, 3, 299, 42, 42, 8, 120, 77, 5, 61, 200, 13, 9]


def test_cached_decoding_equals_full_recomputation(model):
    full = logits_no_cache(model, SEQ)
    for chunks in ([5] + [1] * 9, [1] * 14, [3, 4, 2, 5]):  # prefill + single tokens, all singles, mixed blocks
        cache, got, start = model.new_cache(capacity=1), [], 0  # capacity 1: exercises buffer growth
        for c in chunks:
            got.append(model.forward(SEQ[start : start + c], cache=cache).logits)
            start += c
        close(np.concatenate(got), full)
        np.testing.assert_array_equal(cache.positions, np.arange(len(SEQ)))
    # Recorded hidden states and router choices also do not depend on the blocking.
    whole = model.forward(SEQ, record=True)
    cache = model.new_cache()
    head = model.forward(SEQ[:6], cache=cache, record=True)
    tail = model.forward(SEQ[6:], cache=cache, record=True)
    close(np.concatenate([head.hidden, tail.hidden], axis=1), whole.hidden)
    for i in model.moe_layers:
        np.testing.assert_array_equal(np.concatenate([head.router_ids[i], tail.router_ids[i]]), whole.router_ids[i])


def test_logits_depend_on_context_and_position(model):
    """Guards against a cache that is silently ignored, or RoPE that ignores positions."""
    base = logits_no_cache(model, SEQ[:6])[-1]
    cache = model.new_cache()
    model.forward(SEQ[:5], cache=cache)
    assert np.abs(model.forward(SEQ[5:6], cache=cache).logits[0] - base).max() < 1e-9
    alone = model.forward(SEQ[5:6], positions=[5]).logits[0]
    assert np.abs(alone - base).max() > 0.1
    cache = model.new_cache()
    model.forward(SEQ[:5], cache=cache)
    shifted = model.forward(SEQ[5:6], cache=cache, positions=[9]).logits[0]
    assert np.abs(shifted - base).max() > 1e-3


def test_siblings_under_mask_equal_separate_decoding(model):
    ctx, a, b = SEQ[:6], 11, 250
    ref = {}
    for tok in (a, b):
        cache = model.new_cache()
        model.forward(ctx, cache=cache)
        ref[tok] = model.forward([tok], cache=cache).logits[0]

    cache = model.new_cache()
    model.forward(ctx, cache=cache)
    n = len(ctx)
    mask = np.zeros((2, n + 2), bool)
    mask[:, :n] = True
    mask[0, n], mask[1, n + 1] = True, True  # each sibling sees the context and itself only
    out = model.forward([a, b], positions=[n, n], cache=cache, mask=mask).logits
    close(out[0], ref[a])
    close(out[1], ref[b])
    # The same mask in additive form.
    cache2 = model.new_cache()
    model.forward(ctx, cache=cache2)
    additive = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(model.forward([a, b], positions=[n, n], cache=cache2, mask=additive).logits, out)

    # Accept b: drop a's row, then continue; must equal plain decoding of ctx + [b, c].
    cache.keep(list(range(n)) + [n + 1])
    assert cache.length == n + 1
    np.testing.assert_array_equal(cache.positions, np.arange(n + 1))
    c = 99
    close(model.forward([c], cache=cache).logits[0], logits_no_cache(model, ctx + [b, c])[-1])


def test_tree_verification_then_keep_path(model):
    """A depth-2 draft tree after ctx:  a -> {c, d},  b -> {e}. Node order [a, b, c, d, e]."""
    ctx = SEQ[:7]
    n = len(ctx)
    a, b, c, d, e = 20, 21, 22, 23, 24
    parent = [-1, -1, 0, 0, 1]
    depth = [0, 0, 1, 1, 1]
    mask = np.zeros((5, n + 5), bool)
    mask[:, :n] = True
    for i in range(5):
        j = i
        while j >= 0:  # a node sees itself and its ancestors
            mask[i, n + j] = True
            j = parent[j]
    cache = model.new_cache()
    model.forward(ctx, cache=cache)
    out = model.forward([a, b, c, d, e], positions=[n + k for k in depth], cache=cache, mask=mask).logits
    paths = {0: [a], 1: [b], 2: [a, c], 3: [a, d], 4: [b, e]}
    for node, path in paths.items():
        close(out[node], logits_no_cache(model, ctx + path)[-1])
    # Accept path a -> d, keep its rows (in a scrambled order: attention must not care), continue with f.
    cache.keep([n + 3] + list(range(n)) + [n])
    np.testing.assert_array_equal(np.sort(cache.positions), np.arange(n + 2))
    close(model.forward([30], positions=[n + 2], cache=cache).logits[0], logits_no_cache(model, ctx + [a, d, 30])[-1])


def test_gathered_is_a_new_cache_of_the_selected_rows(model):
    """cache.gathered: the rows keep would leave, in a new cache with room for more; the source untouched."""
    def rows_of(c):
        return [a[:, : c.length] for a in c.k_nope + c.v] + [a[: c.length] for a in c.k_pe] + [c.positions]

    ctx = SEQ[:7]
    n = len(ctx)
    cache = model.new_cache()
    model.forward(ctx, cache=cache)
    model.forward([20, 21, 22], positions=[n, n, n + 1], cache=cache,
                  mask=np.concatenate([np.ones((3, n), bool), np.array([[1, 0, 0], [0, 1, 0], [0, 1, 1]], bool)],
                                      axis=1))
    path = list(range(n)) + [n + 1, n + 2]  # the context, then 21 -> 22
    before = [a.copy() for a in rows_of(cache)]
    new = cache.gathered(path, spare=5)
    assert new is not cache and new.length == n + 2 and new.capacity == n + 2 + 5
    for a, b in zip(rows_of(cache), before):  # the source is as it was
        np.testing.assert_array_equal(a, b)
    kept = cache.copy()
    kept.keep(path)
    for a, b in zip(rows_of(new), rows_of(kept)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(new.positions, np.arange(n + 2))
    close(model.forward([30, 31], cache=new).logits[-1], logits_no_cache(model, ctx + [21, 22, 30, 31])[-1])
    assert new.capacity == n + 2 + 5  # the next block fitted in the spare room: no reallocation
    with pytest.raises(ReferenceModelError, match="gathered"):
        cache.gathered([0, 0])
    with pytest.raises(ReferenceModelError, match="gathered"):
        cache.gathered([cache.length])


def test_default_mask_is_causal_and_masks_are_checked(model):
    cache = model.new_cache()
    model.forward(SEQ[:4], cache=cache)
    twin = cache.copy()
    explicit = np.concatenate([np.ones((3, 4), bool), np.tri(3, dtype=bool)], axis=1)
    np.testing.assert_array_equal(model.forward(SEQ[4:7], cache=cache).logits,
                                  model.forward(SEQ[4:7], cache=twin, mask=explicit).logits)
    with pytest.raises(ReferenceModelError):
        model.forward([1, 2], cache=model.new_cache(), mask=np.ones((2, 3), bool))  # wrong shape
    with pytest.raises(ReferenceModelError):
        model.forward([1, 2], mask=np.array([[True, False], [False, False]]))  # row 1 sees nothing
    with pytest.raises(ReferenceModelError):
        cache.keep([0, 0])
    with pytest.raises(ReferenceModelError):
        cache.keep([cache.length])


def test_forward_many_equals_separate_forwards(model):
    """Several sequences in one pass (row-wise ops shared, attention per cache) = one forward each."""
    blocks = [(SEQ[:3], SEQ[3:8]), (SEQ[5:6], SEQ[6:7]), (SEQ[:9], SEQ[9:11])]  # (already cached, new block)
    caches, alone = [], []
    for past, new in blocks:
        cache = model.new_cache()
        model.forward(past, cache=cache)
        caches.append(cache)
        twin = cache.copy()
        alone.append(model.forward(new, cache=twin, record=True))
    # The 2nd sequence's new token gets an explicit mask that hides its only cached row.
    mask1 = np.array([[False, True]])
    alone[1] = model.forward(SEQ[6:7], cache=model.new_cache(), positions=[1], record=True)
    segs = [Segment(np.array(new), c) for (_, new), c in zip(blocks, caches)]
    segs[1].mask, segs[1].positions = mask1, np.array([1])
    together = model.forward_many(segs, record=True)
    for a, b in zip(together, alone):
        close(a.logits, b.logits, rel=1e-12)
        close(a.hidden, b.hidden, rel=1e-12)
        for i in model.moe_layers:
            np.testing.assert_array_equal(a.router_ids[i], b.router_ids[i])
    last = model.forward_many([Segment(np.array([1, 2]), model.new_cache()), Segment(np.array([3]), model.new_cache())],
                              last_only=True)
    close(last[0].logits[0], logits_no_cache(model, [1, 2])[-1], rel=1e-12)
    close(last[1].logits[0], logits_no_cache(model, [3])[-1], rel=1e-12)
    shared = model.new_cache()
    with pytest.raises(ReferenceModelError):
        model.forward_many([Segment(np.array([1]), shared), Segment(np.array([2]), shared)])


def test_cache_copy_is_independent(model):
    cache = model.new_cache()
    model.forward(SEQ[:5], cache=cache)
    twin = cache.copy()
    model.forward(SEQ[5:9], cache=cache)  # grows and rewrites the original only
    np.testing.assert_array_equal(twin.positions, np.arange(5))
    close(model.forward([SEQ[5]], cache=twin).logits[0], logits_no_cache(model, SEQ[:6])[-1])


def test_route_group_limited_topk():
    d = Dims.from_config({**CFG, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                          "routed_scaling_factor": 2.0, "norm_topk_prob": True})
    # Biased scores per group (pairs): g0 {.9,.1}=1.0, g1 {.6,.55}=1.15, g2 {.7,.2}=.9, g3 {.56,.58}=1.14.
    # Plain top-3 would be 0, 4, 2; by group max g0 and g2 would win; by top-2 sum g1 and g3 do:
    # 2, 7, 6 (in selection order).
    choice = np.array([[0.9, 0.1, 0.6, 0.55, 0.7, 0.2, 0.56, 0.58]])
    bias = np.array([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])  # expert 2 only gets there through the bias
    scores = choice - bias
    logits = np.log(scores / (1 - scores))
    ids, weights, margin = route(logits, bias, d)
    np.testing.assert_array_equal(ids, [[2, 7, 6]])
    np.testing.assert_allclose(weights, np.array([[0.5, 0.58, 0.56]]) / 1.64 * 2.0)  # unbiased, normalised, scaled
    np.testing.assert_allclose(margin, [0.56 - 0.55])  # 3rd vs 4th among the kept groups
    # Only k experts survive the group mask -> no runner-up among experts; the margin is the kept group's
    # lead over the next (g1 1.15 vs g3 1.14): a near-tie of groups. Without normalisation: raw * scale.
    d2 = Dims.from_config({**CFG, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1,
                           "routed_scaling_factor": 2.0, "norm_topk_prob": False})
    ids, weights, margin = route(logits, bias, d2)
    np.testing.assert_array_equal(ids, [[2, 3]])
    np.testing.assert_allclose(weights, [[1.0, 1.1]])
    np.testing.assert_allclose(margin, [1.15 - 1.14])
    # The group lead is the margin wherever it is the smaller: experts 2 and 3 far ahead inside g1.
    d3 = Dims.from_config({**CFG, "n_routed_experts": 8, "num_experts_per_tok": 1, "n_group": 4, "topk_group": 1})
    ids, _, margin = route(logits, bias, d3)
    np.testing.assert_array_equal(ids, [[2]])
    np.testing.assert_allclose(margin, [1.15 - 1.14])
    # One group: no group margin, the expert margin alone.
    d4 = Dims.from_config({**CFG, "n_routed_experts": 8, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1})
    _, _, margin = route(logits, bias, d4)
    np.testing.assert_allclose(margin, [0.9 - 0.7])


def test_only_used_weights_are_read_and_cache_budget(model):
    weights = random_weights(CFG)
    seen: set[str] = set()

    class Spy(dict):
        def __getitem__(self, k):
            seen.add(k)
            return dict.__getitem__(self, k)

    lazy = ReferenceModel(CFG, Spy(weights), weight_cache_bytes=20_000)  # smaller than one layer
    out = lazy.forward([5], record=True)
    for i in lazy.moe_layers:
        used = {int(n.split(".")[5]) for n in seen if f"layers.{i}.mlp.experts." in n}
        assert used == set(out.router_ids[i][0].tolist())
    assert lazy.w._bytes <= 20_000 or len(lazy.w._cache) == 1
    np.testing.assert_array_equal(out.logits, model.forward([5]).logits)


def test_bf16_bits_and_float32_compute(model):
    x = np.array([1.0, -2.5, 3.140625], np.float32)
    np.testing.assert_array_equal(to_float((x.view(np.uint32) >> 16).astype(np.uint16), np.float64), x)
    fast = ReferenceModel(CFG, random_weights(CFG), dtype=np.float32)
    out = fast.forward(SEQ).logits
    assert out.dtype == np.float32
    close(out, logits_no_cache(model, SEQ), rel=1e-4)


def test_top_k_sorted_ties_to_lower_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.5, 2.0, 3.0])
    np.testing.assert_array_equal(top_k_sorted(logits, 4), [1, 3, 6, 2])
    np.testing.assert_array_equal(top_k_sorted(logits, 2), [1, 3])


def test_greedy_generate_records(model):
    prompts = [SEQ[:5], SEQ[:2], SEQ[3:12]]
    res = greedy_generate(model, prompts, max_new_tokens=6, top_k=5)
    L, H, k = CFG["num_hidden_layers"], CFG["hidden_size"], CFG["num_experts_per_tok"]
    for prompt, r in zip(prompts, res):
        p, n = len(prompt), 6
        seq = prompt + r.tokens.tolist()
        full = model.forward(seq, record=True)
        logits = full.logits[p - 1 : -1]
        np.testing.assert_array_equal(r.tokens, logits.argmax(-1))  # greedy, checked against recomputation
        assert r.topk_ids.shape == (n, 5) and r.hidden.shape == (n, L, H)
        np.testing.assert_array_equal(r.topk_ids, [top_k_sorted(row, 5) for row in logits])
        close(r.topk_logits, np.take_along_axis(logits, r.topk_ids, -1))
        srt = np.sort(logits, -1)
        close(r.margins, srt[:, -1] - srt[:, -2])
        close(r.hidden, full.hidden[:, p - 1 : -1].transpose(1, 0, 2))
        np.testing.assert_array_equal(r.moe_layers, model.moe_layers)
        assert r.router_ids.shape == (len(model.moe_layers), p + n - 1, k)
        for m, i in enumerate(model.moe_layers):
            np.testing.assert_array_equal(r.router_ids[m], full.router_ids[i][:-1])
            close(r.router_margins[m], full.router_margins[i][:-1])
    # A stop token ends generation right after it is emitted.
    first = res[0].tokens
    stopped = greedy_generate(model, [prompts[0]], max_new_tokens=6, stop_tokens=[int(first[2])])[0]
    assert stopped.tokens.tolist() == first[: list(first).index(first[2]) + 1].tolist()
    assert stopped.router_ids.shape[1] == len(prompts[0]) + len(stopped.tokens) - 1


def test_forced_decoding_feeds_the_given_tokens(model):
    """Score mode: step j sees the prompt and forced[:j] (not the model's own tokens), records the
    model's argmax and top-k there, and routes every fed position, prompt included."""
    prompts = [SEQ[:5], SEQ[3:12]]
    greedy = greedy_generate(model, prompts, max_new_tokens=6, top_k=5)
    # forced tokens that are never the model's own choice after step 0
    forced = [(g.tokens + 1 + np.arange(6)) % CFG["vocab_size"] for g in greedy]
    res = greedy_generate(model, prompts, max_new_tokens=6, top_k=5, forced=forced)
    for prompt, f, g, r in zip(prompts, forced, greedy, res):
        p = len(prompt)
        full = model.forward(prompt + f.tolist(), record=True)
        logits = full.logits[p - 1: -1]
        np.testing.assert_array_equal(r.tokens, logits.argmax(-1))
        np.testing.assert_array_equal(r.topk_ids, [top_k_sorted(row, 5) for row in logits])
        close(r.topk_logits, np.take_along_axis(logits, r.topk_ids, -1))
        close(r.hidden, full.hidden[:, p - 1: -1].transpose(1, 0, 2))
        assert r.router_ids.shape[1] == p + 6 - 1
        for m, i in enumerate(model.moe_layers):
            np.testing.assert_array_equal(r.router_ids[m], full.router_ids[i][:-1])
        assert r.tokens[0] == g.tokens[0] and not np.array_equal(r.tokens[1:], g.tokens[1:])
    with pytest.raises(ReferenceModelError, match="forced decoding needs 6 tokens"):
        greedy_generate(model, prompts, max_new_tokens=6, forced=[f[:5] for f in forced])
