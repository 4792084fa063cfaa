"""report.strict: which rows fail the gate, and one verdict for the gate, the CLI and the banner."""
from dataclasses import dataclass
from typing import Callable

import pandas as pd
import pytest

from k2vec.report.gate import StrictFailure, check_strict
from test_report_metrics import make_goldens


def rows(*specs):
    return pd.DataFrame([{"engine": "e", "model": "m", "precision": "int4", "mode": mode, "class": cls,
                          "tree_match": tree} for mode, cls, tree in specs])


@pytest.mark.parametrize("specs, fails", [
    ([("greedy", "exact", None), ("ddtree-b4", "exact", True)], None),
    ([("greedy", "near-tie", None), ("greedy", "router-near-tie", None)], None),
    ([("greedy", "precision-tie", None), ("score", "within-budget", None), ("score", "exact", None)], None),
    ([("score", "over-budget", None)], "e/m-int4-score: over-budget"),
    ([("greedy", "over-budget", None)], "e/m-int4-greedy: over-budget"),
    ([("greedy", "real", None)], "e/m-int4-greedy: real"),
    ([("greedy", "failed", None)], "e/m-int4-greedy: failed"),
    ([("ddtree-b4", "exact", False)], "e/m-int4-ddtree-b4: tree differs"),
])
def test_gate(tmp_path, specs, fails):
    csv, ok = tmp_path / "d.csv", tmp_path / "strict.ok"
    rows(*specs).to_csv(csv, index=False)
    if fails is None:
        check_strict(str(csv), str(ok))
        assert ok.read_text().startswith("strict: ok")
    else:
        with pytest.raises(StrictFailure, match=fails):
            check_strict(str(csv), str(ok))
        assert not ok.exists()


# ------------------------------------------------- one verdict: CLI, banner and gate on the same results

@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("gate-goldens"))


@dataclass(frozen=True)
class VerdictCase:
    name: str
    edit: Callable[[dict], None]   # applied to a perfect ddtree-b4 result
    fails: str | None              # the run's strict verdict, None: passes


def _swap_two_nodes(res: dict) -> None:
    """Two sibling tokens of one round swapped: the tree differs, the emitted tokens do not."""
    for run in res["runs"]:
        for prompt in run["prompts"]:
            for rnd in prompt["rounds"]:
                t = rnd["tokens"]
                if len(t) >= 3 and t[1] != t[2] and rnd["parents"][1] == rnd["parents"][2]:
                    t[1], t[2] = t[2], t[1]
                    return
    pytest.fail("no round with two sibling nodes")


VERDICT_CASES = [
    VerdictCase("perfect", lambda res: None, None),
    VerdictCase("tree-differs-tokens-match", _swap_two_nodes, "tree differs"),
]


@pytest.mark.parametrize("case", VERDICT_CASES, ids=lambda c: c.name)
def test_cli_banner_and_gate_give_one_verdict(tmp_path, goldens, case, capsys):
    from k2vec.report import main
    from support.synthetic import perfect_result, write_result

    golden = goldens[("tiny", "fp32")]
    res = perfect_result(golden, "ddtree-b4")
    case.edit(res)
    result = tmp_path / "e.json"
    write_result(result, res)
    out = tmp_path / "report"
    rc = main(["--out", str(out), "--golden", "tiny", "fp32", str(golden),
               "--run", "e", "tiny", "fp32", "ddtree-b4", str(result), "--strict"])
    rows = pd.read_csv(out / "divergence.csv")
    assert (rows["class"] == "exact").all()   # every token matches in both cases
    html = (out / "divergence.html").read_text()
    ok = tmp_path / "strict.ok"
    if case.fails is None:
        assert rc == 0
        assert "OK for the 1 engine that ran" in html
        check_strict(str(out / "divergence.csv"), str(ok))
        assert ok.exists()
    else:
        assert rc == 1 and f"e/tiny-fp32-ddtree-b4: {case.fails}" in capsys.readouterr().err
        assert f"<h2>FAIL: {case.fails} 1</h2>" in html
        assert f"FAIL: {case.fails} 1" in (out / "summary.txt").read_text()
        with pytest.raises(StrictFailure, match=f"e/tiny-fp32-ddtree-b4: {case.fails}"):
            check_strict(str(out / "divergence.csv"), str(ok))
        assert not ok.exists()


@pytest.mark.parametrize("fail_on_left_out", [False, True], ids=["listed", "fails-the-gate"])
def test_left_out_engines_are_named_everywhere(tmp_path, goldens, fail_on_left_out, capsys):
    """A configured engine that got no run is named with its reason in the summary, the HTML banner and
    engines.csv; the verdict says it covers the engines that ran, and fails only when asked to."""
    from k2vec.report import main
    from support.synthetic import perfect_result, write_result

    golden = goldens[("tiny", "fp32")]
    result = tmp_path / "e.json"
    write_result(result, perfect_result(golden, "greedy"))
    out = tmp_path / "report"
    why = "no GPU: needs 1 per run, the pool has 0 (gpus.devices)"
    rc = main(["--out", str(out), "--golden", "tiny", "fp32", str(golden), "--run", "e", "tiny", "fp32", "greedy",
               str(result), "--left-out", "gpu_e", why, "--strict"]
              + (["--fail-on-left-out"] if fail_on_left_out else []))
    summary = (out / "summary.txt").read_text()
    html = (out / "divergence.html").read_text()
    engines = pd.read_csv(out / "engines.csv", keep_default_na=False)
    assert engines.to_dict("records") == [{"engine": "e", "status": "ran", "runs": 1, "reason": ""},
                                          {"engine": "gpu_e", "status": "left out", "runs": 0, "reason": why}]
    assert f"LEFT OUT: gpu_e: {why}" in summary
    assert f"<li><b>gpu_e</b>: {why}</li>" in html
    ok = tmp_path / "strict.ok"
    if fail_on_left_out:
        assert rc == 1 and "gpu_e (no GPU" in capsys.readouterr().err
        assert "FAIL: 1 configured engine left out: gpu_e (report.fail_on_left_out)" in summary
        with pytest.raises(StrictFailure, match="1 configured engine.s. left out.*gpu_e"):
            check_strict(str(out / "divergence.csv"), str(ok), str(out / "engines.csv"))
    else:
        assert rc == 0
        assert "OK for the 1 engine that ran: no real divergence, no over-budget row, no failed run; " \
               "1 configured engine left out: gpu_e" in summary
        check_strict(str(out / "divergence.csv"), str(ok))   # the gate without fail_on_left_out
        assert ok.exists()
