"""`kdtr dump`: a bundle's metadata as JSON, or one tensor's values as JSON or .npy.

Values come out as the reader's arrays decoded: bf16 widened to float32 (exact), every other dtype
as stored. A packed tensor (int4) prints its stored u8 bytes, with a note on stderr. Tensor CRCs are
not checked here (`kdtr verify` does that), as `list` does not check them either.
"""

from __future__ import annotations

import difflib
import json
import re
import sys

import numpy as np

from k2vec.errors import K2VecError
from k2vec.kdtr.format import bf16_to_f32
from k2vec.kdtr.reader import Bundle, open_bundle

_INDEX = re.compile(r"\s*([+-]?\d{1,19})?\s*")  # 19 digits: past that no int64 index means anything


class DumpError(K2VecError):
    """A dump request the bundle cannot answer (unknown tensor, bad --slice): names the file and tensor."""


def add_parser(sub) -> None:
    s = sub.add_parser("dump", help="print the metadata as JSON, or one tensor's values")
    s.add_argument("file")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--meta", action="store_true", help="the metadata, as JSON")
    what.add_argument("--tensor", metavar="NAME", help="this tensor's values (bf16 printed as float32)")
    s.add_argument("--slice", metavar="SPEC", help="numpy-style index of the tensor, e.g. '0:4,:8' or '3'")
    s.add_argument("--format", choices=("json", "npy"), default="json",
                   help="json: nested lists, floats that round-trip (default); npy: a .npy file")
    s.add_argument("-o", "--output", metavar="PATH", help="write here instead of stdout")


def parse_slice(spec: str) -> tuple:
    """numpy index text (`0:4,:8`, `3`, `-1`, `::2`, `...`) -> an index tuple, parsed without eval.
    Raises ValueError; bounds are numpy's to check, against the tensor."""
    index: list = []
    for part in spec.split(","):
        if part.strip() == "...":
            index.append(Ellipsis)
            continue
        fields = part.split(":")
        if len(fields) > 3:
            raise ValueError(f"{part!r} has more than two ':'")
        matches = [_INDEX.fullmatch(f) for f in fields]
        if not all(matches):
            raise ValueError(f"{part!r} is not an integer (up to 19 digits) or a start:stop:step slice")
        nums = [int(m.group(1)) if m.group(1) else None for m in matches]
        if len(nums) == 1:
            if nums[0] is None:
                raise ValueError("an empty index (write ':' for a whole dimension)")
            index.append(nums[0])
        else:
            index.append(slice(*nums))
    return tuple(index)


def tensor_values(b: Bundle, name: str, spec: str | None = None) -> np.ndarray:
    """The tensor `name` of `b` (or its `spec` slice), decoded: bf16 as float32, others as stored."""
    if name not in b:
        lowered = {n.lower(): n for n in b}  # so that `W` finds `w`
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=3)]
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f" (`kdtr list {b.source}` lists them)"
        raise DumpError(f"{b.source}: no tensor {name!r} among its {len(b)}{hint}")
    t = b.info(name)
    view = b[name]
    if spec is not None:
        where = f"{b.source}: --slice {spec!r} of tensor {name!r} (shape [{','.join(map(str, t.shape))}])"
        try:
            view = view[parse_slice(spec)]
        except (ValueError, IndexError, OverflowError) as e:
            raise DumpError(f"{where}: {e}") from None
    values = np.asarray(view)  # an integer index gives a numpy scalar
    return bf16_to_f32(values) if t.dtype == "bf16" else values  # decoded after slicing: no whole copy


def write_json(values: np.ndarray, out) -> None:
    """Nested lists, one outermost row a line. tolist() gives Python ints and floats (float of a float32
    is exact) and json writes a float's shortest repr, so parsing gives back the same values; NaN and
    infinities print as NaN, Infinity, -Infinity, which Python's json reads but strict JSON does not."""
    if values.ndim < 2:
        out.write(json.dumps(values.tolist()) + "\n")
        return
    out.write("[")
    for i, row in enumerate(values):  # one row at a time: the text of a large tensor is never all in memory
        out.write(("," if i else "") + "\n " + json.dumps(row.tolist()))
    out.write("\n]\n")


def _write_npy(values: np.ndarray, path: str | None, out, source: str) -> None:
    if path:
        with open(path, "wb") as fh:  # a file object: np.save given a name would append ".npy" to it
            np.save(fh, values, allow_pickle=False)
        return
    if out.isatty():
        raise DumpError(f"{source}: not writing .npy bytes to a terminal; give -o PATH or redirect stdout")
    out.flush()
    np.save(out.buffer, values, allow_pickle=False)
    out.buffer.flush()


def cmd_dump(args, out) -> int:
    if args.meta and (args.slice is not None or args.format != "json"):
        raise DumpError(f"{args.file}: --slice and --format npy go with --tensor NAME, not --meta")
    with open_bundle(args.file) as b:
        if args.meta:
            text = json.dumps(b.metadata, indent=2, ensure_ascii=False) + "\n"
            if args.output:
                with open(args.output, "w", encoding="utf-8") as fh:
                    fh.write(text)
            else:
                out.write(text)
            return 0
        values = tensor_values(b, args.tensor, args.slice)
        t = b.info(args.tensor)
        if t.packing:  # int4, the one packing: two codes a byte (docs/int4-format.md)
            print(f"note: {t.name} is {t.packing}-packed: these are its stored {t.dtype} bytes, two 4-bit "
                  f"codes each (docs/int4-format.md), not the decoded values", file=sys.stderr)
        if args.format == "npy":
            _write_npy(values, args.output, out, args.file)
        elif args.output:
            with open(args.output, "w", encoding="utf-8") as fh:
                write_json(values, fh)
        else:
            write_json(values, out)
    return 0
