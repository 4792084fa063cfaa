"""The mutant catalogue (k2vec.mutation.catalogue) and the mutation run (rule mutation_report).

Unit tests: every mutant really changes what the engine computes on a small random model, and leaves
nothing behind when its context exits. The pipeline test runs three mutants through the real rules
on the tiny model and checks the report catches each of them while the unmutated engine raises no alarm."""
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from k2vec.ddtree import record_drafts
from k2vec.mutation import catalogue as mutants
from k2vec.mutation.catalogue import CATALOGUE, MUTANTS, MutantError, injected
from k2vec.engines.numpy_engine import BundleWeights
from k2vec.model.int4 import quantize_packed
from k2vec.reference import ReferenceModel, greedy_generate
from k2vec.reference import model as ref
from k2vec.reference import speculative
from k2vec.reference.model import KVCache
from k2vec.reference.speculative import DDTreeJob, ddtree_generate
from k2vec.ddtree.tree import Tree
from conftest import REPO, copy_workflow, default_config, snakemake, write_config
from test_reference_cache import CFG, random_weights
from test_workflow import scheduled_jobs

# The random model of the reference tests, widened so that every MLP input dimension is a multiple of
# the INT4 group size (32), with YaRN's mscale on cos/sin differing from the plain get_mscale.
MCFG = {**CFG, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "q_lora_rank": 32,
        "routed_scaling_factor": 2.827}   # K2's: router_scaling_truncated changes it (2.8)
PROMPTS = [[5, 17, 200, 3, 9, 41], [250, 1, 2, 3, 4, 5, 6, 7], [9, 120, 33]]
N_NEW = 6


class FakeBundle(dict):
    """What BundleWeights reads from a KDTR bundle: plain tensors, and `.qw`/`.sc` for quantized ones."""

    def release(self, name):  # a KDTR bundle drops the tensor's pages; nothing to drop in memory
        pass

    def info(self, name):  # a KDTR bundle's tensor entry, as far as BundleWeights.shape_of reads it
        return SimpleNamespace(shape=self[name].shape)


def int4_weights(weights: dict) -> BundleWeights:
    mlp = [n for n in weights if re.search(r"mlp\..*(gate_proj|up_proj|down_proj)\.weight$", n)]
    bundle = FakeBundle({n: w for n, w in weights.items() if n not in mlp})
    for n in mlp:
        bundle[n + ".qw"], bundle[n + ".sc"] = quantize_packed(weights[n], 32, "float32")
    return BundleWeights(bundle, {"group_size": 32, "scale_dtype": "float32", "tensors": mlp})


@pytest.fixture(scope="module")
def source():
    return int4_weights(random_weights(MCFG, seed=5))


@pytest.fixture(scope="module")
def base(source):
    return greedy(source)[1]


def greedy(source):
    model = ReferenceModel(MCFG, source)
    return model, greedy_generate(model, PROMPTS, N_NEW)


def ddtree(source, tokens):
    model = ReferenceModel(MCFG, source)
    jobs = [DDTreeJob(np.array(p), record_drafts(t, prompt_len=len(p), vocab_size=MCFG["vocab_size"], accuracy=0.6,
                                                 prompt_key=i, seed=1, block_size=6, k_stored=8, n_starts=N_NEW),
                      8)
            for i, (p, t) in enumerate(zip(PROMPTS, tokens))]
    return model, ddtree_generate(model, jobs, N_NEW)


def trace(results):
    return [(r.tokens.tolist(), [(x.accepted.tolist(), x.bonus) for x in r.rounds]) for r in results]


def state():
    """Everything a mutant may swap, to check that the context puts it all back."""
    return ({n: getattr(ref, n) for n in ("rms_norm", "apply_rope", "route", "group_scores", "silu")},
            {n: getattr(speculative, n) for n in ("tree_positions", "accept_walk", "compacted_kv_rows",
                                                  "ancestor_visibility")},
            KVCache.view, Tree.visibility)


def test_catalogue_covers_the_issue():
    assert len(CATALOGUE) >= 24 and len(MUTANTS) == len(CATALOGUE)
    assert {m.area for m in CATALOGUE} == set(mutants.AREAS)
    assert {"mla_latent_norm_eps_rms", "yarn_ramp_swapped", "yarn_interpolation_skipped"} <= set(MUTANTS)
    with pytest.raises(MutantError, match="unknown mutant 'nope'"):
        mutants.get("nope")


def test_docs_list_every_mutant_once():
    listed = re.findall(r"^- `([a-z0-9_]+)`: .+\. Stands for: .+\.$", (REPO / "docs/mutants.md").read_text(), re.M)
    assert sorted(listed) == sorted(MUTANTS)


