"""Rule `quantize`: the fp32 checkpoint's selected Linear weights as INT4 `.qw`/`.sc` files (docs/int4-format.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from k2vec.model.checkpoint import Checkpoint
from k2vec.model.int4 import QuantError
from k2vec.model.int4_checkpoint import check_spec, write_int4
from k2vec.model.schemes import is_quantized


def _check_against_checkpoint(ckpt: Checkpoint, spec: dict[str, Any]) -> None:
    tensors = spec["tensors"]
    absent = sorted(set(tensors) - set(ckpt))
    if absent:
        raise QuantError(f"quant_spec lists {len(absent)} tensors missing from {ckpt.directory}: {absent[:5]}; "
                         f"the spec was resolved for another model")
    selected = {n for n in ckpt if is_quantized(n, spec["targets"], spec["ignore"])}
    if selected != set(tensors):
        extra, lacking = sorted(set(tensors) - selected), sorted(selected - set(tensors))
        raise QuantError(f"quant_spec['tensors'] disagrees with its targets/ignore patterns over {ckpt.directory}: "
                         f"listed but not selected {extra[:5]}, selected but not listed {lacking[:5]}; "
                         f"re-resolve the spec with k2vec.model.schemes.is_quantized")
    for name, shape in tensors.items():
        dtype, actual = ckpt.info(name)
        if dtype != np.float32 or tuple(actual) != shape:
            raise QuantError(f"{ckpt.directory}: tensor {name} is {dtype} {list(actual)}, the spec expects "
                             f"float32 {list(shape)}")


def quantize_checkpoint(fp32_dir: str | os.PathLike, out_dir: str | os.PathLike, quant_spec: Mapping[str, Any]) -> dict:
    """Quantize every tensor of `quant_spec["tensors"]` of the fp32 checkpoint into `out_dir`; return the index.

    Output bytes depend only on the inputs (tensor order, JSON key order and formatting are fixed)."""
    spec = check_spec(quant_spec)
    ckpt = Checkpoint(fp32_dir)
    _check_against_checkpoint(ckpt, spec)
    unquantized = {}
    for name in sorted(set(ckpt) - set(spec["tensors"])):
        dtype, shape = ckpt.info(name)
        unquantized[name] = {"dtype": str(dtype), "shape": list(shape)}
    # each tensor is its own mapping (k2vec.model.checkpoint): its pages go when the array does
    return write_int4(out_dir, spec, ckpt.__getitem__, unquantized)
