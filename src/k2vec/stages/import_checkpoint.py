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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from k2vec.atomic import atomic_directory
from k2vec.config.imports import SCHEME, CheckpointImportError, module_of, source_name, weight_map_of
from k2vec.digests import sha256_file
from k2vec.model.architecture import hf_config, tensor_shapes
from k2vec.model.checkpoint import DIGESTS_KEY, INDEX_NAME, read_header, shard_groups
from k2vec.model.int4 import BITS, PACKING, QMAX, QMIN, ZERO_SCALE, dequantize, from_bf16_bits, unpack
from k2vec.model.int4_checkpoint import FORMAT, FORMAT_VERSION, INT4_INDEX, SCALE_ENCODING, SCALE_FILE_DTYPE

_ST_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "I32": np.dtype("<i4"),
              "I64": np.dtype("<i8")}
_FLOAT_DTYPES = ("BF16", "F16", "F32")
_SCALE_DTYPES = {"BF16": "bfloat16", "F32": "float32"}
_COPY_CHUNK = 1 << 24
_FINITE_CHUNK = 1 << 22  # elements checked at once


# ------------------------------------------------------------------------------------- reading


class _Source:
    """Tensors of the source checkpoint by name, each checked (header entry, dtype, shape, offsets)
    before its bytes are copied out; a shard is mapped only while one tensor is read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index_path = directory / INDEX_NAME
        _, self.weight_map = weight_map_of({"source": {"checkpoint": str(directory)}})
        index = json.loads(self.index_path.read_text())
        metadata = index.get("metadata")
        digests = metadata.get(DIGESTS_KEY) if isinstance(metadata, dict) else None
        self.digests: dict[str, str] = digests if isinstance(digests, dict) else {}
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
            with open(path, "rb") as fh:  # every entry type-checked, the byte ranges tiling the data
                self._headers[fname] = read_header(path, fh, name, CheckpointImportError)
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
        if e["shape"] != list(shape):
            raise CheckpointImportError(f"{path}: tensor {name} has shape {e['shape']}, the config implies "
                                        f"{list(shape)}")
        # (read_header checked the offsets: their length fits dtype and shape, inside the file, no overlap)
        return path, e["dtype"], base + e["data_offsets"][0]

    def read(self, name: str, dtypes: tuple[str, ...], shape: list[int]) -> tuple[Path, str, np.ndarray]:
        """(its file, safetensors dtype, a copy of the tensor's raw values in that dtype's numpy type)."""
        path, dtype, offset = self.info(name, dtypes, shape)
        count = int(np.prod(shape, dtype=np.int64))
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            arr = np.frombuffer(mm, _ST_DTYPES[dtype], count, offset).reshape(shape).copy()
        return path, dtype, arr


def _finite(arr: np.ndarray, path: Path, tensor: str, what: str = "") -> np.ndarray:
    """`arr`, unless it holds a NaN or an infinity: then CheckpointImportError naming the file, the
    tensor and the first such element (a NaN weight once imported and failed later, as a prompt that
    could not be drawn). Checked in chunks: a few MB of flags at a time, whatever the tensor's size."""
    flat = arr.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHUNK):
        ok = np.isfinite(flat[start:start + _FINITE_CHUNK])
        if not ok.all():
            bad = start + int(np.argmin(ok))
            count = int(flat.size - np.isfinite(flat).sum())
            index = [int(i) for i in np.unravel_index(bad, arr.shape)]
            raise CheckpointImportError(f"{path}: tensor {tensor} holds {count} non-finite value(s) {what}"
                                        f"{' ' if what else ''}(the first, {flat[bad]}, at {index}); weights "
                                        f"must be finite")
    return arr


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
        """Slice tensor `name` as float32, every value finite; for a quantized weight, its .qw/.sc written
        on the way."""
        s = source_name(self.model, name)
        if name in self.q["tensors"]:
            return self._quantized(name, s, shape)
        if name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            # the router: the kept experts' rows of the source's
            source = self.model["source"]
            path, dtype, raw = self.src.read(s, _FLOAT_DTYPES, [source["n_routed_experts"], *shape[1:]])
            return _finite(_to_float32(dtype, raw[source["experts"]]), path, s, "of the kept experts' rows")
        m = module_of(s)
        if m and f"{m}.weight_packed" in self.src:
            raise CheckpointImportError(f"{self.src.index_path}: {s} is stored pack-quantized, but the case's "
                                        f"quantization section does not list it (rerun from the config)")
        path, dtype, raw = self.src.read(s, _FLOAT_DTYPES, shape)
        return _finite(_to_float32(dtype, raw), path, s)

    def _quantized(self, name: str, s: str, shape: list[int]) -> np.ndarray:
        n, k = shape
        m, g = module_of(s), self.g
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
        scale_path, sdt, scales_raw = self.src.read(f"{m}.weight_scale", tuple(_SCALE_DTYPES), [n, k // g])
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
        _finite(scales, scale_path, f"{m}.weight_scale")
        return _finite(dequantize(unpack(codes_bytes, k), scales, g), scale_path, f"{m}.weight_scale",
                       "once dequantized (code x scale overflows float32)")


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
                "tensors": {n: {"dtype": "float32", "shape": shapes[n]}
                            for n in sorted(set(shapes) - set(imp.entries))},
            },
        }
        (int4_tmp / INT4_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index
