"""KDTR: the single-file test-vector bundle (docs/kdtr-format.md).

    from k2vec.kdtr import write_bundle, open_bundle, bf16, int4
    write_bundle("x.kdtr", [("w", lambda: np.ones((4, 4), np.float32)), ("q", int4(packed))], {"model": ...})
    with open_bundle("x.kdtr", verify=True) as b:
        b.metadata, b.tensors, b["w"]          # b["w"] is a read-only view into the mmap
"""

from k2vec.kdtr.format import (
    DEFAULT_ALIGNMENT,
    DTYPE_CODES,
    VERSION,
    KdtrError,
    TensorInfo,
    bf16_to_f32,
    f32_to_bf16,
)
from k2vec.kdtr.reader import Bundle, open_bundle, open_bundle_buffer
from k2vec.kdtr.writer import TensorData, bf16, int4, write_bundle

__all__ = [
    "DEFAULT_ALIGNMENT", "DTYPE_CODES", "VERSION", "KdtrError", "TensorInfo", "bf16_to_f32",
    "f32_to_bf16", "Bundle", "open_bundle", "open_bundle_buffer", "TensorData", "bf16", "int4",
    "write_bundle",
]
