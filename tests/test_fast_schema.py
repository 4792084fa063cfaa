"""The quick schema check agrees with jsonschema on every result it is shown, so the runner may skip
jsonschema for the results it passes: every single-value change of a full result is tried."""
import copy
import json

import pytest

from k2vec.engines.contract import errors as contract_errors
from k2vec.engines.contract import checks
from k2vec.engines.contract.schema import conforms
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.expectations import Expectations

SCHEMA = json.loads(checks.SCHEMA_PATH.read_text())


def full_result() -> dict:
    """A small result that uses every part of the schema: timing, greedy per-step arrays, DDTree rounds."""
    step = {"tokens": [3, 1], "topk_ids": [[3, 0], [1, 2]], "topk_logits": [[2.5, -1], [0.5, 0.25]],
            "fingerprints": [[[0.5, -2.0]], [[1, 3.25]]], "router_experts": [[[0, 1]], [[1, 0]]]}
    rounds = {"tokens": [3, 1], "rounds": [{"start": 0, "tokens": [3, 1, 4], "parents": [-1, 0, 0],
                                            "depths": [0, 1, 1], "accepted": [0, 1], "bonus": 1}]}
    return {"format": "k2vec-engine-result", "version": 1, "device": "cpu",
            "timing": {"load_s": 0.5, "decode_s": 1, "note": "free-form"},
            "runs": [{"drafter": None, "prompts": [step]}, {"drafter": {"accuracy": 0.9}, "prompts": [rounds]}]}


def paths(doc, prefix=()):
    """Every key or index path in `doc`, containers and leaves."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from paths(value, prefix + (key,))


def changed(doc, path, value):
    out = copy.deepcopy(doc)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


DELETE = object()
REPLACEMENTS = [DELETE, True, False, 0, -1, 5.0, 1.5, -0.5, float("inf"), float("nan"), 10**30, "7", None, [], {},
                [1], [[1]], {"accuracy": 0.5}, "k2vec-engine-result", 1.0]


def schema_valid(doc) -> bool:
    return next(iter(checks._validator().iter_errors(doc)), None) is None


def test_the_full_result_passes_both():
    assert schema_valid(full_result()) and conforms(full_result(), SCHEMA)


def test_every_single_change_gets_the_answer_jsonschema_gives():
    base = full_result()
    cases = [(path, value) for path in paths(base) for value in REPLACEMENTS
             if not (value is DELETE and isinstance(path[-1], int))]
    assert len(cases) > 1400
    disagree = []
    for path, value in cases:
        doc = changed(base, path, value)
        if conforms(doc, SCHEMA) != schema_valid(doc):
            disagree.append((path, value))
    assert disagree == []
    # and the changes were not all harmless: most of them break the contract
    assert sum(not schema_valid(changed(base, p, v)) for p, v in cases) > len(cases) // 2


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},   # a keyword it does not know
    {"type": ["integer", "null"]},                                           # a list of types
    {"const": [1, 2]},                                                       # a structured constant
])
def test_a_schema_it_does_not_read_is_never_a_pass(schema):
    assert conforms({"x": 1}, schema) is False and conforms([1], schema) is False


def test_an_item_type_it_does_not_read_is_never_a_pass():
    assert conforms([1, None], {"items": {"type": ["integer", "null"]}}) is False


def test_valid_results_are_not_sent_to_jsonschema(monkeypatch):
    """The point of the quick check: a long valid result costs milliseconds (jsonschema took 0.8 s for a
    small model's score run), and an invalid one still gets jsonschema's message."""
    def no_jsonschema():
        raise AssertionError("jsonschema was asked about a valid result")
    monkeypatch.setattr(checks, "_validator", no_jsonschema)
    n = 500
    result = {"format": "k2vec-engine-result", "version": 1,
              "runs": [{"drafter": None, "prompts": [{"tokens": [1] * n, "topk_ids": [[1, 0] for _ in range(n)],
                                                      "topk_logits": [[1.0, 0.5] for _ in range(n)]}]}]}
    check_result(result, "greedy", Expectations(n_prompts=1, max_new_tokens=n, vocab_size=4))
    monkeypatch.undo()
    result["runs"][0]["prompts"][0]["topk_logits"][7][1] = float("nan")
    with pytest.raises(contract_errors.InvalidResult,
                       match="schema at runs/0/prompts/0/topk_logits/7/1: nan is not a finite"):
        check_result(result, "greedy", Expectations(n_prompts=1, max_new_tokens=n, vocab_size=4))


@pytest.mark.parametrize("schema, instances", [
    ({"const": True}, [True, 1, 1.0, False]),            # JSON's true is not 1
    ({"const": 1}, [1, 1.0, True, "1"]),                   # but 1 is 1.0
    ({"items": {"type": "integer"}}, ["abc", {"x": 1}, 5, [1, 2], [1, True]]),   # items: arrays only
    ({"items": {"type": "string"}}, [["a", "b"], ["a", 1], []]),   # items of a type without a quick path
    ({"items": {"type": "number", "minimum": 0}}, [[0, 0.5], [-1e-9], [float("inf")], []]),
    ({"items": {"type": "integer", "minimum": -1, "maximum": 7}}, [[-1, 7], [8], [-2], [2**70], [], [0, 2**64]]),
    ({"type": "integer", "maximum": 7}, [7, 8, 2**70, -(2**70), 7.0, "9"]),
])
def test_small_schemas_get_the_answer_jsonschema_gives(schema, instances):
    import jsonschema
    validator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                             type_checker=checks._validator().TYPE_CHECKER)(schema)
    for instance in instances:
        assert conforms(instance, schema) == validator.is_valid(instance), instance
