"""Every integer of a result is bounded by the runner's check (issue 28, items 4 and 10): DDTree rounds
(tokens and bonus in the vocabulary, parents and accepted nodes in the tree, starts in the generated
positions), fingerprint widths, and the ids of greedy and score results. A violation is a failed run with
a short reason naming the field, the round or step and the prompt; a result the check accepts never
crashes the report. The fuzz test injects hostile integers at every integer field of real results."""
import copy
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import yaml

from conftest import REPO
from test_report_metrics import make_goldens
from test_runner import fake_engine

from k2vec.config.expand import expand_config
from k2vec.digests import write_record
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.expectations import Expectations, expectations_from_bundle
from k2vec.engines.runner import run_engine
from k2vec.kdtr import open_bundle
from k2vec.kdtr.writer import write_bundle
from k2vec.model.architecture import hf_config
from k2vec.report import build_report
from k2vec.report.ddtree import compare_tree
from k2vec.report.arrays import stack_rows
from support.synthetic import perfect_result, write_result

MAX_REASON = 300
HUGE = int("9" * 4000)   # 4000 digits: under Python's 4300-digit limit, so the JSON reader takes it

# ---------------------------------------------------------------------------------- named unit cases

# One prompt of 5 tokens, 4 new tokens, a vocabulary of 512, 2 layers (1 MoE), 8 experts, hidden 4.
EXPECT = Expectations(n_prompts=1, max_new_tokens=4, vocab_size=512, accuracies=(0.9,), prompt_lengths=(5,),
                      layers=2, moe_layers=1, experts=8, experts_per_token=2, hidden=4)


def ddtree_result() -> dict:
    """A valid DDTree result of EXPECT: two rounds (root at 5, then at 7)."""
    rounds = [{"start": 5, "tokens": [7, 8, 3], "parents": [-1, 0, 0], "depths": [0, 1, 1], "accepted": [0, 1],
               "bonus": 9},
              {"start": 7, "tokens": [9, 10], "parents": [-1, 0], "depths": [0, 1], "accepted": [0, 1], "bonus": 11}]
    return {"format": "k2vec-engine-result", "version": 1,
            "runs": [{"drafter": {"accuracy": 0.9}, "prompts": [{"tokens": [7, 8, 9, 10], "rounds": rounds}]}]}


def greedy_result() -> dict:
    prompt = {"tokens": [7, 8, 9, 10], "topk_ids": [[7, 1], [8, 1], [9, 1], [10, 1]],
              "topk_logits": [[2.0, 1.0]] * 4, "router_experts": [[[0, 1]]] * 4,
              "fingerprints": [[[0.5] * 4] * 2] * 4}
    return {"format": "k2vec-engine-result", "version": 1, "runs": [{"drafter": None, "prompts": [prompt]}]}


def test_the_valid_results_pass():
    check_result(ddtree_result(), "ddtree-b4", EXPECT)
    check_result(greedy_result(), "greedy", EXPECT)
    r = ddtree_result()
    r["runs"][0]["prompts"][0]["rounds"][1]["start"] = 8          # the last generated position is a valid root
    r["runs"][0]["prompts"][0]["rounds"][1]["tokens"][1] = 511    # the vocabulary's last token
    r["runs"][0]["prompts"][0]["rounds"][1]["bonus"] = 511
    check_result(r, "ddtree-b4", EXPECT)


def _round(key, value, k=0):
    def edit(r):
        rnd = r["runs"][0]["prompts"][0]["rounds"][k]
        if isinstance(key, tuple):
            rnd[key[0]][key[1]] = value
        else:
            rnd[key] = value
    return edit


def _prompt(key, value):
    return lambda r: r["runs"][0]["prompts"][0].update({key: value})


# (name, mode, edit, what the reason must say)
CASES = [
    ("round token 10**9", "ddtree-b4", _round(("tokens", 1), 10**9),
     "run 0 prompt 0 round 0: tokens[1] = 1000000000 outside the vocabulary (size 512)"),
    ("round token = vocab_size", "ddtree-b4", _round(("tokens", 1), 512, 1), "prompt 0 round 1: tokens[1] = 512"),
    ("round root token = vocab_size", "ddtree-b4", _round(("tokens", 0), 512), "prompt 0 round 0: tokens[0] = 512"),
    ("round token 2**70", "ddtree-b4", _round(("tokens", 1), 2**70), "runs/0/prompts/0/rounds/0/tokens/1"),
    ("round token of 4000 digits", "ddtree-b4", _round(("tokens", 1), HUGE), "(4000 digits)"),
    ("bonus 2**64", "ddtree-b4", _round("bonus", 2**64), "runs/0/prompts/0/rounds/0/bonus: 18446744073709551616"),
    ("bonus = vocab_size", "ddtree-b4", _round("bonus", 512, 1), "prompt 0 round 1: bonus 512 outside the vocabulary"),
    ("bonus 10**9", "ddtree-b4", _round("bonus", 10**9), "round 0: bonus 1000000000"),
    ("start 2**70", "ddtree-b4", _round("start", 2**70), "runs/0/prompts/0/rounds/0/start"),
    ("start 10**9", "ddtree-b4", _round("start", 10**9),
     "prompt 0 round 0: start 1000000000 is outside the generated positions 5..8"),
    ("start before the prompt's end", "ddtree-b4", _round("start", 4), "round 0: start 4 is outside"),
    ("start past the sequence", "ddtree-b4", _round("start", 9, 1), "round 1: start 9 is outside"),
    ("parent 10**6", "ddtree-b4", _round(("parents", 1), 10**6),
     "prompt 0 round 0: parents[1] = 1000000 is not a node of the tree (0..2)"),
    ("parent = tree size", "ddtree-b4", _round(("parents", 2), 3), "round 0: parents[2] = 3 is not a node"),
    ("parent -1 below the root", "ddtree-b4", _round(("parents", 1), -1, 1), "round 1: parents[1] = -1"),
    ("parent 2**64", "ddtree-b4", _round(("parents", 1), 2**64), "runs/0/prompts/0/rounds/0/parents/1"),
    ("root with a parent", "ddtree-b4", _round(("parents", 0), 0), "round 0: parents[0] = 0, the root's parent"),
    ("accepted 10**6", "ddtree-b4", _round(("accepted", 1), 10**6),
     "prompt 0 round 0: accepted[1] = 1000000 is not a node of the tree (0..2)"),
    ("accepted = tree size", "ddtree-b4", _round(("accepted", 1), 2, 1), "round 1: accepted[1] = 2"),
    ("accepted without the root", "ddtree-b4", _round("accepted", [1]), "round 0: accepted must start with the root"),
    ("accepted empty", "ddtree-b4", _round("accepted", []), "round 0: accepted must start with the root"),
    ("depth 10**6", "ddtree-b4", _round(("depths", 2), 10**6), "round 0: depths[2] = 1000000 is deeper"),
    ("empty tree", "ddtree-b4", _round("tokens", []), "round 0: tokens is empty"),
    ("parents shorter than tokens", "ddtree-b4", _round("parents", [-1, 0]), "round 0: 2 parents for 3 tokens"),
    ("depths longer than tokens", "ddtree-b4", _round("depths", [0, 1, 1, 1]), "round 0: 4 depths for 3 tokens"),
    ("DDTree prompt: empty fingerprint vectors", "ddtree-b4", _prompt("fingerprints", [[[]] * 2] * 4),
     "prompt 0: fingerprints is [4, 2, 0], expected [max_new_tokens = 4][layers = 2][hidden_size = 4]"),
    ("DDTree prompt: topk id 10**9", "ddtree-b4",
     lambda r: r["runs"][0]["prompts"][0].update(topk_ids=[[7], [8], [9], [10**9]], topk_logits=[[1.0]] * 4),
     "prompt 0 step 3: topk id 1000000000 outside the vocabulary"),
    ("DDTree prompt: expert 8", "ddtree-b4", _prompt("router_experts", [[[0, 8]]] * 4), "is not an expert"),
    ("greedy: empty fingerprint vectors", "greedy", _prompt("fingerprints", [[[]] * 2] * 4),
     "prompt 0: fingerprints is [4, 2, 0]"),
    ("greedy: fingerprints narrower than hidden_size", "greedy", _prompt("fingerprints", [[[0.5] * 3] * 2] * 4),
     "prompt 0: fingerprints is [4, 2, 3], expected [max_new_tokens = 4][layers = 2][hidden_size = 4]"),
    ("greedy: token of 4000 digits", "greedy", _prompt("tokens", [7, 8, HUGE, 10]),
     "runs/0/prompts/0/tokens/2: 99999999999999999999... (4000 digits) is greater than the maximum"),
    ("greedy: token 10**9", "greedy", _prompt("tokens", [7, 8, 10**9, 10]), "prompt 0: token 1000000000 outside"),
    ("greedy: topk id 2**64", "greedy", _prompt("topk_ids", [[7, 1], [8, 1], [9, 2**64], [10, 1]]),
     "runs/0/prompts/0/topk_ids/2/1"),
    ("greedy: expert 2**70", "greedy", _prompt("router_experts", [[[0, 2**70]]] * 4),
     "runs/0/prompts/0/router_experts/0/0/1"),
    ("greedy: a token that is a long string", "greedy", _prompt("tokens", ["7" * 5000] * 4),
     "tokens/0: '777777777777777777777777777777777777777... is not a JSON integer"),
    ("greedy: a prompt that is a long list", "greedy", lambda r: r["runs"][0].update(prompts=[list(range(5000))]),
     "runs/0/prompts/0: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1... is not of type 'object'"),
]