@pytest.mark.parametrize("name", [m.name for m in CATALOGUE if m.area != "ddtree"])
def test_mutant_changes_the_logits_and_is_undone(source, base, name):
    before = state()
    with injected(name) as install:
        model = ReferenceModel(MCFG, source)
        install(model)
        bad = greedy_generate(model, PROMPTS, N_NEW)
    assert state() == before
    err = max(np.abs(b.topk_logits[:, 0] - g.topk_logits[:, 0]).max() for b, g in zip(bad, base))
    assert err > 1e-7, f"{name} changed nothing"
    again = greedy(source)[1]  # nothing left behind in the shared weights either
    for a, g in zip(again, base):
        np.testing.assert_array_equal(a.topk_logits, g.topk_logits)


@pytest.mark.parametrize("name", [m.name for m in CATALOGUE if m.area == "ddtree"])
def test_ddtree_mutant_changes_the_rounds_and_is_undone(source, base, name):
    tokens = [g.tokens for g in base]
    base = trace(ddtree(source, tokens)[1])
    before = state()
    with injected(name) as install:
        model = ReferenceModel(MCFG, source)
        install(model)
        jobs = [DDTreeJob(np.array(p), record_drafts(t, prompt_len=len(p), vocab_size=MCFG["vocab_size"],
                                                     accuracy=0.6, prompt_key=i, seed=1, block_size=6, k_stored=8,
                                                     n_starts=N_NEW), 8)
                for i, (p, t) in enumerate(zip(PROMPTS, tokens))]
        bad = trace(ddtree_generate(model, jobs, N_NEW))
    assert state() == before
    assert bad != base, f"{name} changed nothing"
    assert trace(ddtree(source, tokens)[1]) == base


def test_exercised_only_where_the_code_path_runs():
    cfg = default_config()
    from k2vec.config.expand import expand_config
    case = expand_config(cfg)["tiny"]
    m, q = case["model"], case["quantization"]
    assert MUTANTS["int4_nibble_order"].exercised(m, q, "int4", "greedy", 0)
    assert not MUTANTS["int4_nibble_order"].exercised(m, q, "fp32", "greedy", 0)
    assert not MUTANTS["int4_scale_bf16"].exercised(m, {**q, "scale_dtype": "bfloat16"}, "int4", "score", 0)
    assert MUTANTS["ddtree_mask_causal"].exercised(m, q, "fp32", "ddtree", 4)
    assert not MUTANTS["ddtree_mask_causal"].exercised(m, q, "fp32", "ddtree", 1)
    assert not MUTANTS["ddtree_mask_causal"].exercised(m, q, "fp32", "greedy", 0)
    assert not MUTANTS["rope_decode_position_off_by_one"].exercised(m, q, "fp32", "ddtree", 16)
    assert not MUTANTS["yarn_ramp_swapped"].exercised({**m, "rope_scaling": None}, q, "fp32", "greedy", 0)
    assert not MUTANTS["router_groups_ignored"].exercised({**m, "n_group": 1, "topk_group": 1}, q, "fp32", "greedy", 0)


# ------------------------------------------------------------------------------ through the rules

SUBSET = ["int4_nibble_order", "mla_softmax_no_mscale", "ddtree_positions_index"]


