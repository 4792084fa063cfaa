"""report.strict: which rows fail the gate."""
import pandas as pd
import pytest

from k2vec.report.gate import StrictFailure, check_strict


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
