"""`python -m k2vec.kdtr {list,inspect,verify,diff,dump}` (dump: k2vec.kdtr.dump).

Exit status: 0 fine (diff: identical); 1 a bad bundle, one its sha256 record disowns, or an unreadable
file (diff: a difference); 2 a usage error (dump: an unknown tensor or a bad --slice; verify: a `.sha256`
record given in place of its bundle) or, for diff, a bad bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterator

import numpy as np

from k2vec.digests import SUFFIX, IntegrityError, check_record, record_path
from k2vec.kdtr.dump import DumpError, add_parser, cmd_dump
from k2vec.kdtr.format import FLOAT_DTYPES, KdtrError, bf16_to_f32
from k2vec.kdtr.reader import Bundle, open_bundle

# The table's first line (docs/kdtr-format.md §9; kdtr_tool prints it too). Here, not in format.py: every
# stage imports format.py, and a change there reruns them all (k2vec.pipeline.code_digest).
TABLE_HEADER = "# name dtype shape offset nbytes crc32"
_CHUNK = 1 << 20  # elements compared at a time: diff of two 1 GiB tensors stays in a few MiB


def _print_table(b: Bundle, out) -> None:
    print(TABLE_HEADER, file=out)
    for line in b.lines():
        print(line, file=out)


def _summary(value, width: int = 70) -> str:
    if isinstance(value, dict):
        keys = ", ".join(list(value)[:8]) + (", ..." if len(value) > 8 else "")
        return f"object, {len(value)} keys: {keys}"
    if isinstance(value, list):
        return f"array, {len(value)} items"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


def cmd_list(args, out) -> int:
    with open_bundle(args.file) as b:
        _print_table(b, out)
    return 0


def cmd_inspect(args, out) -> int:
    with open_bundle(args.file) as b:
        if args.table:
            _print_table(b, out)
            return 0
        data = sum(t.nbytes for t in b.tensors)
        print(f"{args.file}: KDTR v{b.version}, {b.file_size} bytes, alignment {b.alignment}, "
              f"{len(b)} tensors, {data} data bytes", file=out)
        _print_table(b, out)
        print("metadata:", file=out)
        for key, value in b.metadata.items():
            print(f"  {key}: {_summary(value)}", file=out)
    return 0


def cmd_verify(args, out) -> int:
    status = 0
    for path in args.files:
        if path.endswith(SUFFIX):
            # Refused, not followed: a glob such as `bundles/*` names both files and would check each bundle twice.
            print(f"{path}: this is a sha256 record; verify the bundle it describes: {path[: -len(SUFFIX)]}",
                  file=sys.stderr)
            status = 2
            continue
        try:
            with open_bundle(path) as b:
                n = b.verify(workers=args.workers)
            if record_path(path).exists():
                check_record(path)
                record = f"sha256 record {record_path(path).name} OK"
            else:
                record = f"no {SUFFIX} record beside it"
            print(f"{path}: OK, {len(b)} tensors, {n} data bytes (crc32 of {len(b)} tensors, {record})", file=out)
        except (KdtrError, IntegrityError, OSError) as e:
            print(f"{path}: FAILED: {e}", file=sys.stderr)
            status = max(status, 1)
    return status


def _flatten(value, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(path, leaf) pairs; a path holds dict keys as str and list indices as int, so that sorting
    paths puts `prompts.2` before `prompts.10`."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _flatten(v, path + (k,))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _flatten(v, path + (i,))
    else:
        yield path, value


def _path_order(path: tuple) -> tuple:
    # An index and a key meet at one position only when A has a list where B has an object: indices first.
    return tuple((isinstance(p, str), p) for p in path)


def _chunks(x: np.ndarray, dtype: str) -> Iterator[np.ndarray]:
    flat = x.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        c = flat[i: i + _CHUNK]
        if dtype == "bf16":
            c = bf16_to_f32(c)
        yield c.astype(np.float64) if dtype != "f64" else c


def tensor_diff(a: np.ndarray, b: np.ndarray, dtype: str) -> str | None:
    """One-line description of how two same-shape, same-dtype tensors differ, or None if equal."""
    ua, ub = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    nbytes = sum(int(np.count_nonzero(ua[i: i + _CHUNK] != ub[i: i + _CHUNK])) for i in range(0, ua.size, _CHUNK))
    if nbytes == 0:
        return None
    n = a.size
    if dtype in FLOAT_DTYPES:
        ndiff = nonfinite = 0
        max_abs = max_rel = 0.0
        for ca, cb in zip(_chunks(a, dtype), _chunks(b, dtype)):
            both_nan = np.isnan(ca) & np.isnan(cb)
            differ = (ca != cb) & ~both_nan
            ndiff += int(differ.sum())
            finite = np.isfinite(ca) & np.isfinite(cb)
            nonfinite += int((differ & ~finite).sum())
            fa, fb = ca[differ & finite], cb[differ & finite]
            if fa.size:
                d = np.abs(fa - fb)
                max_abs = max(max_abs, float(d.max()))
                max_rel = max(max_rel, float((d / np.maximum(np.abs(fa), np.abs(fb))).max()))
        if ndiff == 0:  # only the bits differ: +0.0 vs -0.0 or NaN payloads
            return f"0/{n} elements differ in value (bit patterns differ: signed zeros or NaN payloads)"
        extra = f", {nonfinite} inf/nan mismatches" if nonfinite else ""
        return f"{ndiff}/{n} elements differ, max_abs {max_abs:.6g}, max_rel {max_rel:.6g}{extra}"
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    nel = sum(int(np.count_nonzero(flat_a[i: i + _CHUNK] != flat_b[i: i + _CHUNK])) for i in range(0, n, _CHUNK))
    return f"{nel}/{n} elements differ, {nbytes}/{ua.size} bytes differ"


def _kind(t) -> str:
    dt = f"{t.dtype}:{t.packing}" if t.packing else t.dtype
    return f"{dt} [{','.join(map(str, t.shape))}]"


def cmd_diff(args, out) -> int:
    try:
        a, b = open_bundle(args.a), open_bundle(args.b)
    except KdtrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ndiff = 0
    with a, b:
        names = sorted(set(a) | set(b), key=lambda s: s.encode())
        for name in names:
            if name not in b:
                print(f"- {name}: only in A ({_kind(a.info(name))})", file=out)
            elif name not in a:
                print(f"+ {name}: only in B ({_kind(b.info(name))})", file=out)
            elif _kind(a.info(name)) != _kind(b.info(name)):
                print(f"~ {name}: {_kind(a.info(name))} vs {_kind(b.info(name))}", file=out)
            else:
                what = tensor_diff(a[name], b[name], a.info(name).dtype)
                if what is None:
                    if args.all:
                        print(f"= {name}: identical", file=out)
                    continue
                print(f"~ {name} {_kind(a.info(name))}: {what}", file=out)
            ndiff += 1
        ma, mb = dict(_flatten(a.metadata)), dict(_flatten(b.metadata))
        mdiff = 0
        for path in sorted(set(ma) | set(mb), key=_path_order):
            key = ".".join(map(str, path))
            if path not in mb:
                print(f"- metadata {key}: only in A ({_summary(ma[path], 50)})", file=out)
            elif path not in ma:
                print(f"+ metadata {key}: only in B ({_summary(mb[path], 50)})", file=out)
            elif json.dumps(ma[path]) != json.dumps(mb[path]):
                print(f"~ metadata {key}: {_summary(ma[path], 50)} vs {_summary(mb[path], 50)}", file=out)
            else:
                continue
            mdiff += 1
        print(f"{ndiff} tensor differences, {mdiff} metadata differences", file=out)
    return 1 if ndiff or mdiff else 0


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    p = argparse.ArgumentParser(prog="python -m k2vec.kdtr", description="Inspect KDTR bundles.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list", help="canonical tensor table (same bytes as `kdtr_tool list`)")
    s.add_argument("file")
    s = sub.add_parser("inspect", help="header summary, tensor table and metadata summary")
    s.add_argument("file")
    s.add_argument("--table", action="store_true", help="print only the canonical table")
    s = sub.add_parser("verify", help="check structure, every checksum and the .sha256 record beside the file")
    s.add_argument("files", nargs="+")
    s.add_argument("--workers", type=int, default=1, help="checksum threads (default 1)")
    s = sub.add_parser("diff", help="per-tensor and metadata differences of bundle A vs B")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--all", action="store_true", help="also list identical tensors")
    add_parser(sub)
    args = p.parse_args(argv)
    commands = {"list": cmd_list, "inspect": cmd_inspect, "verify": cmd_verify, "diff": cmd_diff, "dump": cmd_dump}
    records = [f for f in (getattr(args, k, None) for k in ("file", "a", "b")) if f and f.endswith(SUFFIX)]
    if records:   # verify says so file by file; the others read one bundle each and stop here
        print(f"error: {records[0]} is a sha256 record, not a bundle: give the bundle it describes, "
              f"{records[0][: -len(SUFFIX)]}", file=sys.stderr)
        return 2
    try:
        return commands[args.cmd](args, out)
    except BrokenPipeError:
        # The reader went away (`kdtr list FILE | head`): end quietly, as cat and ls do. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except DumpError as e:  # the request is at fault, not the bundle
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KdtrError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