@pytest.fixture(scope="module")
def mutation_run(tmp_path_factory):  # weights, goldens, bundles, 8 numpy runs, 3 mutants: over 20 s, so slow
    """The tiny model, the numpy engine alone, budgets 1 and 4, three mutants: `snakemake mutation_report`."""
    root = copy_workflow(tmp_path_factory.mktemp("mutation"))
    config = default_config()
    config["models"] = {"tiny": config["models"]["tiny"]}
    config["engines"] = {"numpy": config["engines"]["numpy"]}
    config["decoding"]["ddtree"]["budgets"] = [1, 4]
    config["mutation"] = {"mutants": SUBSET}
    cfg = write_config(root / "mutation.yaml", config)
    env = {"PYTHONPATH": str(root / "src")}
    args = ("--cores", "2", "--configfile", str(cfg), "--replace-workflow-config")
    dry = snakemake(*args, "-n", snakefile=root / "Snakefile", cwd=root, env=env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    res = snakemake(*args, "mutation_report", snakefile=root / "Snakefile", cwd=root, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return root, dry, pd.read_csv(root / "results/mutation/mutation.csv"), \
        pd.read_csv(root / "results/mutation/mutation_rows.csv")


@pytest.mark.slow
def test_default_target_runs_no_mutant(mutation_run):
    _, dry, _, _ = mutation_run
    jobs = scheduled_jobs(dry.stdout)
    assert jobs.get("engine_batch_numpy") and "mutant_runs" not in jobs and "mutation_report" not in jobs


@pytest.mark.slow
def test_mutants_caught_and_unmutated_engine_not(mutation_run):
    root, _, scores, rows = mutation_run
    # every mutant at float32 and at bfloat16 (emulated: score runs; the DDTree mutant's DDTree runs)
    assert sorted(scores.loc[scores["compute"] == "float32", "mutant"]) == sorted(SUBSET)
    assert sorted(scores.loc[scores["compute"] == "bfloat16", "mutant"]) == sorted(SUBSET)
    assert scores["caught"].all(), scores.to_string()
    plain = scores[(scores["compute"] == "float32") | (scores["area"] != "ddtree")]
    assert (plain["verdict"] == "caught").all(), scores[["mutant", "compute", "verdict"]].to_string()
    assert (plain["catch_rate"] >= 0.75).all(), scores[["mutant", "catch_rate"]].to_string()
    # a tree bug at bfloat16 is seen until the engine leaves the golden's tokens (the recorded drafts follow
    # them): caught in some rows, and caught in 3/4 of them or said to be below the precision's resolution
    tree = scores[(scores["compute"] == "bfloat16") & (scores["area"] == "ddtree")].iloc[0]
    assert tree["verdict"] in ("caught", "below resolution"), tree.to_string()
    assert set(scores["class"]) <= {"real", "over-budget"}
    for engine in ("numpy", "numpy-bfloat16"):   # the unmutated engine at each precision: no false alarm
        control = rows[rows["engine"] == engine]
        assert len(control) and not control["caught"].any(), engine
    mine = rows[rows["mutant"].notna()]
    # each mutant only where its code path runs: INT4 on int4, the tree mutant in ddtree-b4 only
    assert set(mine.loc[mine["mutant"] == "int4_nibble_order", "precision"]) == {"int4"}
    assert set(mine.loc[mine["mutant"] == "ddtree_positions_index", "mode"]) == {"ddtree-b4"}
    assert set(mine.loc[mine["mutant"] == "mla_softmax_no_mscale", "mode"]) == {
        "greedy", "score", "ddtree-b1", "ddtree-b4"}
    html = (root / "results/mutation/mutation.html").read_text()
    assert "mutation score float32: 3/3 mutants caught (100.0%)" in html and 'id="mutation-table"' in html
    assert "bfloat16: 3/3 mutants caught (100.0%)" in html


# ------------------------------------------------------------------------------ the plan


def test_plan_runs_tree_mutants_with_their_greedy_reference_at_every_precision():
    """At bfloat16 a plain mutant runs its score runs only; a DDTree mutant its DDTree runs where its tree has
    branches, plus greedy (its lossless check's reference, mutation/plan.py), and the unmutated engine the same
    modes; at float32 the greedy reference is added where the mutant runs DDTree."""
    from k2vec.mutation.plan import UNMUTATED, plan
    case = {"model": {"n_routed_experts": 8, "first_k_dense_replace": 1, "num_hidden_layers": 3,
                      "q_lora_rank": 32, "rope_scaling": None}, "quantization": {}}
    modes = ["greedy", "score", "ddtree-b1", "ddtree-b4"]
    runs = [("numpy", "tiny", "fp32", m) for m in modes]
    config = {"mutation": {"mutants": ["experts_gelu", "ddtree_positions_index"]}}
    out, problem = plan(config, {"numpy": {}}, runs, {"tiny": case})
    assert problem is None
    assert out[("ddtree_positions_index", "tiny", "fp32", "float32")] == ["greedy", "ddtree-b4"]
    assert out[("ddtree_positions_index", "tiny", "fp32", "bfloat16")] == ["greedy", "ddtree-b4"]
    assert out[("experts_gelu", "tiny", "fp32", "bfloat16")] == ["score"]
    assert out[(UNMUTATED, "tiny", "fp32", "bfloat16")] == modes
    # without a DDTree mutant the reduced precision runs score runs alone
    out, _ = plan({"mutation": {"mutants": ["experts_gelu"]}}, {"numpy": {}}, runs, {"tiny": case})
    assert out[(UNMUTATED, "tiny", "fp32", "bfloat16")] == ["score"]


def test_the_mixing_ladder_names_catalogue_mutants_in_growing_order():
    from k2vec.report.resolution import MIXING_LADDER
    assert all(name in MUTANTS and MUTANTS[name].area == "router" for name, _ in MIXING_LADDER)
    sizes = [float(label.rstrip("%")) for _, label in MIXING_LADDER]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
