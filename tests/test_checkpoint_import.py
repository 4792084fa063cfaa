"""Import of a compressed-tensors checkpoint slice (k2vec.stages.import_checkpoint, docs/checkpoint-import.md).

(a) a checkpoint written by compressed-tensors' own compressor: codes and scales copied byte for byte,
    the fp32 side equal to the bf16 values / code x scale, the router restricted to the kept experts;
(b) round trip through this project's export: export -> import gives the same .qw/.sc bytes and the
    same int4 golden;
(c) malformed checkpoints stop with a message naming the file and the tensor;
plus the config checks (key-naming errors) and the rule wiring.
"""

import copy
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from k2vec.model.checkpoint import INDEX_NAME, Checkpoint  # noqa: E402
from k2vec.config.imports import CheckpointImportError, source_name  # noqa: E402
from k2vec.stages.import_checkpoint import import_checkpoint  # noqa: E402
from k2vec.errors import ConfigError  # noqa: E402
from k2vec.stages.golden import make_golden, open_weights, reference_model  # noqa: E402
from k2vec.stages.prompts import draw_prompts  # noqa: E402
from k2vec.model.int4_checkpoint import open_int4  # noqa: E402
from k2vec.stages.export_compressed_tensors import export_compressed_tensors  # noqa: E402
from k2vec.stages.quantize import quantize_checkpoint  # noqa: E402
from k2vec.config.expand import expand_config, resolve_model, schema_error  # noqa: E402
from k2vec.stages.weights import write_checkpoint  # noqa: E402
from conftest import REPO, default_config, snakemake, write_config  # noqa: E402
from test_workflow import scheduled_jobs  # noqa: E402
from support.ct_checkpoint import arch, write_ct_checkpoint  # noqa: E402

SCHEMA = REPO / "workflow/schemas/config.schema.yaml"
LAYERS, EXPERTS = [0, 2], [1, 3, 4, 6]  # tiny: layer 0 dense, 1-2 MoE; 8 experts in 2 groups of 4


def small_run(config: dict) -> dict:
    """Few, short prompts: enough for the golden to exercise every kept layer and expert."""
    config["prompts"].update(count=2, min_length=3, max_length=5)
    config["decoding"].update(max_new_tokens=4)
    config["decoding"]["ddtree"].update(budgets=[2], accuracies=[0.9])
    return config


def import_config(entries: dict) -> dict:
    config = small_run(default_config())
    config["models"] = entries
    return config


@pytest.fixture(scope="module")
def ct_dir(tmp_path_factory):
    return write_ct_checkpoint(tmp_path_factory.mktemp("ct") / "tiny", arch("tiny"))


@pytest.fixture(scope="module")
def imported(ct_dir, tmp_path_factory):
    case = expand_config(import_config({"imp": {"checkpoint": str(ct_dir), "layers": LAYERS,
                                                "experts": EXPERTS}}))["imp"]
    out = tmp_path_factory.mktemp("imported")
    import_checkpoint(case["model"], case["quantization"], out / "fp32", out / "int4")
    return with_prompts(case, out / "fp32"), out


def with_prompts(case, fp32_dir):
    """The case with its prompts drawn on its fp32 weights, as the prompts stage draws them."""
    ref = reference_model(case["model"], open_weights("fp32", fp32_dir))
    return {**case, "prompts": draw_prompts(case["prompts"], case["model"], {"fp32": ref})}


def bf16_to_f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


# ---------------------------------------------------------------------- (a) compressed-tensors' own checkpoint

