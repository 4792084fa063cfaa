"""The quantize stage: fp32 checkpoint -> INT4 tensor files, and their export as a compressed-tensors checkpoint.

An int4 directory (docs/int4-format.md) holds, per quantized weight `<name>` (e.g.
`model.layers.1.mlp.experts.0.down_proj.weight`):
  <name>.qw   packed codes, uint8 [N, K/2], "int4-offset8-lownibble-first" (= LE bytes of the int32 words)
  <name>.sc   scales [N, K/group_size], raw little-endian in the scale dtype: float32, or bfloat16 bits
and `index.json` (shapes, group size, scale dtype, packing, byte lengths, sha256 of every file, and the
names of the tensors left unquantized, which stay in the fp32 checkpoint). The reader checks each file
against its sha256 before handing out its tensor. Every stage holds one tensor
(plus its packed output) in memory at a time and writes its directory atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from k2vec.atomic import atomic_directory
from k2vec.model.int4 import (
    BITS,
    GROUP_SIZES,
    PACKING,
    QMAX,
    QMIN,
    SCALE_DTYPES,
    ZERO_SCALE,
    QuantError,
    bf16_bits,
    dequantize,
    from_bf16_bits,
    quantize_packed,
    unpack,
)

INT4_INDEX = "index.json"
FORMAT = "k2vec-int4"
FORMAT_VERSION = 1
SPEC_KEYS = ("scheme", "targets", "ignore", "bits", "symmetric", "group_size", "scale_dtype", "tensors")
# .sc encoding per scale dtype: the scale dtype's own little-endian bytes, so the export copies them as-is.
SCALE_FILE_DTYPE = {"float32": "<f4", "bfloat16": "<u2"}
SCALE_ENCODING = {"float32": "float32-le", "bfloat16": "bfloat16-bits-le"}
COPY_CHUNK = 1 << 24  # bytes per write when streaming a tensor out of an mmap


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _sha256(data: memoryview | bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------- spec


def check_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise QuantError(f"quant_spec must be a dict, got {type(spec).__name__}")
    missing = [k for k in SPEC_KEYS if k not in spec]
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if missing or unknown:
        raise QuantError(f"quant_spec: missing keys {missing}, unknown keys {unknown}; "
                         f"expected exactly {list(SPEC_KEYS)}")
    if spec["bits"] != BITS or isinstance(spec["bits"], bool):
        raise QuantError(f"quant_spec['bits'] = {spec['bits']!r}: only 4-bit quantization is implemented")
    if spec["symmetric"] is not True:
        raise QuantError(f"quant_spec['symmetric'] = {spec['symmetric']!r}: only symmetric quantization is implemented")
    g = spec["group_size"]
    if isinstance(g, bool) or g not in GROUP_SIZES:
        raise QuantError(f"quant_spec['group_size'] = {g!r}: choose one of {GROUP_SIZES}")
    if spec["scale_dtype"] not in SCALE_DTYPES:
        raise QuantError(f"quant_spec['scale_dtype'] = {spec['scale_dtype']!r}: choose one of {SCALE_DTYPES}")
    if not isinstance(spec["scheme"], str):
        raise QuantError(f"quant_spec['scheme'] must be a string, got {spec['scheme']!r}")
    for key in ("targets", "ignore"):
        if not isinstance(spec[key], (list, tuple)) or not all(isinstance(p, str) for p in spec[key]):
            raise QuantError(f"quant_spec['{key}'] must be a list of pattern strings, got {spec[key]!r}")
    tensors = spec["tensors"]
    if not isinstance(tensors, Mapping) or not tensors:
        raise QuantError("quant_spec['tensors'] must be a non-empty dict tensor name -> [N, K]")
    shapes: dict[str, tuple[int, int]] = {}
    for name, shape in tensors.items():
        if (not isinstance(shape, (list, tuple)) or len(shape) != 2
                or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape)):
            raise QuantError(f"quant_spec['tensors'][{name!r}] = {shape!r}: expected [N, K] positive integers")
        if shape[1] % g:
            raise QuantError(f"quant_spec['tensors'][{name!r}]: K={shape[1]} is not divisible by group_size {g}")
        if not name.endswith(".weight") or "/" in name or name.startswith(".") or "\0" in name:
            raise QuantError(f"quant_spec['tensors']: {name!r} is not a '<module>.weight' tensor name usable as a "
                             f"file name")
        shapes[name] = (int(shape[0]), int(shape[1]))
    return {"scheme": spec["scheme"], "targets": list(spec["targets"]), "ignore": list(spec["ignore"]),
            "bits": BITS, "symmetric": True, "group_size": int(g), "scale_dtype": spec["scale_dtype"],
            "tensors": dict(sorted(shapes.items()))}


# ------------------------------------------------------------------------------------ quantize


def _scale_file_bytes(scales: np.ndarray, scale_dtype: str) -> np.ndarray:
    raw = bf16_bits(scales) if scale_dtype == "bfloat16" else scales
    return np.ascontiguousarray(raw, dtype=SCALE_FILE_DTYPE[scale_dtype])


def _write_array(path: Path, arr: np.ndarray) -> dict[str, Any]:
    data = memoryview(np.ascontiguousarray(arr)).cast("B")
    with open(path, "wb") as fh:
        fh.write(data)
    return {"file": path.name, "nbytes": data.nbytes, "sha256": _sha256(data)}


def write_int4(out_dir: str | os.PathLike, quant_spec: Mapping[str, Any], weight: Callable[[str], np.ndarray],
               unquantized: dict[str, dict[str, Any]]) -> dict:
    """Quantize `weight(name)` (float32 [N, K]) for every tensor of the spec, one tensor at a time, into
    the int4 directory `out_dir`; `unquantized`: name -> {dtype, shape} of the tensors left as they are."""
    spec = check_spec(quant_spec)
    g, sd = spec["group_size"], spec["scale_dtype"]
    entries: dict[str, Any] = {}
    with atomic_directory(out_dir) as tmp:
        for name, (n, k) in spec["tensors"].items():
            w = weight(name)
            if w.dtype != np.float32 or w.shape != (n, k):
                raise QuantError(f"tensor {name} is {w.dtype} {list(w.shape)}, the spec expects float32 {[n, k]}")
            packed, scales = quantize_packed(w, g, sd)
            del w
            qw = _write_array(tmp / f"{name}.qw", packed)
            sc = _write_array(tmp / f"{name}.sc", _scale_file_bytes(scales, sd))
            del packed, scales
            entries[name] = {
                "shape": [n, k], "group_size": g, "scale_dtype": sd, "packing": PACKING,
                "qweight": {**qw, "dtype": "uint8", "shape": [n, k // 2]},
                "scales": {**sc, "dtype": sd, "encoding": SCALE_ENCODING[sd],
                           "shape": [n, k // g]},
            }
        entries = dict(sorted(entries.items()))
        index = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "quantization": {
                "scheme": spec["scheme"], "targets": spec["targets"], "ignore": spec["ignore"],
                "bits": BITS, "symmetric": True, "group_size": g, "scale_dtype": sd,
                "qmin": QMIN, "qmax": QMAX, "packing": PACKING,
                "rule": "scale = absmax/7.5 in float32 per (row, group); bf16 scales rounded (RNE) before dividing; "
                        "zero scale -> eps of the scale dtype; q = round_half_even(clip(w/scale, -8, 7)); "
                        "w ~= q*scale (compressed-tensors pack-quantized)",
                "zero_scale": float(ZERO_SCALE[sd]),
            },
            "tensors": entries,
            "unquantized": {
                "location": "fp32 checkpoint",
                "note": "these tensors are not quantized; read them from the fp32 checkpoint this directory "
                        "was made from",
                "tensors": dict(sorted(unquantized.items())),
            },
        }
        (tmp / INT4_INDEX).write_bytes(json_bytes(index))
    return index


# -------------------------------------------------------------------------------------- reading


@dataclass(frozen=True, eq=False)
class Int4Tensor:
    """One quantized weight: `packed` and the raw scales are read-only memmaps of the .qw/.sc files."""

    name: str
    shape: tuple[int, int]
    group_size: int
    scale_dtype: str
    packed: np.ndarray      # uint8 [N, K/2]
    scales_raw: np.ndarray  # '<f4' or bf16 bits '<u2', [N, K/g]
    entry: dict

    @property
    def scales(self) -> np.ndarray:
        """float32 [N, K/g] (bf16 scales widened exactly)."""
        if self.scale_dtype == "bfloat16":
            return from_bf16_bits(self.scales_raw.astype(np.uint16))
        return self.scales_raw.astype(np.float32)

    def codes(self) -> np.ndarray:
        return unpack(self.packed, self.shape[1])

    def dequantize(self) -> np.ndarray:
        return dequantize(self.codes(), self.scales, self.group_size)

    def dequantize_rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 rows r0:r1 of `dequantize()` (the same values), reading only those rows' codes and scales."""
        raw = self.scales_raw[r0:r1]
        scales = from_bf16_bits(raw.astype(np.uint16)) if self.scale_dtype == "bfloat16" else raw.astype(np.float32)
        return dequantize(unpack(self.packed[r0:r1], self.shape[1]), scales, self.group_size)


