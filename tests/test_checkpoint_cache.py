"""k2vec.engines.checkpoint_cache: the HF checkpoint that the llama.cpp and vLLM engines make from a bundle, and
the engine cache that keeps it (as a directory; the GGUF file's cache: tests/test_llama_cpp_engine.py)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from k2vec.config.presets import PRESETS
from k2vec.engines import checkpoint_cache
from k2vec.model import int4 as quant
from k2vec.model.architecture import hf_config, tensor_shapes
from k2vec.model.checkpoint import Checkpoint
from k2vec.stages.weights import make_tensor

MODEL = {"name": "t", "preset": "tiny", **PRESETS["tiny"], "seed": 3}


class FakeBundle(dict):
    """What the checkpoint writer reads of a KDTR bundle: tensors by name, `metadata`, `release`."""

    def __init__(self, tensors, metadata):
        super().__init__(tensors)
        self.metadata = metadata

    def release(self, name):
        pass


def tiny_bundle(int4: bool):
    """The tiny preset's weights as a bundle; with `int4`, the expert and dense MLP matrices as .qw/.sc
    (bfloat16 scales, stored as their bits). Returns (bundle, float32 weights as the golden sees them)."""
    shapes = tensor_shapes(MODEL)
    tensors, expect = {}, {}
    quantized = [n for n in shapes if int4 and ".mlp." in n and n.endswith("proj.weight")]
    for name, shape in shapes.items():
        w = make_tensor(MODEL, name, shape)
        if name in quantized:
            codes, scales = quant.quantize(w, 32, "bfloat16")
            tensors[name + ".qw"], tensors[name + ".sc"] = quant.pack(codes), quant.bf16_bits(scales)
            expect[name] = quant.dequantize(codes, scales, 32)
        else:
            tensors[name] = expect[name] = w
    q = {"group_size": 32, "scale_dtype": "bfloat16", "tensors": quantized} if int4 else None
    return FakeBundle(tensors, {"hf_config": hf_config(MODEL), "quantization": q}), expect


@pytest.mark.parametrize("int4", [False, True], ids=["fp32", "int4"])
def test_hf_checkpoint_holds_the_bundles_weights_dequantized(tmp_path, int4):
    bundle, expect = tiny_bundle(int4)
    assert not int4 or any(n.endswith(".qw") for n in bundle)
    checkpoint_cache.write_hf_checkpoint(bundle, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt/config.json").read_text()) == bundle.metadata["hf_config"]
    ckpt = Checkpoint(tmp_path / "ckpt")
    assert sorted(ckpt) == sorted(expect)   # DeepSeek-V3's per-expert names, as llama.cpp and vLLM read them
    for name, w in expect.items():
        assert ckpt[name].dtype == np.float32
        np.testing.assert_array_equal(ckpt[name], w, err_msg=name)   # exact: a wrong nibble or scale differs


def test_hf_checkpoint_names_a_tensor_the_bundle_lacks(tmp_path):
    bundle, _ = tiny_bundle(False)
    del bundle["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(checkpoint_cache.CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        checkpoint_cache.write_hf_checkpoint(bundle, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()




def test_a_checkpoint_directory_is_cached_once_per_bundle_and_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bundle = tmp_path / "b.kdtr"
    bundle.write_bytes(b"bundle one")
    calls = []

    def build(out: Path):
        assert out.is_dir() and not any(out.iterdir())   # an empty directory, under a temporary name
        assert out.name.endswith(".tmp")
        calls.append(out)
        (out / "config.json").write_text("{}")

    def get(identity):
        return checkpoint_cache.cached("k2vec-test", bundle, "hf-f32", build, identity, (checkpoint_cache.__name__,),
                                       directory=True)

    first, reused = get({"vllm": "0.32.0"})
    assert not reused and first.is_dir() and (first / "config.json").read_text() == "{}"
    assert first.parent == tmp_path / "cache/k2vec-test"
    again, reused = get({"vllm": "0.32.0"})
    assert reused and again == first and len(calls) == 1
    other, reused = get({"vllm": "0.33.0"})   # another library version: its own directory
    assert not reused and other != first and len(calls) == 2
    os.utime(first, (3600.0, 3600.0))   # used an hour after the epoch, long before `other`
    third, reused = get({"vllm": "0.34.0"})   # a third: the least recently used directory goes, lock and all
    assert not reused and len(calls) == 3
    assert sorted(p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")) == sorted(
        [other.name, third.name])
    assert not first.with_name(first.name + ".lock").exists() and other.with_name(other.name + ".lock").exists()


def test_a_failed_checkpoint_directory_leaves_nothing_under_its_final_name(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    bundle = tmp_path / "b.kdtr"
    bundle.write_bytes(b"bundle")
    root = tmp_path / "cache/k2vec-test"
    final = root / checkpoint_cache.cache_key(bundle, checkpoint_cache.sha256_file(bundle), "hf-f32", {},
                                              (checkpoint_cache.__name__,), "")
    stale = root / f".{final.name}.4242.x1y2.tmp"   # a killed writer's temporary directory
    (stale / "sub").mkdir(parents=True)

    def broken(out: Path):
        (out / "config.json").write_text("{")
        raise checkpoint_cache.CheckpointError("bundle has no tensor 'x'")

    with pytest.raises(checkpoint_cache.CheckpointError, match="no tensor 'x'"):
        checkpoint_cache.cached("k2vec-test", bundle, "hf-f32", broken, {}, (checkpoint_cache.__name__,),
                                directory=True)
    assert not final.exists() and not stale.exists()
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []
