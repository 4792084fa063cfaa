"""Real K2 widths under bounded memory (README "Scale"): the k2slice / k2layer presets, the budget's
verdict on them, and the streaming pieces each stage relies on, checked on small tensors."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from k2vec import atomic
from k2vec.config import resources
from k2vec.model.checkpoint import Checkpoint, CheckpointError, StreamedTensor, write_shards
from k2vec.errors import ConfigError
from k2vec.stages.golden import DequantizedWeights
from k2vec.stages.quantize import quantize_checkpoint
from k2vec.kdtr import open_bundle, write_bundle
from k2vec.reference.model import WeightStore
from k2vec.config.expand import expand_config, resolve_model
from k2vec.stages.weights import uniform, uniform_chunks, write_checkpoint

GiB = 1 << 30


def test_k2slice_has_the_k2_widths_and_k2layer_all_384_experts():
    s = resolve_model("s", {"preset": "k2slice"})
    k2 = dict(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
              qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=2048, intermediate_size=18432,
              n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, rms_norm_eps=1e-5,
              routed_scaling_factor=2.827, rope_theta=50000.0)
    assert {k: s[k] for k in k2} == k2
    assert s["rope_scaling"]["factor"] == 64.0 and s["rope_scaling"]["beta_fast"] == 1.0
    assert (s["num_hidden_layers"], s["first_k_dense_replace"], s["n_routed_experts"]) == (3, 1, 16)
    # the reduced vocabulary keeps the dense MLP the largest tensor (the RSS bound's reference)
    c = resources.counts(s)
    assert c.largest_name == "mlp.gate_proj.weight [18432, 7168]" and s["vocab_size"] * 7168 < c.largest_tensor
    layer = resolve_model("l", {"preset": "k2layer"})
    assert {k: layer[k] for k in k2} == k2
    assert (layer["num_hidden_layers"], layer["first_k_dense_replace"], layer["n_routed_experts"]) == (1, 0, 384)


def _this_machine(monkeypatch, memory=24 * GiB, disk=65 * 10**9):
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    monkeypatch.setattr(resources, "available_memory", lambda: (memory, "test"))
    monkeypatch.setattr(resources, "free_disk", lambda path: disk)


def test_budget_admits_the_k2_presets_on_a_24_gib_machine_and_refuses_the_full_model(config, monkeypatch, tmp_path):
    _this_machine(monkeypatch)
    config["models"] = {"k2slice": {"preset": "k2slice"}}
    runs = [("numpy", "k2slice", p, "greedy") for p in ("fp32", "int4")]
    resources.check_config(config, runs, tmp_path / "results")
    m = resolve_model("k2slice", {"preset": "k2slice"})
    for need in resources.stage_memory(m, config):
        assert need.amount < 4 * GiB, need  # every stage streams: none holds a layer (3.4 GB) or the model
    # k2layer's fp32 outputs are ~160 GB of disk: refused on this disk, admitted on memory
    config["models"] = {"k2layer": {"preset": "k2layer"}}
    with pytest.raises(ConfigError, match="of disk"):
        resources.check_config(config, [], tmp_path / "results")
    assert all(n.amount < 4 * GiB for n in resources.stage_memory(resolve_model("k2layer", {"preset": "k2layer"}),
                                                               config))
    # the real Kimi K2 (61 layers, 384 experts, full vocabulary): refused, naming what drives it
    config["models"] = {"k2": {"preset": "k2layer", "num_hidden_layers": 61, "first_k_dense_replace": 1,
                               "vocab_size": 163840}}
    with pytest.raises(ConfigError) as err:
        resources.check_config(config, [], tmp_path / "results")
    assert err.value.key == "models.k2.num_hidden_layers", err.value


def test_uniform_chunks_do_not_change_the_values():
    whole = uniform(1234, [7, 300], -0.5, 0.5)
    for chunk in (1, 97, 2100, 1 << 22):
        np.testing.assert_array_equal(np.concatenate(list(uniform_chunks(1234, 2100, -0.5, 0.5, chunk))),
                                      whole.reshape(-1))


def test_streamed_checkpoint_equals_an_in_memory_one_and_maps_each_tensor_alone(config, tmp_path, monkeypatch):
    import k2vec.stages.weights as weights

    model = expand_config(config)["tiny"]["model"]
    write_checkpoint(model, tmp_path / "a")
    monkeypatch.setattr(weights, "CHUNK_VALUES", 1000)  # many chunks per tensor, same bytes
    monkeypatch.setattr(weights, "uniform_chunks",
                        lambda s, n, lo, hi, chunk=1000, f=weights.uniform_chunks: f(s, n, lo, hi, chunk))
    write_checkpoint(model, tmp_path / "b")
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert np.array_equal(a[name], weights.make_tensor(model, name, list(a[name].shape)))
    big = a["model.embed_tokens.weight"]
    mapping = big.base.base.obj  # reshape of the flat frombuffer view (a memoryview) of the tensor's own mmap
    assert isinstance(mapping, mmap.mmap) and len(mapping) < big.nbytes + mmap.ALLOCATIONGRANULARITY
    assert a.shape_of("model.embed_tokens.weight") == list(big.shape)


def test_streamed_tensor_with_the_wrong_byte_count_is_named(tmp_path):
    bad = StreamedTensor("F32", (4, 4), lambda: (np.zeros(15, np.float32),))
    with pytest.raises(CheckpointError, match=r"tensor w produced 60 bytes, its dtype F32 and shape \[4, 4\] need 64"):
        write_shards(tmp_path, [[("w", bad)]], 1)


@pytest.fixture
def tiny_int4(config, tmp_path):
    case = expand_config(config)["tiny"]
    write_checkpoint(case["model"], tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "int4", case["quantization"])
    return DequantizedWeights(Checkpoint(tmp_path / "fp32"), tmp_path / "int4")


def test_streamed_matmul_reads_blocks_only_and_equals_the_whole_weight(tiny_int4):
    name = "model.layers.0.mlp.gate_proj.weight"  # quantized: blocks are dequantized rows
    blocks = []

    class Spy:
        def __init__(self, src):
            self.src = src

        def __getitem__(self, n):
            raise AssertionError(f"{n} read whole")

        def shape_of(self, n):
            return self.src.shape_of(n)

        def block(self, n, r0, r1):
            blocks.append((r0, r1))
            return self.src.block(n, r0, r1)

    x = np.random.default_rng(0).standard_normal((3, 128))
    w = tiny_int4[name]
    np.testing.assert_array_equal(tiny_int4.block(name, 5, 9), w[5:9])
    store = WeightStore(Spy(tiny_int4), np.float64, stream_bytes=0)
    out = store.mm(x, name)
    np.testing.assert_allclose(out, x @ w.astype(np.float64).T, rtol=1e-13, atol=1e-13)
    assert blocks[0][0] == 0 and blocks[-1][1] == w.shape[0] and len(blocks) >= 1


def test_bundle_pages_released_stay_readable(tmp_path):
    a = np.arange(1 << 16, dtype=np.float32)
    write_bundle(tmp_path / "b.kdtr", {"a": a, "b": a[::-1].copy()}, {"kind": "test"})
    with open_bundle(tmp_path / "b.kdtr", verify=True) as b:
        view = b["a"]
        b.release("a")
        np.testing.assert_array_equal(view, a)


def test_atomic_directory_syncs_the_filesystem_once_not_each_file(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(atomic, "_syncfs", lambda path: calls.append(path) or True)
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: pytest.fail("fsync per file"), raising=True)
    monkeypatch.setattr(atomic, "_fsync_dir", lambda path: None)
    with atomic.atomic_directory(tmp_path / "d") as tmp:
        for i in range(100):
            (tmp / f"{i}.qw").write_bytes(b"x")
    assert len(calls) == 1 and len(list((tmp_path / "d").iterdir())) == 100


# ------------------------------------------------------------------------ k2slice end to end (slow)

K2SLICE_LARGEST = 18432 * 7168 * 4  # the dense MLP's gate/up/down in fp32: 504 MiB, more than the embedding
RSS_BOUND_MIB = (2 * K2SLICE_LARGEST + GiB) / 2**20  # 2x the largest tensor + 1 GiB = 2032 MiB


def k2slice_benchmarks(results) -> dict[str, float]:
    """max_rss (MiB, Snakemake's benchmark files) of every k2slice stage under `results`."""
    import pandas as pd

    rss = {}
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        rel = tsv.relative_to(results / "benchmarks").as_posix()
        if "k2slice" in rel:
            rss[rel] = float(pd.read_csv(tsv, sep="\t")["max_rss"].max())
    return rss


@pytest.mark.slow
def test_k2slice_end_to_end_every_stage_within_twice_the_largest_tensor_plus_1_gib(tmp_path):
    """tools/k2slice.yaml through weights, quantize, both goldens, both bundles and the numpy engine's greedy
    runs (~25 GB of disk at peak, the fp32 bundle deleted once its run is done; about an hour on 2 cores)."""
    import json
    import shutil

    from conftest import REPO, copy_workflow, snakemake

    if shutil.disk_usage(tmp_path).free < 30 * 10**9:
        pytest.skip("k2slice needs ~25 GB of free disk under the test's tmp_path (set --basetemp elsewhere)")
    root = copy_workflow(tmp_path)
    overlay = ["--configfile", str(REPO / "tools" / "k2slice.yaml"), "--cores", "1"]
    for precision in ("fp32", "int4"):
        run = f"results/runs/numpy/k2slice-{precision}-greedy.json"
        res = snakemake(*overlay, run, cwd=root, snakefile=root / "Snakefile", timeout=3 * 3600)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        assert json.loads((root / run).read_text())["status"] == "ok"
        (root / "results" / "bundles" / f"k2slice-{precision}.kdtr").unlink()  # disk: one bundle at a time
    rss = k2slice_benchmarks(root / "results")
    stages = {"weights/k2slice.tsv", "quantize/k2slice.tsv", "golden/k2slice/fp32.tsv", "golden/k2slice/int4.tsv",
              "bundle/k2slice-fp32.tsv", "bundle/k2slice-int4.tsv", "runs/numpy/k2slice-fp32-greedy.tsv",
              "runs/numpy/k2slice-int4-greedy.tsv"}
    assert stages <= set(rss), sorted(rss)
    over = {k: v for k, v in rss.items() if v > RSS_BOUND_MIB}
    assert not over, f"stages over {RSS_BOUND_MIB:.0f} MiB of peak RSS: {over}"