@pytest.mark.parametrize("name, mode, edit, message", CASES, ids=[c[0] for c in CASES])
def test_each_bound_fails_the_run_with_a_short_reason(name, mode, edit, message):
    r = ddtree_result() if mode.startswith("ddtree") else greedy_result()
    edit(r)
    with pytest.raises(InvalidResult) as err:
        check_result(r, mode, EXPECT)
    reason = str(err.value)
    assert message in reason
    assert len(reason) < MAX_REASON, reason


def test_a_drafter_of_4000_digits_is_named_briefly():
    r = ddtree_result()
    r["runs"][0]["drafter"]["accuracy"] = HUGE
    with pytest.raises(InvalidResult, match="runs are for drafters") as err:
        check_result(r, "ddtree-b4", EXPECT)
    assert len(str(err.value)) < MAX_REASON


def test_the_runner_writes_a_failed_row_for_an_out_of_range_round(tmp_path):
    """Through the runner: a round whose start is 2**70 is a failed run with the field in its reason."""
    r = ddtree_result()
    r["runs"][0]["prompts"][0]["rounds"][1]["start"] = 2**70
    bundle = tmp_path / "b.kdtr"
    write_bundle(bundle, {"x": np.zeros(4, np.float32)}, {"kind": "test"})
    write_record(bundle)
    final = run_engine(engine="fake", command=fake_engine(tmp_path, f"json.dump({r!r}, open(out, 'w'))"),
                       bundle=str(bundle), mode="ddtree-b4", output=str(tmp_path / "run.json"), expect=EXPECT,
                       gpus=0, devices=[], lock_dir=str(tmp_path / "locks"), timeout_s=10.0,
                       stderr_path=str(tmp_path / "stderr.log"), max_result_mb=1.0, scratch_dir=str(tmp_path / "s"))
    assert final["status"] == "failed" and "rounds/1/start" in final["reason"] and len(final["reason"]) < MAX_REASON


def test_fingerprint_width_comes_from_the_bundle(tmp_path):
    meta = {"golden": {"prompts": 1, "ddtree": {"accuracies": [0.9]}}, "decoding": {"max_new_tokens": 4},
            "model": {"vocab_size": 512},
            "hf_config": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 8,
                          "num_experts_per_tok": 2, "hidden_size": 4}}
    write_bundle(tmp_path / "b.kdtr", {"prompt.p0.tokens": np.arange(5, dtype=np.int32)}, meta)
    assert expectations_from_bundle(tmp_path / "b.kdtr") == EXPECT


