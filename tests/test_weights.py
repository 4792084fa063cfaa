"""Synthetic fp32 checkpoints: bit-exact determinism, per-tensor independence, sane initialisation."""
import hashlib
import json

import numpy as np
import pytest

from k2vec.model.architecture import tensor_shapes
from k2vec.model.checkpoint import Checkpoint
from k2vec.config.expand import expand_config
from k2vec.stages.weights import LOGIT_STD, init_range, uniform, write_checkpoint


def sha256_files(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def tensor_digests(d):
    ck = Checkpoint(d)
    return {n: hashlib.sha256(ck[n].tobytes()).hexdigest() for n in ck}


@pytest.fixture
def cases(config):
    return expand_config(config)


def test_two_runs_two_directories_byte_identical(cases, tmp_path):
    a, b = tmp_path / "a" / "fp32", tmp_path / "b" / "fp32"
    write_checkpoint(cases["small"]["model"], a)
    write_checkpoint(cases["small"]["model"], b)
    da, db = sha256_files(a), sha256_files(b)
    assert da == db
    assert sum(n.endswith(".safetensors") for n in da) == cases["small"]["model"]["num_hidden_layers"] + 1


def test_changing_one_dimension_changes_only_dependent_tensors(config, tmp_path):
    base = expand_config(config)["tiny"]["model"]
    config["models"]["tiny"]["moe_intermediate_size"] = 128
    wider = expand_config(config)["tiny"]["model"]
    write_checkpoint(base, tmp_path / "base")
    write_checkpoint(wider, tmp_path / "wider")
    a, b = tensor_digests(tmp_path / "base"), tensor_digests(tmp_path / "wider")
    assert a.keys() == b.keys()
    changed = {n for n in a if a[n] != b[n]}
    expected = {n for n in a if ".mlp.experts." in n or ".mlp.shared_experts." in n}
    assert changed == expected and expected


def test_adding_a_layer_changes_no_existing_tensor(config, tmp_path):
    base = expand_config(config)["tiny"]["model"]
    config["models"]["tiny"]["num_hidden_layers"] = 4  # preset: 3
    deeper = expand_config(config)["tiny"]["model"]
    write_checkpoint(base, tmp_path / "base")
    write_checkpoint(deeper, tmp_path / "deeper")
    a, b = tensor_digests(tmp_path / "base"), tensor_digests(tmp_path / "deeper")
    assert set(b) - set(a) and all(b[n] == a[n] for n in a)


def test_seed_changes_every_tensor(config, tmp_path):
    base = expand_config(config)["tiny"]["model"]
    config["models"]["tiny"]["seed"] = 99
    other = expand_config(config)["tiny"]["model"]
    write_checkpoint(base, tmp_path / "a")
    write_checkpoint(other, tmp_path / "b")
    a, b = tensor_digests(tmp_path / "a"), tensor_digests(tmp_path / "b")
    assert all(a[n] != b[n] for n in a)


def test_uniform_is_exact_and_in_range():
    x = uniform(12345, [1000, 37], -0.5, 0.25)
    assert x.dtype == np.float32 and x.shape == (1000, 37)
    assert x.min() >= -0.5 and x.max() < 0.25
    # The raw stream's top 24 bits, scaled: a fixed first value pins the construction across machines.
    raw0 = int(np.random.PCG64(12345).random_raw(1)[0]) >> 40
    assert x[0, 0] == np.float32(raw0 * 2.0**-24) * np.float32(0.75) + np.float32(-0.5)
    assert abs(x.mean() - (-0.125)) < 0.01


def test_init_scales(cases, tmp_path):
    model = cases["small"]["model"]
    write_checkpoint(model, tmp_path / "ck")
    ck = Checkpoint(tmp_path / "ck")
    shapes = tensor_shapes(model)
    assert set(ck) == set(shapes)
    for name, shape in shapes.items():
        w = ck[name]
        assert list(w.shape) == shape and w.dtype == np.float32
        low, high = init_range(name, shape)
        assert w.min() >= low and w.max() < high, name
    up = ck["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert up.std() == pytest.approx(1 / np.sqrt(model["hidden_size"]), rel=0.05)
    assert ck["lm_head.weight"].std() * np.sqrt(model["hidden_size"]) == pytest.approx(LOGIT_STD, rel=0.05)
    norm = ck["model.layers.0.input_layernorm.weight"]
    assert 0.75 <= norm.min() and norm.max() < 1.25 and norm.std() > 0.1
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["rope_scaling"]["factor"] == 64.0


def test_no_partial_directory_on_failure(cases, tmp_path, monkeypatch):
    import k2vec.stages.weights as weights

    def boom(*a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(weights, "write_shards", boom)
    with pytest.raises(RuntimeError):
        write_checkpoint(cases["tiny"]["model"], tmp_path / "fp32")
    assert list(tmp_path.iterdir()) == []
