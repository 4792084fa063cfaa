"""Tree verification in the reference model: every tree node's logits equal sequential decoding of
its root path (property test on random DDTree trees), and DDTree decoding is lossless."""
import numpy as np
import pytest

from k2vec.ddtree import build_tree, record_drafts
from k2vec.reference import ReferenceModel, greedy_generate, logits_no_cache
from k2vec.reference.speculative import DDTreeJob, ddtree_generate
from test_reference_cache import CFG, random_weights

REL = 1e-5


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(CFG, random_weights(CFG, seed=3))


def root_paths(tree):
    """Token path of every node (root included) from the parents array."""
    tokens = np.concatenate([[-1], tree.node_token_ids])
    paths = [[]]
    for i in range(1, tree.n + 1):
        paths.append(paths[tree.parents[i]] + [int(tokens[i])])
    return paths


@pytest.mark.parametrize("seed", range(12))
def test_tree_node_logits_equal_sequential_root_path(model, seed):
    rng = np.random.default_rng(seed)
    V = CFG["vocab_size"]
    ctx = rng.integers(0, V, size=int(rng.integers(1, 9))).tolist()
    root = int(rng.integers(0, V))
    depth_cap, budget = int(rng.integers(1, 7)), int(rng.integers(1, 40))
    # Peaked random draft logits so trees are deep as well as wide.
    draft = rng.standard_normal((depth_cap, V)) * rng.uniform(0.5, 4.0)
    tree = build_tree(draft.astype(np.float32), budget)
    cache = model.new_cache()
    model.forward(ctx, cache=cache)
    start = len(ctx)
    node_tokens = np.concatenate([[root], tree.node_token_ids])
    depths = np.concatenate([[0], tree.node_depths])
    mask = np.concatenate([np.ones((tree.n + 1, start), bool), tree.visibility()], axis=1)
    out = model.forward(node_tokens, positions=start + depths, cache=cache, mask=mask).logits
    for node, path in enumerate(root_paths(tree)):
        want = logits_no_cache(model, ctx + [root] + path)[-1]
        err = np.abs(out[node] - want).max() / np.abs(want).max()
        assert err <= REL, (node, err)


def test_ddtree_decoding_is_lossless_for_any_drafts(model):
    V = CFG["vocab_size"]
    prompts = [[5, 17, 200, 3], [250, 1, 2, 3, 4, 5, 6], [9]]
    n_new = 20
    greedy = greedy_generate(model, prompts, n_new)
    jobs, want = [], []
    for i, (p, g) in enumerate(zip(prompts, greedy)):
        for accuracy in (1.0, 0.5, 0.0):
            drafts = record_drafts(g.tokens, prompt_len=len(p), vocab_size=V, accuracy=accuracy, prompt_key=i,
                                   seed=1, block_size=8, k_stored=16, n_starts=n_new)
            for budget in (1, 4, 16):
                jobs.append(DDTreeJob(np.array(p), drafts, budget))
                want.append((g.tokens, accuracy, budget))
    results = ddtree_generate(model, jobs, n_new)
    mean = {}
    for res, (tokens, accuracy, budget) in zip(results, want):
        np.testing.assert_array_equal(res.tokens, tokens)
        lengths = res.acceptance_lengths
        assert lengths.sum() >= n_new - 1 and (lengths >= 1).all()
        if accuracy == 1.0 and budget == 1:
            # A one-node tree holding the golden token: every round but the last accepts it.
            assert (lengths[:-1] == 2).all(), lengths
        if accuracy == 0.0:
            # The golden token is drafted only outside rank 0, and a budget of 1 holds rank 0 only.
            assert budget > 1 or (lengths == 1).all()
        mean.setdefault(accuracy, []).extend(lengths.tolist())
    assert np.mean(mean[1.0]) > np.mean(mean[0.5]) > np.mean(mean[0.0])