# ------------------------------------------------------------------- the report's second line of defence

def test_the_report_survives_rounds_it_would_never_be_given():
    """Values past int64 and ragged rounds (the runner refuses both) give a differing tree, not a crash."""
    g = {"node_offsets": np.array([0, 2]), "accepted_offsets": np.array([0, 1]), "node_tokens": np.array([1, 2]),
         "node_parents": np.array([-1, 0]), "node_depths": np.array([0, 1]), "accepted": np.array([0]),
         "round_start": np.array([5]), "round_bonus": np.array([3])}
    good = {"start": 5, "tokens": [1, 2], "parents": [-1, 0], "depths": [0, 1], "accepted": [0], "bonus": 3}
    assert compare_tree([good], g)[0] is True
    for key, value in [("start", 2**70), ("bonus", 2**64), ("tokens", [1, 2**70]), ("parents", [-1])]:
        same, rnd, node, what, lengths = compare_tree([{**good, key: value}], g)
        assert not same and rnd == 0 and "unreadable" in what and lengths.size == 0
    rows = stack_rows([[1, 2], [1, 2**70], [[1], 2]], (), 2, -1, np.int64)
    assert rows.tolist() == [[1, 2], [-1, -1], [-1, -1]]


# ------------------------------------------------------------------------------------------ the fuzz

HOSTILE = [("2**64", 2**64), ("2**70", 2**70), ("-1", -1), ("10**9", 10**9), ("vocab_size", "V"),
           ("vocab_size-1", "V-1"), ("0", 0), ("2**31", 2**31), ("2**63", 2**63), ("4000 digits", HUGE)]
SAMPLES_PER_FIELD = 3   # locations drawn per integer field, each with every hostile value


@dataclass
class Fuzz:
    name: str
    mode: str
    path: tuple
    value: Any
    result: dict
    reason: str | None = None   # None: accepted


def _leaves(node, path=()):
    """Every (path, value) of an integer in `node`."""
    if type(node) is int:
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, path + (i,))


def _field(path: tuple) -> str:
    """The field an integer belongs to, without its indices: runs.prompts.rounds.parents."""
    return ".".join(str(p) for p in path if not isinstance(p, int))