def test_slice_config_keeps_layers_experts_and_groups(imported, ct_dir):
    m = imported[0]["model"]
    src = json.loads((ct_dir / "config.json").read_text())
    assert src["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (m["num_hidden_layers"], m["first_k_dense_replace"]) == (2, 1)  # dense layer 0, then source layer 2
    # 4 kept experts, 2 in each of the source's 2 groups: 2 groups of 2, topk_group and top-k as the source's
    assert (m["n_routed_experts"], m["n_group"], m["topk_group"], m["num_experts_per_tok"]) == (4, 2, 1, 2)
    assert m["source"]["layers"] == LAYERS and m["source"]["experts"] == EXPERTS
    assert (source_name(m, "model.layers.1.mlp.experts.2.up_proj.weight")
            == "model.layers.2.mlp.experts.4.up_proj.weight")
    assert source_name(m, "model.layers.0.self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert source_name(m, "lm_head.weight") == "lm_head.weight"
    q = imported[0]["quantization"]
    assert set(q["tensors"]) == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                 for e in range(4) for p in ("gate", "up", "down")}
    assert q["group_size"] == 32 and q["scheme"] == "checkpoint"


def test_int4_files_are_the_checkpoints_bytes(imported, ct_dir):
    case, out = imported
    src = {}
    for shard in sorted(set(json.loads((ct_dir / INDEX_NAME).read_text())["weight_map"].values())):
        src.update(load_file(str(ct_dir / shard)))
    q = open_int4(out / "int4")
    q.verify()
    fp32 = Checkpoint(out / "fp32")
    assert set(q) == set(case["quantization"]["tensors"])
    for name in q:
        m = source_name(case["model"], name)[: -len(".weight")]
        packed, scale = src[m + ".weight_packed"], src[m + ".weight_scale"]
        assert scale.dtype == torch.bfloat16 and q[name].scale_dtype == "bfloat16"
        assert (out / "int4" / f"{name}.qw").read_bytes() == packed.numpy().astype("<i4").tobytes()
        assert (out / "int4" / f"{name}.sc").read_bytes() == scale.view(torch.int16).numpy().astype("<i2").tobytes()
        # fp32 side: compressed-tensors' own unpacking, times the scale widened to float32 (exact)
        codes = unpack_from_int32(packed, 4, torch.Size(src[m + ".weight_shape"].tolist()))
        want = (codes.float() * scale.float().repeat_interleave(32, dim=1)).numpy()
        assert np.array_equal(fp32[name], want)
        assert np.array_equal(q[name].dequantize(), want)


def test_fp32_side_is_the_bf16_values_with_the_kept_router_rows(imported, ct_dir):
    case, out = imported
    src = {}
    for shard in sorted(set(json.loads((ct_dir / INDEX_NAME).read_text())["weight_map"].values())):
        src.update(load_file(str(ct_dir / shard)))
    fp32 = Checkpoint(out / "fp32")
    quantized = set(case["quantization"]["tensors"])
    for name in fp32:
        s = source_name(case["model"], name)
        if name in quantized:
            continue
        if ".mlp.gate." in name:
            want = src[s].float().numpy()[EXPERTS]
        else:
            want = src[s].float().numpy()
        assert fp32[name].dtype == np.float32 and np.array_equal(fp32[name], want), name
    assert "model.layers.1.mlp.gate.weight" in fp32 and fp32["model.layers.1.mlp.gate.weight"].shape[0] == 4
    # the source's bias was float32 (as Kimi K2 stores it) and stays bit for bit
    assert src["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_fp32_and_int4_goldens_agree_on_imported_weights(imported):
    """The fp32 side holds the dequantized experts, so both precisions compute on the user's weights."""
    case, out = imported
    fp32, _ = make_golden(case, open_weights("fp32", out / "fp32"), "fp32")
    int4, _ = make_golden(case, open_weights("int4", out / "fp32", out / "int4"), "int4")
    assert fp32.keys() == int4.keys()
    for k in fp32:
        assert np.array_equal(fp32[k], int4[k]), k
    # every kept expert was routed to at least once: the slice's experts are all exercised
    routed = np.concatenate([v.reshape(-1) for k, v in int4.items() if k.endswith("router_ids")])
    assert set(routed.tolist()) == set(range(4))


# ------------------------------------------------------------------------------ (b) round trip via our export

@pytest.mark.parametrize("scheme, scale_dtype", [("k2-checkpoint", "bfloat16"), ("default", "float32")])
def test_export_then_import_gives_the_same_bytes_and_golden(tmp_path, scheme, scale_dtype):
    config = small_run(default_config())
    config["models"] = {"tiny": {"preset": "tiny"}}
    config["quantization"].update(scheme=scheme, scale_dtype=scale_dtype)
    case = expand_config(config)["tiny"]
    write_checkpoint(case["model"], tmp_path / "fp32")
    quantize_checkpoint(tmp_path / "fp32", tmp_path / "int4", case["quantization"])
    export_compressed_tensors(tmp_path / "fp32", tmp_path / "int4", tmp_path / "ct")

    back = expand_config(import_config({"back": {"checkpoint": str(tmp_path / "ct"), "layers": [0, 1, 2]}}))["back"]
    arch_keys = ("hidden_size", "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok",
                 "first_k_dense_replace", "rope_scaling", "rms_norm_eps", "routed_scaling_factor")
    assert {k: back["model"][k] for k in arch_keys} == {k: case["model"][k] for k in arch_keys}
    assert set(back["quantization"]["tensors"]) == set(case["quantization"]["tensors"])
    import_checkpoint(back["model"], back["quantization"], tmp_path / "b-fp32", tmp_path / "b-int4")

    ours, theirs = open_int4(tmp_path / "int4"), open_int4(tmp_path / "b-int4")
    assert set(ours) == set(theirs)
    for name in ours:
        for suffix in (".qw", ".sc"):
            assert (tmp_path / "int4" / (name + suffix)).read_bytes() == \
                (tmp_path / "b-int4" / (name + suffix)).read_bytes(), name + suffix
    assert theirs.quantization["scale_dtype"] == scale_dtype
    # non-quantized tensors: the same float32 bytes
    a, b = Checkpoint(tmp_path / "fp32"), Checkpoint(tmp_path / "b-fp32")
    for name in a:
        if name not in ours:
            assert np.array_equal(a[name], b[name]), name

    case = with_prompts(case, tmp_path / "fp32")
    back["prompts"] = case["prompts"]  # the same prompts on both sides: the goldens must then be equal
    g1, _ = make_golden(case, open_weights("int4", tmp_path / "fp32", tmp_path / "int4"), "int4")
    g2, _ = make_golden(back, open_weights("int4", tmp_path / "b-fp32", tmp_path / "b-int4"), "int4")
    assert g1.keys() == g2.keys()
    for k in g1:
        assert np.array_equal(g1[k], g2[k]), k


# ----------------------------------------------------------------------------------- (c) malformed checkpoints

def _shard_of(directory, tensor):
    return json.loads((directory / INDEX_NAME).read_text())["weight_map"][tensor]


def _rewrite(directory, tensor, change):
    """Replace `tensor` in its shard by change(old tensor)."""
    shard = directory / _shard_of(directory, tensor)
    state = load_file(str(shard))
    state[tensor] = change(state[tensor])
    save_file(state, str(shard), metadata={"format": "pt"})
    return shard


EXPERT = "model.layers.2.mlp.experts.4.down_proj"  # kept: slice layer 1, expert 2


def _drop_from_index(directory, tensor):
    index = json.loads((directory / INDEX_NAME).read_text())
    del index["weight_map"][tensor]
    (directory / INDEX_NAME).write_text(json.dumps(index))
    return directory / INDEX_NAME


@pytest.mark.parametrize("break_it, tensor", [
    ("missing shard", "model.layers.2.input_layernorm.weight"),  # the first tensor read from it
    ("wrong weight_shape", EXPERT + ".weight_shape"),
    ("missing tensor", "model.layers.0.self_attn.q_a_layernorm.weight"),
    ("weight_scale dtype", EXPERT + ".weight_scale"),
    ("weight_packed dtype", EXPERT + ".weight_packed"),
    ("bf16 tensor stored as int", "model.layers.2.post_attention_layernorm.weight"),
    ("truncated shard", "model.norm.weight"),  # the last tensor of its shard
])
def test_malformed_checkpoint_names_file_and_tensor(ct_dir, tmp_path, break_it, tensor):
    broken = shutil.copytree(ct_dir, tmp_path / "ct")
    entry = {"checkpoint": str(broken), "layers": LAYERS, "experts": EXPERTS}
    case = expand_config(import_config({"imp": entry}))["imp"]  # resolved before the damage: the stage finds it
    if break_it == "missing shard":
        path = broken / _shard_of(broken, tensor)
        path.unlink()
    elif break_it == "wrong weight_shape":
        path = _rewrite(broken, tensor, lambda t: t.flip(0))  # [K, N] instead of [N, K]
    elif break_it == "missing tensor":
        path = _drop_from_index(broken, tensor)
    elif break_it == "weight_scale dtype":
        path = _rewrite(broken, tensor, lambda t: t.to(torch.float16))
    elif break_it == "weight_packed dtype":
        path = _rewrite(broken, tensor, lambda t: t.to(torch.int64))
    elif break_it == "bf16 tensor stored as int":
        path = _rewrite(broken, tensor, lambda t: t.view(torch.int16))
    else:
        path = broken / _shard_of(broken, tensor)
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 16)
    with pytest.raises(CheckpointImportError) as err:
        import_checkpoint(case["model"], case["quantization"], tmp_path / "fp32", tmp_path / "int4")
    message = str(err.value)
    assert str(path) in message and tensor in message, message
    assert not (tmp_path / "fp32").exists() and not (tmp_path / "int4").exists()  # nothing half-written


def _rewrite_header(shard, change):
    """Replace the shard's safetensors header by change(header) (which may edit it in place and return
    None), the data left as it is."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    new = change(header)
    head = json.dumps(header if new is None else new).encode()
    head += b" " * (-len(head) % 8)
    shard.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])


NORM = "model.layers.2.input_layernorm.weight"  # the first tensor the import reads from its shard
NORM2 = "model.layers.2.post_attention_layernorm.weight"  # same shard, same shape


def _entry(name, **fields):
    def change(header):
        header[name].update(fields)
        for k in [k for k, v in fields.items() if v is None]:
            del header[name][k]
    return change


def _nan_at(index, value=float("nan")):
    def change(t):
        t = t.clone()
        t.view(-1)[index] = value
        return t
    return change


# Each once gave a bare Python error without file or tensor, or imported silently.
HEADER_DAMAGE = {
    "header is a list": (NORM, lambda h: [h]),                                        # AttributeError
    "no data_offsets": (NORM2, _entry(NORM2, data_offsets=None)),                      # KeyError
    "string offsets": (NORM2, _entry(NORM2, data_offsets=["0", "128"])),              # TypeError
    "three offsets": (NORM2, _entry(NORM2, data_offsets=[0, 64, 128])),               # ValueError
    "float offsets": (NORM2, lambda h: h[NORM2].update(data_offsets=[float(o) for o in h[NORM2]["data_offsets"]])),
    "shape is a number": (NORM2, _entry(NORM2, shape=5)),                              # TypeError
    "dtype is a list": (NORM2, _entry(NORM2, dtype=["BF16"])),
    "entry is a string": (NORM2, lambda h: h.update({NORM2: "BF16"})),
    "overlapping offsets": (NORM2, lambda h: h[NORM2].update(data_offsets=h[NORM]["data_offsets"])),  # silent
}


@pytest.mark.parametrize("what", list(HEADER_DAMAGE))
def test_wrongly_typed_safetensors_header_names_file_and_tensor(ct_dir, tmp_path, what):
    tensor, change = HEADER_DAMAGE[what]
    broken = shutil.copytree(ct_dir, tmp_path / "ct")
    case = expand_config(import_config({"imp": {"checkpoint": str(broken), "layers": LAYERS, "experts": EXPERTS}}))
    path = broken / _shard_of(broken, tensor)
    _rewrite_header(path, change)
    with pytest.raises(CheckpointImportError) as err:
        import_checkpoint(case["imp"]["model"], case["imp"]["quantization"], tmp_path / "fp32", tmp_path / "int4")
    message = str(err.value)
    assert str(path) in message and tensor in message, message
    assert not (tmp_path / "fp32").exists()


@pytest.mark.parametrize("what, tensor", [
    ("trailing bytes", "model.norm.weight"),       # data no tensor holds: imported silently
    ("index maps to 5", NORM),                      # TypeError
    ("NaN weight", NORM),                           # imported, then a misleading prompt-redraw failure
    ("Inf weight", "model.norm.weight"),
    ("NaN scale", EXPERT + ".weight_scale"),
])
def test_malformed_data_and_index_name_file_and_tensor(ct_dir, tmp_path, what, tensor):
    broken = shutil.copytree(ct_dir, tmp_path / "ct")
    case = expand_config(import_config({"imp": {"checkpoint": str(broken), "layers": LAYERS, "experts": EXPERTS}}))
    path = broken / _shard_of(broken, tensor)
    if what == "trailing bytes":
        with open(path, "ab") as fh:
            fh.write(b"\0" * 16)
    elif what == "index maps to 5":
        index = json.loads((broken / INDEX_NAME).read_text())
        index["weight_map"][tensor] = 5
        path = broken / INDEX_NAME
        path.write_text(json.dumps(index))
    else:
        value = float("inf") if what == "Inf weight" else float("nan")
        _rewrite(broken, tensor, _nan_at(3, value))
    with pytest.raises(CheckpointImportError) as err:
        import_checkpoint(case["imp"]["model"], case["imp"]["quantization"], tmp_path / "fp32", tmp_path / "int4")
    message = str(err.value)
    assert str(path) in message and tensor in message, message
    if what.endswith(("weight", "scale")):
        assert "holds 1 non-finite value(s)" in message, message
    assert not (tmp_path / "fp32").exists()


@pytest.mark.parametrize("change, words", [
    ({"n_group": 0}, "n_group 0 is not an integer >= 1"),          # ZeroDivisionError while the config was read
    ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 8"),
    ({"n_group": "2"}, "n_group '2' is not an integer >= 1"),
    ({"topk_group": 4}, "topk_group 4 exceeds n_group 2"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers 2.5 is not an integer >= 1"),
])
def test_checkpoint_config_integers_are_checked_naming_the_key(ct_dir, tmp_path, change, words):
    bad = shutil.copytree(ct_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        resolve_model("imp", {"checkpoint": str(bad), "layers": [2]})
    assert err.value.key == "models.imp.checkpoint" and str(bad / "config.json") in str(err.value)
    assert words in str(err.value), str(err.value)


def test_the_pipelines_own_checkpoint_reader_checks_headers_too(tmp_path):
    from k2vec.model.checkpoint import CheckpointError, write_shards
    write_shards(tmp_path, [[("a", np.ones(4, np.float32)), ("b", np.zeros(4, np.float32))]], 1)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    (tmp_path / "config.json").write_text("{}")
    _rewrite_header(shard, lambda h: h["b"].update(data_offsets=[0, 16]))  # b over a
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor b .* overlaps tensor a"):
        Checkpoint(tmp_path, verify=False)["a"]
    _rewrite_header(shard, lambda h: [h])
    with pytest.raises(CheckpointError, match=rf"{shard}: safetensors header is a JSON array, not an object; it "
                                              rf"should hold a"):
        Checkpoint(tmp_path, verify=False)["a"]


def test_layer_out_of_range_names_the_key_and_config_file(ct_dir):
    with pytest.raises(ConfigError) as err:
        resolve_model("imp", {"checkpoint": str(ct_dir), "layers": [0, 3]})
    assert err.value.key == "models.imp.layers"
    assert str(ct_dir / "config.json") in str(err.value) and "layer 3" in str(err.value)


@pytest.mark.parametrize("entry, key, words", [
    ({"layers": [2, 1]}, "models.imp.layers", "ascending"),
    ({"layers": [0]}, "models.imp.layers", "all dense"),
    ({"layers": [2], "experts": [1, 8]}, "models.imp.experts", "expert 8 is out of range"),
    ({"layers": [2], "experts": [0, 1, 4]}, "models.imp.experts", "same number"),
    ({"layers": [2], "experts": [0, 4]}, "models.imp.experts", "at least 2"),
    ({"layers": [2], "num_experts_per_tok": 9}, "models.imp.num_experts_per_tok", "top-k"),
    ({}, "models.imp.layers", "name the source layers"),
])
def test_import_entry_errors_name_the_key(ct_dir, entry, key, words):
    with pytest.raises(ConfigError) as err:
        resolve_model("imp", {"checkpoint": str(ct_dir), **entry})
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_schema_checks_import_entries(ct_dir):
    good = import_config({"imp": {"checkpoint": str(ct_dir), "layers": [2]}, "tiny": {"preset": "tiny"}})
    assert schema_error(good, str(SCHEMA)) is None
    for bad, key in ((dict(layer=[2]), "models.imp"), (dict(layers="2"), "models.imp.layers"),
                     (dict(preset="tiny"), "models.imp")):
        config = copy.deepcopy(good)
        entry = config["models"]["imp"]
        entry.pop("layers") if "layer" in bad else None
        entry.update(bad)
        err = schema_error(config, str(SCHEMA))
        assert err is not None and err.key == key, (bad, err)


def test_checkpoint_that_is_not_compressed_tensors_is_refused(ct_dir, tmp_path):
    plain = shutil.copytree(ct_dir, tmp_path / "plain")
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        resolve_model("imp", {"checkpoint": str(plain), "layers": [2]})
    assert err.value.key == "models.imp.checkpoint" and "quantization_config" in str(err.value)


# ----------------------------------------------------------------------------------------- the rule

def test_imported_model_is_built_by_the_import_rule(ct_dir, tmp_path):
    """Dry run: an imported model's weights come from import_checkpoint, a synthetic one's from weights
    and quantize; the source shards the slice reads are the rule's inputs."""
    config = import_config({"imp": {"checkpoint": str(ct_dir), "layers": [2], "experts": EXPERTS},
                            "tiny": {"preset": "tiny"}})
    config["engines"] = {"numpy": config["engines"]["numpy"]}
    write_config(tmp_path / "config.yaml", config)
    res = snakemake("-n", "--cores", "1", "results/models/imp/int4", "results/models/tiny/int4",
                    "--configfile", str(tmp_path / "config.yaml"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = scheduled_jobs(res.stdout)
    assert (jobs["import_checkpoint"], jobs["weights"], jobs["quantize"]) == (1, 1, 1), jobs
    # the shards holding the kept tensors are inputs (a changed shard reruns the import)
    block = res.stdout[res.stdout.index("rule import_checkpoint:"):].split("\n\n")[0]
    shards = sorted(set(json.loads((ct_dir / INDEX_NAME).read_text())["weight_map"].values()))
    assert str(ct_dir / shards[2]) in block and str(ct_dir / shards[1]) not in block, block  # layer 2 in, 1 out
