"""docs/architecture.md's import rules, read from the document and checked against every import of src/k2vec
(function-level imports included): no import from a higher floor, no circle, the named exceptions."""
import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

SRC = REPO / "src"
DOC = REPO / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every k2vec module `path` imports, anywhere in it (`from a.b import c` counts a.b.c when that is a module)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m in MODULES}


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def table(heading: str) -> list[list[str]]:
    """The rows of the first table under `heading` in docs/architecture.md, cells stripped of backticks."""
    text = DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in text.split("\n\n") if b.strip().startswith("|"))
    rows = [line for line in block.strip().splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def names(cell: str) -> list[str]:
    return re.findall(r"`([\w.]+)`", cell)


FLOORS = {pkg: int(row[0]) for row in table("The floors") for pkg in names(row[1])}
EXCEPTIONS = []
for row in table("Rules beyond the floors"):
    importer, forbidden = names(row[0])[0], row[1]
    banned, _, allowed = forbidden.partition(" but ")
    EXCEPTIONS.append((importer, names(banned), names(allowed)))


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def floor_of(module: str) -> tuple[str, int]:
    owners = [p for p in FLOORS if under(module, p)]
    assert owners, f"{module}: on no floor of docs/architecture.md"
    owner = max(owners, key=len)
    return owner, FLOORS[owner]


GRAPH = {m: imports_of(p) - {m} for m, p in MODULES.items()}


def test_the_document_names_every_package_once_and_only_packages_that_exist():
    assert len(FLOORS) == sum(len(names(r[1])) for r in table("The floors"))
    assert set(FLOORS) <= set(MODULES), set(FLOORS) - set(MODULES)
    for m in MODULES:
        floor_of(m)


def test_no_import_from_a_higher_floor():
    wrong = []
    for m, deps in GRAPH.items():
        owner, floor = floor_of(m)
        for d in deps:
            d_owner, d_floor = floor_of(d)
            if d_floor > floor:
                wrong.append(f"{m} (floor {floor}) imports {d} (floor {d_floor})")
    assert not wrong, "\n".join(sorted(wrong))


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    # A package's __init__ that re-exports its modules is not a circle with them: only edges between
    # modules count, and a module's import of its own package's __init__ is dropped.
    graph = {m: {d for d in deps if not under(m, d)} for m, deps in GRAPH.items()}
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


@pytest.mark.parametrize("importer, banned, allowed", EXCEPTIONS, ids=[e[0] for e in EXCEPTIONS])
def test_rules_beyond_the_floors(importer, banned, allowed):
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if under(m, importer) for d in deps
             if any(under(d, b) for b in banned) and not any(under(d, a) for a in allowed)]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checks_catch_what_they_are_for():
    """The circle finder and the floor table on made-up graphs: a test that could not fail proves nothing."""
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert floor_of("k2vec.engines.contract.checks") == ("k2vec.engines.contract", 5)
    assert floor_of("k2vec.engines.runner")[1] > floor_of("k2vec.stages.golden")[1]
    assert ("k2vec.report", ["k2vec.engines"], ["k2vec.engines.contract", "k2vec.engines.gpus"]) in EXCEPTIONS
    assert "k2vec.engines.contract.modes" in GRAPH["k2vec.report.metrics"]   # imports are really read
