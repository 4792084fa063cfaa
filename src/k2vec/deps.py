"""Which package source files a pipeline stage runs, for honest Snakemake caching.

Snakemake tracks a rule's `script:` but not the modules that script imports. Each rule therefore
declares, as inputs, the package files reachable by import from the modules it calls; this module
finds them by reading the import statements (no import is executed), so the lists never go stale.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

PACKAGE = "k2vec"
PACKAGE_DIR = Path(__file__).resolve().parent


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Package modules imported by the file at `path` (absolute and relative imports)."""
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            # `from pkg import submodule` imports a module, not only a name
            found.update(f"{base}.{a.name}" for a in node.names)
    # importing a.b.c runs a/__init__ and a/b/__init__ too
    closed = set()
    for name in found:
        parts = name.split(".")
        closed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in closed if _module_file(m) is not None}


@lru_cache(maxsize=None)
def module_sources(*modules: str) -> tuple[str, ...]:
    """Sorted paths of every package file that importing `modules` executes."""
    todo = [PACKAGE, *modules]
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            raise ValueError(f"{name} is not a module of the {PACKAGE} package")
        seen[name] = path
        todo.extend(_imports(path) - seen.keys())
    return tuple(sorted(str(p) for p in seen.values()))
