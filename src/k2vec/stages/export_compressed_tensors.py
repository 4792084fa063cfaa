"""Rule `export_compressed_tensors`: the INT4 model in compressed-tensors' `pack-quantized` layout (vLLM and SGLang load
it)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from k2vec.atomic import atomic_directory
from k2vec.digests import sha256_file
from k2vec.model.checkpoint import DIGESTS_KEY, INDEX_NAME, Checkpoint
from k2vec.model.int4 import BITS, QuantError
from k2vec.model.int4_checkpoint import COPY_CHUNK, json_bytes, open_int4
from k2vec.model.schemes import is_linear

SAFETENSORS_DTYPE = {"float32": "F32", "bfloat16": "BF16"}
_NUMPY_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
                np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8",
                np.dtype(np.uint8): "U8"}


# ---------------------------------------------------------------------------------------- export


@dataclass
class _StTensor:
    name: str
    dtype: str               # safetensors dtype
    shape: list[int]
    nbytes: int
    data: Callable[[], memoryview]  # produces the bytes when the tensor is written (one at a time)


def _write_safetensors(path: Path, tensors: list[_StTensor]) -> int:
    """A safetensors file written tensor by tensor (names sorted, data in that order); returns the data size."""
    tensors = sorted(tensors, key=lambda t: t.name)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as the safetensors writer pads it
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little"))
        fh.write(head)
        for t in tensors:
            data = t.data()
            if data.nbytes != t.nbytes:
                raise QuantError(f"{path.name}: tensor {t.name} produced {data.nbytes} bytes, expected {t.nbytes}")
            for i in range(0, data.nbytes, COPY_CHUNK):
                fh.write(data[i:i + COPY_CHUNK])
            del data
    return offset


def _bytes_of(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr)).cast("B")


def quantization_config(group_size: int, ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors `quantization_config` (pack-quantized, symmetric INT4 groups), as in Kimi K2 Thinking."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": group_size, "dynamic": False, "observer": "minmax", "observer_kwargs": {},
                    "actorder": None, "block_structure": None,
                },
            },
        },
        "ignore": ignore,
    }


def export_compressed_tensors(fp32_dir: str | os.PathLike, int4_dir: str | os.PathLike,
                              out_dir: str | os.PathLike) -> dict:
    """Write an HF checkpoint in compressed-tensors pack-quantized layout; return its config.json dict.

    Shards keep the fp32 checkpoint's file names and grouping. A quantized `<p>.weight` becomes
    `<p>.weight_packed` (I32 [N, K/8], the .qw bytes), `<p>.weight_scale` (F32 or BF16 [N, K/g], the .sc
    bytes) and `<p>.weight_shape` (I64 [2]); other tensors are copied unchanged (float32). `ignore` lists
    every unquantized Linear module (k2vec.model.schemes.is_linear) by exact name, so the config selects
    exactly the exported modules whatever an engine's pattern matcher and module naming, and the shards vLLM
    fuses (q_a_proj with kv_a_proj_with_mqa, gate with up) agree (see docs/int4-format.md)."""
    ckpt = Checkpoint(fp32_dir)
    q = open_int4(int4_dir)
    names = set(ckpt)
    if set(q) | set(q.unquantized) != names or set(q) & set(q.unquantized):
        raise QuantError(f"{int4_dir} was not made from {fp32_dir}: their tensor names differ "
                         f"(e.g. {sorted(names ^ (set(q) | set(q.unquantized)))[:5]})")
    for name in q:
        if list(ckpt[name].shape) != list(q[name].shape):
            raise QuantError(f"{int4_dir} was not made from {fp32_dir}: {name} is {list(ckpt[name].shape)} in the "
                             f"checkpoint, {list(q[name].shape)} in the int4 index")
    group_sizes = {q[n].group_size for n in q}
    scale_dtypes = {q[n].scale_dtype for n in q}
    if len(group_sizes) != 1 or len(scale_dtypes) != 1:
        raise QuantError(f"{int4_dir}: one config group needs one group size and scale dtype, found "
                         f"{sorted(group_sizes)} / {sorted(scale_dtypes)}")
    (g,), (sd,) = group_sizes, scale_dtypes

    shards: dict[str, list[str]] = {}
    for name, fname in ckpt.weight_map.items():
        shards.setdefault(fname, []).append(name)
    ignore = sorted(n[: -len(".weight")] for n in q.unquantized
                    if n.endswith(".weight") and is_linear(n[: -len(".weight")]))
    config = dict(ckpt.config)
    config["quantization_config"] = quantization_config(g, ignore)

    weight_map: dict[str, str] = {}
    digests: dict[str, str] = {}
    total = 0
    with atomic_directory(out_dir) as tmp:
        for fname in sorted(shards):
            src = Checkpoint(fp32_dir)  # a reader per shard: its mmap closes after the shard (bounded RSS)
            entries: list[_StTensor] = []
            for name in shards[fname]:
                if name in q:
                    t = q[name]
                    n, k = t.shape
                    prefix = name[: -len(".weight")]
                    entries += [
                        _StTensor(f"{prefix}.weight_packed", "I32", [n, k // 8], n * k // 2,
                                  lambda t=t: _bytes_of(t.packed)),
                        _StTensor(f"{prefix}.weight_scale", SAFETENSORS_DTYPE[sd], [n, k // g], t.scales_raw.nbytes,
                                  lambda t=t: _bytes_of(t.scales_raw)),
                        _StTensor(f"{prefix}.weight_shape", "I64", [2], 16,
                                  lambda n=n, k=k: _bytes_of(np.array([n, k], "<i8"))),
                    ]
                else:
                    arr = src[name]
                    if arr.dtype not in _NUMPY_TO_ST:
                        raise QuantError(f"{fp32_dir}: tensor {name} has dtype {arr.dtype}, which cannot be copied "
                                         f"unambiguously (expected float32)")
                    entries.append(_StTensor(name, _NUMPY_TO_ST[arr.dtype], list(arr.shape), arr.nbytes,
                                             lambda name=name, src=src: _bytes_of(src[name])))
                    del arr
            total += _write_safetensors(tmp / fname, entries)
            digests[fname] = sha256_file(tmp / fname)
            weight_map.update({e.name: fname for e in entries})
            del src, entries
        index = {"metadata": {"total_size": total, DIGESTS_KEY: digests},
                 "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_bytes(json_bytes(index))
        (tmp / "config.json").write_bytes(json_bytes(config))
        # side files (generation_config.json, tokenizer files, ...) travel with the checkpoint unchanged
        for extra in sorted(Path(fp32_dir).iterdir()):
            if (extra.is_file() and extra.name not in ("config.json", INDEX_NAME)
                    and not extra.name.endswith(".safetensors") and not extra.name.startswith(".")):
                shutil.copyfile(extra, tmp / extra.name)
    return config
