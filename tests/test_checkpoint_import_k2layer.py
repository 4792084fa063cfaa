"""Must show 3 of issue 16: a compressed-tensors checkpoint slice at Kimi K2 width (hidden 7168,
moe_intermediate 2048, 64 MLA heads, q_lora 1536, kv_lora 512) goes through import, golden, bundle and
the numpy engine exact. The run and its checks are bench/import_k2layer.py's (which also times it)."""
import sys

import pytest

from conftest import REPO

pytest.importorskip("compressed_tensors")
sys.path.insert(0, str(REPO / "bench"))
import import_k2layer  # noqa: E402


@pytest.mark.slow
def test_k2_width_slice_through_golden_bundle_and_numpy_engine(tmp_path):
    out = import_k2layer.run(tmp_path)  # asserts: .qw/.sc are the checkpoint's bytes, goldens equal, engine exact
    assert [stage for stage, _, _ in out["rows"]] == [stage for stage, _ in import_k2layer.STAGES]
    assert out["routed"] == [0, 1, 2, 3]  # every kept expert was chosen by the restricted router
