"""Import a slice of a local DeepseekV3 / Kimi-K2 checkpoint in compressed-tensors `pack-quantized` format.

A model entry `{checkpoint: DIR, layers: [...], experts: [...]}` (docs/checkpoint-import.md) names a
directory with `config.json`, `model.safetensors.index.json` and its shards: quantized Linear modules
as `<m>.weight_packed` (I32 [N, K/8]), `<m>.weight_scale` (BF16 or F32 [N, K/g]) and `<m>.weight_shape`
(int [2] = [N, K]); every other tensor BF16 (F16/F32 accepted). The import stage writes the slice as
the pipeline's own weights:

  fp32/  every slice tensor as float32: BF16/F16 widened (exact); a quantized weight as code x scale
         (its dequantized value, exact for BF16 scales), so the fp32 golden sees the user's values too;
  int4/  each quantized weight's `.qw` = the `weight_packed` bytes and `.sc` = the `weight_scale` bytes,
         copied code for code (never re-quantized; docs/int4-format.md: the same bytes).

The slice: kept layers are renumbered 0..n-1 in source order (dense ones first, as in the source, so
`first_k_dense_replace` = the number of kept dense layers); kept experts are renumbered 0..m-1 in
source order in every kept MoE layer. Routing over a subset of experts is the source router restricted
to them: the router rows and `e_score_correction_bias` entries of the kept experts are copied, so each
kept expert's sigmoid score is exactly the source's; the top-k then chooses among the kept experts
only. Expert groups stay groups: a source group that holds kept experts is a group of the slice (all
such groups must hold the same number, at least 2), `topk_group` = min(source's, groups kept), and
`num_experts_per_tok` = min(source's, experts the kept groups hold) unless the entry sets it.

Nothing is read unverified: each tensor's header entry (dtype, shape, offsets inside the file) is
checked against the config before its bytes are used, and a shard whose sha256 the index records
(this project's export does) is hashed first. Errors name the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .architecture import ARCH_KEYS, hf_config, tensor_shapes
from .atomic import atomic_directory
from .checkpoint import DIGESTS_KEY, INDEX_NAME
from .digests import sha256_file
from .errors import ConfigError, K2VecError
from .int4_checkpoint import FORMAT, FORMAT_VERSION, INT4_INDEX, SCALE_ENCODING, SCALE_FILE_DTYPE
from .quant import BITS, GROUP_SIZES, PACKING, QMAX, QMIN, ZERO_SCALE, dequantize, from_bf16_bits, unpack
from .weights import shard_groups

ENTRY_KEYS = ("checkpoint", "layers", "experts", "num_experts_per_tok")
SCHEME = "checkpoint"  # the quantization section's scheme for an imported model
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Defaults of DeepseekV3Config for keys a checkpoint's config.json may leave out.
_CONFIG_DEFAULTS = {"n_shared_experts": 0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                    "q_lora_rank": None, "rope_scaling": None, "routed_scaling_factor": 1.0,
                    "norm_topk_prob": False}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim")
_ST_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "I32": np.dtype("<i4"),
              "I64": np.dtype("<i8")}
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_SCALE_DTYPES = {"BF16": "bfloat16", "F32": "float32"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.*)$")
_COPY_CHUNK = 1 << 24


class CheckpointImportError(K2VecError):
    """A source checkpoint that cannot be imported as it is; the message names the file and tensor."""


def is_import(entry: Any) -> bool:
    return isinstance(entry, Mapping) and "checkpoint" in entry


# ------------------------------------------------------------------------------- config (parse time)


def _read_json(path: Path, key: str) -> dict:
    if not path.is_file():
        raise ConfigError(key, f"{path} does not exist; the checkpoint directory needs config.json and {INDEX_NAME}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{path} is not readable JSON: {err}") from None


def _source_arch(cfg: dict, cfg_path: Path, key: str) -> dict[str, Any]:
    """The ARCH_KEYS of a DeepseekV3/Kimi-K2 config.json (legacy `rope_scaling` or HF 5 `rope_parameters`)."""
    if "text_config" in cfg:
        raise ConfigError(key, f"{cfg_path} nests the text model in text_config (a multimodal checkpoint); "
                               f"only DeepseekV3/Kimi-K2 text checkpoints with top-level settings are supported")
    if cfg.get("model_type") not in MODEL_TYPES:
        raise ConfigError(key, f"{cfg_path}: model_type {cfg.get('model_type')!r}, expected one of {MODEL_TYPES}")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(key, f"{cfg_path}: moe_layer_freq {cfg['moe_layer_freq']} (only 1 is implemented)")
    cfg = dict(cfg)
    rp = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(rp, Mapping):
        cfg["rope_theta"] = rp.get("rope_theta")
        if rp.get("rope_type") == "yarn":
            cfg["rope_scaling"] = dict(rp)
    arch = {}
    for k in ARCH_KEYS:
        if k in cfg:
            arch[k] = cfg[k]
        elif k in _CONFIG_DEFAULTS:
            arch[k] = _CONFIG_DEFAULTS[k]
        else:
            raise ConfigError(key, f"{cfg_path} has no {k!r}")
    rs = arch["rope_scaling"]
    if rs is not None:
        if (rs.get("type") or rs.get("rope_type")) != "yarn":
            raise ConfigError(key, f"{cfg_path}: rope_scaling {rs!r} is not YaRN (the only scaling implemented)")
        if rs.get("truncate", True) is not True:
            raise ConfigError(key, f"{cfg_path}: rope_scaling.truncate false (YaRN without the integer ramp bounds) "
                                   f"is not implemented")
        # written back by architecture.hf_config with rope_type and truncate, as for a synthetic model
        arch["rope_scaling"] = {"type": "yarn", **{k: rs[k] for k in _YARN_KEYS if k in rs and "type" not in k}}
    return arch


def _quant_group(cfg: dict, cfg_path: Path, key: str) -> dict[str, Any]:
    """The one weight config group of a compressed-tensors pack-quantized symmetric INT4 quantization_config."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "compressed-tensors":
        raise ConfigError(key, f"{cfg_path}: no compressed-tensors quantization_config; the import takes "
                               f"checkpoints whose experts are pack-quantized INT4")
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    formats = {g.get("format") or qc.get("format") for g in groups}
    if len(groups) != 1 or formats != {"pack-quantized"}:
        raise ConfigError(key, f"{cfg_path}: quantization_config needs exactly one weight group in format "
                               f"pack-quantized, found {len(groups)} in {sorted(map(str, formats))}")
    w = groups[0]["weights"]
    want = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group"}
    bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
    if bad or w.get("actorder") not in (None, False) or w.get("group_size") not in GROUP_SIZES:
        raise ConfigError(key, f"{cfg_path}: quantization_config weights {bad or w!r}: only symmetric INT4 "
                               f"groups of {GROUP_SIZES} without act-order are implemented")
    return {"targets": list(groups[0].get("targets") or []), "ignore": list(qc.get("ignore") or []),
            "group_size": int(w["group_size"])}