def _memmap(path: Path, dtype: str, shape: tuple[int, int], nbytes: int) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if expected != nbytes:
        raise QuantError(f"{path}: index.json says {nbytes} bytes but shape {list(shape)} of {dtype} needs {expected}")
    if not path.exists():
        raise QuantError(f"{path}: file listed in index.json is missing")
    actual = path.stat().st_size
    if actual != expected:
        raise QuantError(f"{path}: {actual} bytes on disk, expected {expected} (truncated or stale file)")
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class Int4Checkpoint(Mapping[str, Int4Tensor]):
    """Read-only mapping quantized tensor name -> Int4Tensor, over an int4 directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        path = self.directory / INT4_INDEX
        if not path.exists():
            raise QuantError(f"{self.directory}: no {INT4_INDEX}; not an int4 directory (run the quantize stage)")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT or self.index.get("format_version") != FORMAT_VERSION:
            raise QuantError(f"{path}: format {self.index.get('format')!r} version "
                             f"{self.index.get('format_version')!r}, this reader handles {FORMAT!r} "
                             f"version {FORMAT_VERSION}")
        self.quantization: dict = self.index["quantization"]
        self.unquantized: list[str] = sorted(self.index["unquantized"]["tensors"])
        self._verified: set[str] = set()  # files checked against their sha256 by this reader

    def __getitem__(self, name: str) -> Int4Tensor:
        if name not in self.index["tensors"]:
            raise KeyError(name)
        e = self.index["tensors"][name]
        n, k = e["shape"]
        g, sd = e["group_size"], e["scale_dtype"]
        if e["packing"] != PACKING or sd not in SCALE_DTYPES or g not in GROUP_SIZES:
            raise QuantError(f"{self.directory}: tensor {name}: unsupported packing/scale dtype/group size "
                             f"{e['packing']!r}/{sd!r}/{g!r}")
        packed = _memmap(self.directory / e["qweight"]["file"], "u1", (n, k // 2), e["qweight"]["nbytes"])
        raw = _memmap(self.directory / e["scales"]["file"], SCALE_FILE_DTYPE[sd], (n, k // g), e["scales"]["nbytes"])
        self._check(name, e["qweight"], packed)
        self._check(name, e["scales"], raw)
        return Int4Tensor(name, (n, k), g, sd, packed, raw, e)

    def _check(self, name: str, part: dict, data: np.ndarray) -> None:
        """The mapped bytes against the sha256 index.json recorded when the file was written (once per reader)."""
        if part["file"] in self._verified:
            return
        got = _sha256(memoryview(data).cast("B"))
        if got != part["sha256"]:
            raise QuantError(f"{self.directory / part['file']}: tensor {name}: sha256 {got} differs from the one "
                             f"{INT4_INDEX} recorded when it was written ({part['sha256']}): the file changed "
                             f"since; rebuild the int4 directory (delete {self.directory})")
        self._verified.add(part["file"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.index["tensors"])

    def __len__(self) -> int:
        return len(self.index["tensors"])

    def verify(self) -> None:
        """Check every file's sha256 against index.json (reads all bytes)."""
        for name, e in self.index["tensors"].items():
            for part in ("qweight", "scales"):
                path = self.directory / e[part]["file"]
                h = hashlib.sha256()
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(COPY_CHUNK), b""):
                        h.update(chunk)
                if h.hexdigest() != e[part]["sha256"]:
                    raise QuantError(f"{path}: sha256 {h.hexdigest()} does not match index.json ({e[part]['sha256']})")


def open_int4(int4_dir: str | os.PathLike) -> Int4Checkpoint:
    return Int4Checkpoint(int4_dir)


def load_dequantized(int4_dir: str | os.PathLike, name: str) -> np.ndarray:
    """float32 [N, K] = code * scale for one quantized tensor."""
    ckpt = open_int4(int4_dir)
    if name not in ckpt:
        hint = " (it is unquantized: read it from the fp32 checkpoint)" if name in ckpt.unquantized else ""
        raise QuantError(f"{int4_dir}: {name} is not quantized here{hint}")
    return ckpt[name].dequantize()