def _set(doc: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def fuzz_setup(tmp_path_factory):
    """The tiny goldens, and the expectations of a bundle of the fp32 golden (its metadata and prompts, and
    the model's hf_config) read as the runner reads them."""
    root = tmp_path_factory.mktemp("bounds")
    goldens = make_goldens(root / "goldens")
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    model = expand_config({**cfg, "models": {"tiny": {"preset": "tiny"}}})["tiny"]["model"]
    golden = goldens[("tiny", "fp32")]
    with open_bundle(golden) as b:
        md = b.metadata
        prompts = {f"prompt.p{i}.tokens": np.asarray(b[f"prompt.p{i}.tokens"]) for i in range(md["prompts"])}
    meta = {"golden": md, "decoding": {"max_new_tokens": md["max_new_tokens"]}, "model": model,
            "hf_config": hf_config(model)}
    write_bundle(root / "b.kdtr", prompts, meta)
    expect = expectations_from_bundle(root / "b.kdtr")
    assert expect.hidden == model["hidden_size"] and expect.vocab_size == model["vocab_size"]
    return root, goldens, expect


def _cases(goldens, expect: Expectations) -> list[Fuzz]:
    rng = random.Random(28)
    golden = goldens[("tiny", "fp32")]
    cases = []
    for mode in ("greedy", "score", "ddtree-b4"):
        full = perfect_result(golden, mode)
        result = {k: v for k, v in full.items() if k not in ("engine", "mode", "budget", "status", "reason", "wall_s")}
        check_result(result, mode, expect)            # the untouched result passes
        with_fingerprints = result
        # the integer fields are fuzzed without the fingerprints (floats, 9 in 10 of the values): each case
        # is copied, and jsonschema walks every value of a refused one
        result = copy.deepcopy(result)
        for run in result["runs"]:
            for p in run["prompts"]:
                del p["fingerprints"]
        by_field: dict[str, list[tuple]] = {}
        for path, _ in _leaves(result["runs"]):
            if path[-1] != "version":
                by_field.setdefault(_field(path), []).append(("runs",) + path)
        for field, paths in sorted(by_field.items()):
            for path in rng.sample(paths, min(SAMPLES_PER_FIELD, len(paths))):
                for label, value in HOSTILE:
                    v = {"V": expect.vocab_size, "V-1": expect.vocab_size - 1}.get(value, value)
                    where = "/".join(map(str, path[1:]))
                    cases.append(Fuzz(f"{mode} {where} = {label}", mode, path, v, _set(result, path, v)))
        # the fingerprints: empty vectors, and one value short
        for label, fp in [("empty vectors", lambda f: [[[] for _ in s] for s in f]),
                          ("one value short", lambda f: [[v[:-1] for v in s] for s in f])]:
            r = copy.deepcopy(with_fingerprints)
            p = rng.randrange(len(r["runs"][0]["prompts"]))
            r["runs"][0]["prompts"][p]["fingerprints"] = fp(r["runs"][0]["prompts"][p]["fingerprints"])
            cases.append(Fuzz(f"{mode} prompt {p} fingerprints: {label}", mode, ("fingerprints",), label, r))
    return cases


def test_hostile_integers_fail_the_check_briefly_or_the_report_builds(fuzz_setup):
    root, goldens, expect = fuzz_setup
    cases = _cases(goldens, expect)
    assert len(cases) > 300
    problems = []   # (case, what is wrong): all of them are listed at the end
    for c in cases:
        try:
            check_result(c.result, c.mode, expect)
        except InvalidResult as err:
            c.reason = str(err)
            if len(c.reason) >= MAX_REASON:
                problems.append((c.name, f"a reason of {len(c.reason)} characters: {c.reason[:120]}..."))
            # the reason points at the integer: its prompt (and round or step) by index or by path
            elif not re.search(r"prompt[ s/]", c.reason):
                problems.append((c.name, f"the reason names no prompt: {c.reason}"))
    accepted = [c for c in cases if c.reason is None]
    # every value the contract forbids is refused wherever it is put (-1 is the root's parent)
    forbidden = (2**64, 2**70, 2**63, 2**31, HUGE, 10**9, -1, expect.vocab_size)
    problems += [(c.name, "accepted") for c in accepted if c.value in forbidden
                 and not (c.value == -1 and c.path[-2:] == ("parents", 0))]
    problems += [(c.name, "accepted") for c in accepted if c.path == ("fingerprints",)]
    # every accepted result builds the report (one report for all of them, each a run of its own engine)
    runs = []
    for i, c in enumerate(accepted):
        path = write_result(root / f"accepted{i}.json", {**c.result, "engine": f"e{i}", "mode": c.mode,
                                                         "status": "ok", "reason": None, "wall_s": 1.0})
        runs.append({"engine": f"e{i}", "model": "tiny", "precision": "fp32", "mode": c.mode, "result": path})
    gold = {k: v for k, v in goldens.items() if k[1] == "fp32"}
    try:
        res = build_report(runs, gold, root / "report")
    except Exception as err:   # name the cases that break it
        for run, c in zip(runs, accepted):
            try:
                build_report([run], gold, root / "one")
            except Exception as one:
                problems.append((c.name, f"accepted, yet the report raised {one!r}"))
        problems.append(("all accepted cases", f"the report raised {err!r}"))
    else:
        assert (root / "report" / "divergence.csv").exists()
        assert set(res.rows["engine"]) == {f"e{i}" for i in range(len(accepted))}
        assert (res.rows["status"] == "ok").all()
    assert problems == []
    assert 0 < len(accepted) < len(cases) // 2   # the cases reach both the refusals and the report
