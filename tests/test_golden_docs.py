"""docs/golden-format.md says what the golden stage does: Kd, the last DDTree round, the tie tolerance."""
import re

import numpy as np
import pytest

from conftest import REPO
from test_report_metrics import make_goldens

from k2vec.stages import golden
from k2vec.kdtr import open_bundle

DOC = " ".join((REPO / "docs/golden-format.md").read_text().split())


def test_documented_tolerances_are_the_codes():
    assert float(re.search(r"margin is below `([0-9e.-]+)` \(`k2vec\.stages\.golden\.DDTREE_TIE`\)", DOC).group(1)) \
        == golden.DDTREE_TIE
    # the near-tie thresholds are the config's (report.near_tie), recorded in the summary, not constants
    assert "near-tie steps and fraction (margin < `near_tie_threshold` = `report.near_tie`)" in DOC
    assert not hasattr(golden, "NEAR_TIE")
    assert "`Kd = min(max(decoding.ddtree.budgets), vocab_size)`" in DOC


@pytest.fixture(scope="module")
def gold(tmp_path_factory):
    """The shrunk tiny fp32 golden of the report tests (budgets 1 and 4, N = 10), its arrays."""
    with open_bundle(make_goldens(tmp_path_factory.mktemp("goldens"))[("tiny", "fp32")]) as b:
        return {"md": b.metadata, **{k: np.array(b[k]) for k in b.keys()}}


def test_kd_follows_the_largest_budget(gold):
    budgets = gold["md"]["ddtree"]["budgets"]
    assert max(budgets) < 64          # so a fixed 64 would show
    kd = gold["drafts.a0.p0.ids"].shape[-1]
    assert kd == min(max(budgets), 163840) == 4
    assert gold["drafts.a0.p0.ids"].shape[0] == gold["md"]["max_new_tokens"]   # N rows


def test_tokens_are_cut_to_n_and_the_last_round_may_run_past(gold):
    n = gold["md"]["max_new_tokens"]
    past = 0
    for key in [k for k in gold if re.fullmatch(r"ddtree\.b\d+\.a\d+\.p\d+\.tokens", k)]:
        pre = key[: -len("tokens")]
        nodes, acc = gold[pre + "node_tokens"], gold[pre + "accepted"]
        no, ao = gold[pre + "node_offsets"], gold[pre + "accepted_offsets"]
        emitted = [int(nodes[0])]     # the first round's root: the prefill's argmax
        for r in range(len(no) - 1):
            emitted += [int(t) for t in nodes[no[r]:no[r + 1]][acc[ao[r] + 1:ao[r + 1]]]]
            emitted.append(int(gold[pre + "round_bonus"][r]))
        assert len(emitted) >= n and len(emitted) - n < len(acc[ao[-2]:ao[-1]]) + 1   # only the last round runs past
        assert gold[key].tolist() == emitted[:n]
        past += len(emitted) > n
    assert past > 0                   # the case the doc describes occurs in this golden

