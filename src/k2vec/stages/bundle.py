"""KDTR bundles: one self-contained file per (model, precision) with everything an engine needs.

Tensors (docs/bundle-contents.md):
  * weights under their DeepSeek-V3 names; for int4, each quantized weight `<name>` appears as
    `<name>.qw` (u8, packing int4: the `.qw` bytes) and `<name>.sc` (f32 or bf16 scales), and only
    the unquantized weights keep their fp32 `<name>`;
  * the prompts and the golden data, copied verbatim from the golden file (docs/golden-format.md).
Metadata: the resolved model spec, its HF config.json, the precision, the quantization scheme and
packing, decoding settings, the golden metadata and the golden file's sha256. Tensors are streamed one
at a time.

Nothing is copied unverified: the golden must pass every KDTR checksum and match its sha256 record
(a damaged golden would otherwise be laundered into a bundle with fresh, valid checksums), and the
weights are checked against the hashes in their indexes as they are read. The bundle gets its own
`<bundle>.sha256` record, which the engine runner and the report check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from k2vec import __version__
from k2vec.digests import IntegrityError, verify_kdtr, write_record
from k2vec.kdtr import TensorData, bf16, int4, open_bundle, write_bundle
from k2vec.model.architecture import hf_config
from k2vec.model.checkpoint import Checkpoint

QW_SUFFIX, SC_SUFFIX = ".qw", ".sc"


def _lazy(mapping, name: str) -> Callable[[], np.ndarray]:
    return lambda: np.asarray(mapping[name])


def _weight_tensors(precision: str, fp32_dir: str | Path, int4_dir: str | Path | None
                    ) -> tuple[Iterator[tuple[str, Any]], dict[str, Any] | None]:
    fp32 = Checkpoint(fp32_dir)
    if precision == "fp32":
        return ((n, _lazy(fp32, n)) for n in fp32), None
    # Imported here: the fp32 side never runs the quantizer (its stages do not declare it, k2vec.pipeline.code_digest).
    from k2vec.model.int4_checkpoint import open_int4

    q = open_int4(int4_dir)
    quantized = set(q.index["tensors"])

    def items() -> Iterator[tuple[str, Any]]:
        for n in fp32:
            if n not in quantized:
                yield n, _lazy(fp32, n)
                continue
            yield n + QW_SUFFIX, int4(lambda n=n: np.asarray(q[n].packed))
            if q[n].scale_dtype == "bfloat16":
                yield n + SC_SUFFIX, bf16(lambda n=n: np.asarray(q[n].scales_raw, dtype=np.uint16))
            else:
                yield n + SC_SUFFIX, TensorData(lambda n=n: np.asarray(q[n].scales_raw, dtype=np.float32))
    quant = dict(q.index["quantization"])
    quant["tensors"] = sorted(quantized)
    return items(), quant


def write_case_bundle(out: str | Path, *, model: dict[str, Any], decoding: dict[str, Any], precision: str,
                      fp32_dir: str | Path, int4_dir: str | Path | None, golden_path: str | Path) -> dict:
    """Write results/bundles/{model}-{precision}.kdtr and its sha256 record; return its metadata."""
    try:
        golden_sha256 = verify_kdtr(golden_path)
    except IntegrityError as err:
        raise IntegrityError(f"refusing to build {out} from a damaged golden: {err}; rebuild the golden "
                             f"(delete {golden_path} and rerun)") from None
    weights, quant = _weight_tensors(precision, fp32_dir, int4_dir)
    golden = open_bundle(golden_path)
    if golden.metadata.get("precision") != precision or golden.metadata.get("model") != model["name"]:
        raise ValueError(f"{golden_path} is the golden of {golden.metadata.get('model')}/"
                         f"{golden.metadata.get('precision')}, not {model['name']}/{precision}")
    golden_items = ((n, _lazy(golden, n)) for n in golden.keys())
    metadata = {
        "kind": "k2vec-bundle",
        "generator": {"package": "k2vec", "version": __version__},
        "docs": ["docs/kdtr-format.md", "docs/bundle-contents.md", "docs/golden-format.md",
                 "docs/int4-format.md", "docs/ddtree.md"],
        "model": model,
        "hf_config": hf_config(model),
        "precision": precision,
        "quantization": quant,
        "decoding": decoding,
        "golden": golden.metadata,
        "golden_sha256": golden_sha256,
    }

    def all_items() -> Iterator[tuple[str, Any]]:
        yield from weights
        yield from golden_items
    write_bundle(out, all_items(), metadata)
    write_record(out)
    return metadata
