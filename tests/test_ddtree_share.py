"""Shared DDTree verification (k2vec.reference.speculative.ddtree_generate): jobs in the same state verify the
union of their trees in one segment over one cache. The union is the trees merged by token path; each job's
rounds are the ones it has decoded alone; and the work really is shared (rows and segments counted)."""
import numpy as np
import pytest

from k2vec.ddtree import build_tree, record_drafts, tree_positions
from k2vec.reference import ReferenceModel, greedy_generate, speculative
from k2vec.reference.speculative import DDTreeJob, _UnionTree, ddtree_generate
from test_reference_cache import CFG, random_weights

V = CFG["vocab_size"]
PROMPTS = [[5, 17, 200, 3], [250, 1, 2, 3, 4, 5, 6], [9]]
ACCURACIES = (1.0, 0.5, 0.0)
BUDGETS = (1, 4, 16)
N_NEW = 14


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(CFG, random_weights(CFG, seed=3))


@pytest.fixture(scope="module")
def greedy(model):
    return [g.tokens for g in greedy_generate(model, PROMPTS, N_NEW)]


def drafts(golden, prompt: int, accuracy: float, k_stored: int = 16):
    return record_drafts(golden, prompt_len=len(PROMPTS[prompt]), vocab_size=V, accuracy=accuracy, prompt_key=prompt,
                         seed=1, block_size=8, k_stored=k_stored, n_starts=N_NEW)


def paths(tokens, parents) -> list[tuple[int, ...]]:
    """The token path below the root of every node (the root's: ())."""
    out = [()]
    for i in range(1, len(parents)):
        out.append(out[parents[i]] + (int(tokens[i]),))
    return out


def counting(model):
    """Wrap model.forward_many to record, per pass, the rows of each segment."""
    passes = []
    inner = model.forward_many

    def counted(segments, *args, **kwargs):
        passes.append([np.asarray(s.tokens).size for s in segments])
        return inner(segments, *args, **kwargs)
    model.forward_many = counted
    return passes


def test_union_tree_merges_by_token_path():
    rng = np.random.default_rng(0)
    golden = rng.integers(0, V, size=40)
    trees = [build_tree(d.round(4), budget) for accuracy in ACCURACIES
             for d in [record_drafts(golden, prompt_len=4, vocab_size=V, accuracy=accuracy, prompt_key=0, seed=2,
                                     block_size=6, k_stored=16)]
             for budget in BUDGETS]
    union = _UnionTree(root=42)
    maps = [union.add(t) for t in trees]
    u_paths = paths(union.tokens, union.parents)
    member_paths = set()
    for tree, index in zip(trees, maps):
        t_paths = paths(np.concatenate([[42], tree.node_token_ids]), tree.parents)
        assert [u_paths[u] for u in index] == t_paths  # every node maps to the union node of its token path
        member_paths.update(t_paths)
    # A path several trees hold is one node, and the union holds nothing else.
    assert len(set(u_paths)) == len(u_paths) == union.n + 1
    assert set(u_paths) == member_paths
    assert union.n < sum(t.n for t in trees)  # the trees do overlap, so the check above is not vacuous
    assert union.tokens[0] == 42 and union.parents[0] == -1
    assert all(union.parents[i] < i for i in range(1, union.n + 1))  # a parent before its children
    want = np.array([[u_paths[i][:len(u_paths[j])] == u_paths[j] for j in range(union.n + 1)]
                     for i in range(union.n + 1)])  # j is i or an ancestor of i: its path is a prefix of i's
    np.testing.assert_array_equal(union.visibility(), want)
    np.testing.assert_array_equal(tree_positions(union, 9), 9 + np.array([len(p) for p in u_paths]))


def test_smaller_budget_tree_is_the_union_prefix():
    d = drafts(np.arange(N_NEW) + 30, 0, 0.5)
    union = _UnionTree(root=7)
    big = union.add(build_tree(d.round(4), 16))
    small = union.add(build_tree(d.round(4), 4))
    assert union.n == 16
    np.testing.assert_array_equal(big, np.arange(17))
    np.testing.assert_array_equal(small, np.arange(5))


def trace(result):
    return (result.tokens.tolist(),
            [(r.start, r.node_tokens.tolist(), r.parents.tolist(), r.depths.tolist(), r.accepted.tolist(), r.bonus)
             for r in result.rounds])


def test_each_job_decodes_together_as_alone(model, greedy):
    jobs = [DDTreeJob(np.array(p), drafts(greedy[i], i, accuracy), budget)
            for i, p in enumerate(PROMPTS) for accuracy in ACCURACIES for budget in BUDGETS]
    jobs.append(jobs[4])  # a job twice: identical trees, one union
    together = ddtree_generate(model, jobs, N_NEW)
    for job, res in zip(jobs, together):
        assert trace(res) == trace(ddtree_generate(model, [job], N_NEW)[0])
        np.testing.assert_array_equal(res.tokens, greedy[PROMPTS.index(job.prompt.tolist())])
    # The decodings covered jobs of one prompt that were in different states in a round and in the same
    # state after it (their states merged: one cache taken over by the other).
    starts = [[r.start for r in res.rounds] for res in together]
    merged = [(a, b) for a in range(len(jobs)) for b in range(a)
              if jobs[a].prompt.tolist() == jobs[b].prompt.tolist()
              and any(sa[r] != sb[r] and sa[r + 1] == sb[r + 1]
                      for sa, sb in [(starts[a], starts[b])] for r in range(min(len(sa), len(sb)) - 1))]
    assert merged


