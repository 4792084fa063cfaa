"""Resolved case files: canonical JSON (sorted keys, fixed float format) written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from k2vec.atomic import write_text_atomic

SECTIONS = ("model", "quantization", "prompts", "decoding")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_json(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, canonical_json(obj))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def merge_sections(section_paths: Iterable[str | Path], out: str | Path) -> dict[str, Any]:
    """The full case from its section files (named <section>.json), checked to be complete."""
    case = {Path(p).stem: read_json(p) for p in section_paths}
    missing = set(SECTIONS) - set(case)
    if missing:
        raise ValueError(f"case sections missing: {sorted(missing)}")
    write_json(out, case)
    return case