def _int_list(value: Any, key: str, what: str) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ConfigError(key, f"must be a non-empty list of {what} indices (non-negative integers), got {value!r}")
    if value != sorted(set(value)):
        raise ConfigError(key, f"list each {what} once, in ascending order (the slice keeps the source "
                               f"order), got {value}")
    return value


def resolve_import(name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture of the slice an import entry names (HF key names), plus `source`: where it comes
    from (absolute directory, kept source layers and experts). Reads config.json and the index only."""
    key = f"models.{name}"
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", f"unknown key of a checkpoint import; known: {list(ENTRY_KEYS)}")
    if not isinstance(entry["checkpoint"], str) or not entry["checkpoint"]:
        raise ConfigError(f"{key}.checkpoint", f"must be a directory path, got {entry['checkpoint']!r}")
    directory = Path(os.path.abspath(entry["checkpoint"]))
    if not directory.is_dir():
        raise ConfigError(f"{key}.checkpoint", f"{directory} is not a directory")
    cfg_path = directory / "config.json"
    cfg = _read_json(cfg_path, f"{key}.checkpoint")
    src = _source_arch(cfg, cfg_path, f"{key}.checkpoint")
    group = _quant_group(cfg, cfg_path, f"{key}.checkpoint")
    if "layers" not in entry:
        raise ConfigError(f"{key}.layers", "name the source layers to keep, e.g. layers: [0, 3]")
    layers = _int_list(entry["layers"], f"{key}.layers", "layer")
    L = src["num_hidden_layers"]
    if layers[-1] >= L:
        raise ConfigError(f"{key}.layers", f"layer {layers[-1]} is out of range: {cfg_path} has num_hidden_layers "
                                           f"{L} (layers 0..{L - 1})")
    E, G = src["n_routed_experts"], src["n_group"]
    experts = _int_list(entry.get("experts", list(range(E))), f"{key}.experts", "expert")
    if experts[-1] >= E:
        raise ConfigError(f"{key}.experts", f"expert {experts[-1]} is out of range: {cfg_path} has "
                                            f"n_routed_experts {E} (experts 0..{E - 1})")
    # Expert groups: the source's groups that hold kept experts, each holding the same number (>= 2).
    per_group = E // G
    held = np.bincount(np.asarray(experts) // per_group, minlength=G)
    counts = sorted(set(held[held > 0].tolist()))
    if len(counts) != 1 or counts[0] < 2:
        raise ConfigError(f"{key}.experts", f"the source has {G} expert groups of {per_group} "
                                            f"(n_group {G}); keep the same number (at least 2) of experts in every "
                                            f"group you keep experts from, got {held.tolist()} per group")
    n_group = int((held > 0).sum())
    topk_group = min(src["topk_group"], n_group)
    top_k = entry.get("num_experts_per_tok", min(src["num_experts_per_tok"], topk_group * counts[0]))
    dense = sum(1 for i in layers if i < src["first_k_dense_replace"])
    if dense == len(layers):
        raise ConfigError(f"{key}.layers", f"layers {layers} are all dense (first_k_dense_replace "
                                           f"{src['first_k_dense_replace']} in {cfg_path}): keep at least one MoE "
                                           f"layer, whose INT4 experts the int4 precision is about")
    return {**src, "num_hidden_layers": len(layers), "first_k_dense_replace": dense,
            "n_routed_experts": len(experts), "n_group": n_group, "topk_group": topk_group,
            "num_experts_per_tok": top_k,
            "source": {"checkpoint": str(directory), "layers": list(layers), "experts": list(experts),
                       "n_routed_experts": E, "quantization": group}}


def source_name(model: Mapping[str, Any], name: str) -> str:
    """The source checkpoint's name of slice tensor `name` (layer and expert indices mapped back)."""
    m = _LAYER.match(name)
    if not m:
        return name
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.{model['source']['experts'][int(e.group(1))]}.{e.group(2)}"
    return f"model.layers.{model['source']['layers'][int(m.group(1))]}.{rest}"


def _module(name: str) -> str | None:
    return name[: -len(".weight")] if name.endswith(".weight") else None


def _weight_map(model: Mapping[str, Any]) -> tuple[Path, dict[str, str]]:
    directory = Path(model["source"]["checkpoint"])
    path = directory / INDEX_NAME
    if not path.is_file():
        raise CheckpointImportError(f"{path} does not exist: the checkpoint has no safetensors index")
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointImportError(f"{path}: not a safetensors index with a weight_map ({err})") from None
    return path, weight_map


def resolve_import_quantization(model: Mapping[str, Any]) -> dict[str, Any]:
    """The quantization section of an imported model: the slice's weights the source stores packed."""
    _, weight_map = _weight_map(model)
    tensors = {n: s for n, s in tensor_shapes(model).items()
               if _module(n) and f"{_module(source_name(model, n))}.weight_packed" in weight_map}
    if not tensors:
        raise ConfigError(f"models.{model['name']}.layers", f"the slice holds no pack-quantized weight of "
                                                            f"{model['source']['checkpoint']}")
    q = model["source"]["quantization"]
    return {"scheme": SCHEME, "targets": q["targets"], "ignore": q["ignore"], "bits": BITS, "symmetric": True,
            "group_size": q["group_size"], "tensors": tensors}


def source_files(model: Mapping[str, Any]) -> list[str]:
    """The source files the slice reads (config, index and the shards that exist), as the stage's inputs;
    a shard that is missing is left to the stage, whose error names it and a tensor it should hold."""
    directory = Path(model["source"]["checkpoint"])
    _, weight_map = _weight_map(model)
    shards = set()
    for n in tensor_shapes(model):
        s = source_name(model, n)
        m = _module(s)
        for candidate in (s, f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape"):
            if candidate in weight_map:
                shards.add(weight_map[candidate])
    files = [directory / "config.json", directory / INDEX_NAME] + [directory / f for f in sorted(shards)]
    return [str(f) for f in files if f.is_file()]


# ------------------------------------------------------------------------------------- reading


class _Source:
    """Tensors of the source checkpoint by name, each checked (header entry, dtype, shape, offsets)
    before its bytes are copied out; a shard is mapped only while one tensor is read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index_path = directory / INDEX_NAME
        index = json.loads(self.index_path.read_text())
        self.weight_map: dict[str, str] = index["weight_map"]
        self.digests: dict[str, str] = (index.get("metadata") or {}).get(DIGESTS_KEY) or {}
        self._headers: dict[str, tuple[dict, int, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _header(self, name: str) -> tuple[Path, dict, int, int]:
        fname = self.weight_map[name]
        path = self.directory / fname
        if fname not in self._headers:
            if not path.is_file():
                raise CheckpointImportError(f"{path}: shard missing ({self.index_path.name} maps tensor {name} "
                                            f"to it)")
            if fname in self.digests and sha256_file(path) != self.digests[fname]:
                raise CheckpointImportError(f"{path}: sha256 differs from the one {self.index_path.name} records "
                                            f"for it (the shard holding {name} changed since it was written)")
            size = path.stat().st_size
            with open(path, "rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if n < 2 or 8 + n > size:
                    raise CheckpointImportError(f"{path}: not a safetensors file (header length {n}, file "
                                                f"{size} bytes); it should hold {name}")
                try:
                    header = json.loads(fh.read(n))
                except ValueError as err:
                    raise CheckpointImportError(f"{path}: safetensors header is not JSON ({err}); it should "
                                                f"hold {name}") from None
            self._headers[fname] = (header, 8 + n, size)
        header, base, size = self._headers[fname]
        return path, header, base, size

    def info(self, name: str, dtypes: tuple[str, ...], shape: list[int]) -> tuple[Path, str, int]:
        """(file, dtype, absolute offset) of `name` after checking it against the expected dtype and shape."""
        if name not in self.weight_map:
            raise CheckpointImportError(f"{self.index_path}: tensor {name} is missing (the config says the slice "
                                        f"needs it)")
        path, header, base, size = self._header(name)
        e = header.get(name)
        if not isinstance(e, dict):
            raise CheckpointImportError(f"{path}: tensor {name} is missing from this shard's header, though "
                                        f"{self.index_path.name} maps it here")
        if e.get("dtype") not in dtypes:
            raise CheckpointImportError(f"{path}: tensor {name} has dtype {e.get('dtype')}, expected one of "
                                        f"{list(dtypes)}")
        if list(e.get("shape", [])) != list(shape):
            raise CheckpointImportError(f"{path}: tensor {name} has shape {e.get('shape')}, the config implies "
                                        f"{list(shape)}")
        begin, end = e["data_offsets"]
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ST_DTYPES[e["dtype"]].itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise CheckpointImportError(f"{path}: tensor {name} has data_offsets {[begin, end]} for {nbytes} bytes "
                                        f"in a file of {size} bytes (truncated or corrupt shard)")
        return path, e["dtype"], base + begin

    def read(self, name: str, dtypes: tuple[str, ...], shape: list[int]) -> tuple[Path, str, np.ndarray]:
        """(its file, safetensors dtype, a copy of the tensor's raw values in that dtype's numpy type)."""
        path, dtype, offset = self.info(name, dtypes, shape)
        count = int(np.prod(shape, dtype=np.int64))
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            arr = np.frombuffer(mm, _ST_DTYPES[dtype], count, offset).reshape(shape).copy()
        return path, dtype, arr


def _to_float32(dtype: str, raw: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return from_bf16_bits(raw.astype(np.uint16))
    return raw.astype(np.float32)


# ------------------------------------------------------------------------------------- writing


def _write_safetensors(path: Path, tensors: list[tuple[str, list[int], Callable[[], np.ndarray]]]) -> tuple[int, str]:
    """A float32 safetensors file written tensor by tensor (names sorted); returns (data bytes, sha256)."""
    tensors = sorted(tensors, key=lambda t: t[0])
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    head += b" " * (-len(head) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        for part in (len(head).to_bytes(8, "little"), head):
            fh.write(part)
            h.update(part)
        for name, shape, produce in tensors:
            arr = np.ascontiguousarray(produce(), dtype="<f4")
            if list(arr.shape) != list(shape):
                raise CheckpointImportError(f"{path.name}: tensor {name} came out {list(arr.shape)}, not {shape}")
            data = memoryview(arr).cast("B")
            for i in range(0, data.nbytes, _COPY_CHUNK):
                fh.write(data[i:i + _COPY_CHUNK])
                h.update(data[i:i + _COPY_CHUNK])
            del arr, data
    return offset, h.hexdigest()


def _write_raw(path: Path, arr: np.ndarray) -> dict[str, Any]:
    data = memoryview(np.ascontiguousarray(arr)).cast("B")
    path.write_bytes(data)
    return {"file": path.name, "nbytes": data.nbytes, "sha256": hashlib.sha256(data).hexdigest()}


class _Importer:
    def __init__(self, model: Mapping[str, Any], quantization: Mapping[str, Any], int4_tmp: Path):
        self.model, self.q, self.int4_tmp = model, quantization, int4_tmp
        self.src = _Source(Path(model["source"]["checkpoint"]))
        self.g = quantization["group_size"]
        self.entries: dict[str, Any] = {}
        self.scale_dtypes: set[str] = set()

    def tensor(self, name: str, shape: list[int]) -> np.ndarray:
        """Slice tensor `name` as float32; for a quantized weight, its .qw/.sc written on the way."""
        s = source_name(self.model, name)
        if name in self.q["tensors"]:
            return self._quantized(name, s, shape)
        if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            # the router: the kept experts' rows of the source's
            source = self.model["source"]
            _, dtype, raw = self.src.read(s, _FLOAT_DTYPES, [source["n_routed_experts"], *shape[1:]])
            return _to_float32(dtype, raw[source["experts"]])
        m = _module(s)
        if m and f"{m}.weight_packed" in self.src:
            raise CheckpointImportError(f"{self.src.index_path}: {s} is stored pack-quantized, but the case's "
                                        f"quantization section does not list it (rerun from the config)")
        _, dtype, raw = self.src.read(s, _FLOAT_DTYPES, shape)
        return _to_float32(dtype, raw)

    def _quantized(self, name: str, s: str, shape: list[int]) -> np.ndarray:
        n, k = shape
        m, g = _module(s), self.g
        if f"{m}.weight_zero_point" in self.src:
            raise CheckpointImportError(f"{self.src.index_path}: {m}.weight_zero_point exists: asymmetric INT4 is "
                                        f"not implemented")
        if s in self.src:
            raise CheckpointImportError(f"{self.src.index_path}: {s} exists beside {m}.weight_packed; a module is "
                                        f"either quantized or not")
        path, _, ws = self.src.read(f"{m}.weight_shape", ("I64", "I32"), [2])
        if ws.tolist() != [n, k]:
            raise CheckpointImportError(f"{path}: tensor {m}.weight_shape is {ws.tolist()}, the config implies "
                                        f"[{n}, {k}] for {s}")
        _, _, packed = self.src.read(f"{m}.weight_packed", ("I32",), [n, k // 8])
        _, sdt, scales_raw = self.src.read(f"{m}.weight_scale", tuple(_SCALE_DTYPES), [n, k // g])
        sd = _SCALE_DTYPES[sdt]
        self.scale_dtypes.add(sd)
        codes_bytes = packed.view(np.uint8).reshape(n, k // 2)  # little-endian words: the .qw bytes
        raw = scales_raw.astype(SCALE_FILE_DTYPE[sd], copy=False)
        qw = _write_raw(self.int4_tmp / f"{name}.qw", codes_bytes)
        sc = _write_raw(self.int4_tmp / f"{name}.sc", raw)
        self.entries[name] = {
            "shape": [n, k], "group_size": g, "scale_dtype": sd, "packing": PACKING,
            "qweight": {**qw, "dtype": "uint8", "shape": [n, k // 2]},
            "scales": {**sc, "dtype": sd, "encoding": SCALE_ENCODING[sd], "shape": [n, k // g]},
        }
        scales = from_bf16_bits(raw) if sd == "bfloat16" else raw.astype(np.float32)
        return dequantize(unpack(codes_bytes, k), scales, g)


def import_checkpoint(model: Mapping[str, Any], quantization: Mapping[str, Any],
                      fp32_out: str | os.PathLike, int4_out: str | os.PathLike) -> dict[str, Any]:
    """Write the slice `model` (a resolved imported model spec) as an fp32 checkpoint and an int4
    directory; return the int4 index. One tensor is held in memory at a time."""
    if "source" not in model:
        raise CheckpointImportError(f"model {model.get('name')!r} is not an imported model (no 'source')")
    shapes = tensor_shapes(model)
    groups = shard_groups(model)
    with atomic_directory(fp32_out) as fp32_tmp, atomic_directory(int4_out) as int4_tmp:
        imp = _Importer(model, quantization, int4_tmp)
        weight_map, digests, total = {}, {}, 0
        for i, names in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            size, digest = _write_safetensors(
                fp32_tmp / fname, [(n, shapes[n], lambda n=n: imp.tensor(n, shapes[n])) for n in names])
            total += size
            digests[fname] = digest
            weight_map.update({n: fname for n in names})
        (fp32_tmp / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total, DIGESTS_KEY: digests}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2) + "\n")
        (fp32_tmp / "config.json").write_text(json.dumps(hf_config(model), indent=2, sort_keys=True) + "\n")
        if len(imp.scale_dtypes) != 1:
            raise CheckpointImportError(f"{imp.src.index_path}: the slice's weight_scale tensors mix dtypes "
                                        f"{sorted(imp.scale_dtypes)}; one config group has one scale dtype")
        (sd,) = imp.scale_dtypes
        index = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "quantization": {
                "scheme": SCHEME, "targets": quantization["targets"], "ignore": quantization["ignore"],
                "bits": BITS, "symmetric": True, "group_size": imp.g, "scale_dtype": sd,
                "qmin": QMIN, "qmax": QMAX, "packing": PACKING,
                "rule": "imported: codes and scales copied from a compressed-tensors pack-quantized checkpoint "
                        "(weight_packed, weight_scale), not re-quantized; w ~= q*scale",
                "zero_scale": float(ZERO_SCALE[sd]),
            },
            "tensors": dict(sorted(imp.entries.items())),
            "unquantized": {
                "location": "fp32 checkpoint",
                "note": "these tensors are not quantized; read them from the fp32 checkpoint this directory "
                        "was imported with",
                "tensors": {n: {"dtype": "float32", "shape": shapes[n]} for n in sorted(set(shapes) - set(imp.entries))},
            },
        }
        (int4_tmp / INT4_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index