def test_jobs_share_only_identical_tokens(model, greedy, monkeypatch):
    """A walk whose bonus depends on the tree size (a faulty engine's): jobs of one prompt emit different
    tokens, in states of equal length that must not be merged. Each still decodes as it does alone."""
    walk = speculative.accept_walk

    def skewed(tree, target_argmax):
        accepted, bonus = walk(tree, target_argmax)
        return accepted, (bonus + tree.n) % V
    monkeypatch.setattr(speculative, "accept_walk", skewed)
    jobs = [DDTreeJob(np.array(PROMPTS[1]), drafts(greedy[1], 1, accuracy), budget)
            for accuracy in ACCURACIES for budget in BUDGETS]
    together = ddtree_generate(model, jobs, N_NEW)
    assert len({tuple(r.tokens) for r in together}) > 1
    for job, res in zip(jobs, together):
        assert trace(res) == trace(ddtree_generate(model, [job], N_NEW)[0])


def test_each_state_cache_holds_its_own_tokens(model, greedy):
    """Every cache a round verifies against holds the keys and values of its context, computed afresh (the
    rows each new state takes from its group's cache are its accepted path's, mapped into the union)."""
    prompt = PROMPTS[0]
    context = np.concatenate([prompt, greedy[0]])
    seen = []
    inner = model.forward_many

    def recording(segments, *args, **kwargs):
        for s in segments:
            c = s.cache
            seen.append((c.length, [np.concatenate([c.k_nope[i][:, :c.length].ravel(), c.k_pe[i][:c.length].ravel(),
                                                    c.v[i][:, :c.length].ravel()]) for i in range(c.dims.layers)]))
        return inner(segments, *args, **kwargs)
    model.forward_many = recording
    try:
        # Accuracy first: a job that is not the union's first tree is often the first to reach its new state.
        ddtree_generate(model, [DDTreeJob(np.array(prompt), drafts(greedy[0], 0, accuracy), budget)
                                for budget in BUDGETS for accuracy in sorted(ACCURACIES)], N_NEW)
    finally:
        del model.forward_many
    assert len(seen) > len(BUDGETS)
    for length, rows in seen[1:]:  # after the prefill
        fresh = model.new_cache()
        model.forward(context[:length], cache=fresh)
        for i, got in enumerate(rows):
            want = np.concatenate([fresh.k_nope[i][:, :length].ravel(), fresh.k_pe[i][:length].ravel(),
                                   fresh.v[i][:, :length].ravel()])
            assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max(), (length, i)


def test_jobs_in_one_state_verify_one_union(model, greedy):
    d = drafts(greedy[0], 0, 1.0)
    passes = counting(model)
    try:
        res = ddtree_generate(model, [DDTreeJob(np.array(PROMPTS[0]), d, b) for b in (4, 16)], N_NEW)
    finally:
        del model.forward_many
    first = [r.rounds[0] for r in res]
    assert [len(r.node_tokens) for r in first] == [5, 17]  # 22 rows if verified apart
    assert passes[0] == [len(PROMPTS[0])]  # one prefill
    assert passes[1] == [17]  # the 4-node tree is the first nodes of the 16-node tree: 17 rows, one segment


def test_prefill_once_per_prompt_and_one_segment_per_state(model, greedy):
    jobs = [DDTreeJob(np.array(p), drafts(greedy[i], i, accuracy), budget)
            for i, p in enumerate(PROMPTS[:2]) for accuracy in ACCURACIES for budget in BUDGETS]
    passes = counting(model)
    try:
        res = ddtree_generate(model, jobs, N_NEW)
    finally:
        del model.forward_many
    assert passes[0] == [len(PROMPTS[0]), len(PROMPTS[1])]  # 18 jobs, 2 prompts: 2 prefill rows blocks
    for k, rows in enumerate(passes[1:]):
        live = [(job, r) for job, r in zip(jobs, res) if len(r.rounds) > k]
        # All jobs of a prompt emit its greedy tokens: a state is a prompt and a round start.
        states = {(tuple(job.prompt), r.rounds[k].start) for job, r in live}
        live = [r for _, r in live]
        assert len(rows) == len(states)  # one segment per state
        # Each state verifies the union of its jobs' trees: at least the largest of them, at most all of them.
        assert max(len(r.rounds[k].node_tokens) for r in live) <= max(rows)
        assert sum(rows) <= sum(len(r.rounds[k].node_tokens) for r in live)
    assert sum(map(sum, passes[1:])) < sum(len(x.node_tokens) for r in res for x in r.rounds)
