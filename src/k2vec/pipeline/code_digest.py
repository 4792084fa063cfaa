"""Which package source files a pipeline stage runs, and a digest of what that code means.

Snakemake tracks a rule's `script:` (by mtime) but not the modules that script imports. Each rule
therefore declares the package files reachable by import from the modules it calls; this module finds
them by reading the import statements (no import is executed), so the lists never go stale.

A module's code also covers the files it reads beside itself by name (`Path(__file__).with_name("w4a16_cuda.cu")`:
a kernel source compiled at run time, a schema checked against), so an edit of one reruns what runs the module.

Rules declare that code by `code_digest`, a `params:` value: a hash of each file's syntax tree without
comments, formatting or docstrings. An edit that changes none of those reruns nothing; any other edit
changes the digest of exactly the stages that execute the file (Snakemake's params trigger).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable

PACKAGE = "k2vec"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/k2vec: this module is k2vec.pipeline.code_digest


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


def _imported_names(path: Path, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        this = _module_name(path)
        package = this if path.name == "__init__.py" else this.rpartition(".")[0]
        base_parts = package.split(".")
        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    # `from pkg import submodule` imports a module, not only a name
    return {base, *(f"{base}.{a.name}" for a in node.names)}


def _package_modules(names: set[str]) -> set[str]:
    # importing a.b.c runs a/__init__ and a/b/__init__ too
    closed = set()
    for name in names:
        parts = name.split(".")
        closed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in closed if _module_file(m) is not None}


@lru_cache(maxsize=None)
def _parse(path: str, mtime_ns: int, size: int) -> tuple[bytes, ast.Module | None]:
    """A file's bytes and syntax tree (None if it is not Python), parsed once per version of the file:
    the workflow asks for the same files for every rule and job."""
    data = Path(path).read_bytes()
    try:
        return data, ast.parse(data, path)
    except (SyntaxError, ValueError):
        return data, None


def _parsed(path: str | Path) -> tuple[bytes, ast.Module | None]:
    st = os.stat(path)
    return _parse(str(path), st.st_mtime_ns, st.st_size)


# Per-file results kept across starts by DigestCache (abspath -> {"state", "imports", "meaning"}), so that after an
# edit only the edited files are parsed again; read while a file's state (_file_state) is the one recorded.
_FILE_MEMO: dict[str, dict] = {}
_FILE_MEMO_CHANGED = [False]   # set when a result is added: DigestCache.save writes the memo then


def _memo(path: str | Path, field: str, make: Callable[[], object]):
    """`make()` for the file at `path`, or the value _FILE_MEMO holds for its current state."""
    key, state = os.path.abspath(path), _file_state(str(path))
    entry = _FILE_MEMO.get(key)
    if not (isinstance(entry, dict) and entry.get("state") == state):
        entry = _FILE_MEMO[key] = {"state": state}
    if field not in entry:
        entry[field] = make()
        _FILE_MEMO_CHANGED[0] = True
    return entry[field]


@lru_cache(maxsize=None)
def _imports(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """Package modules imported by the file at `path`: (at import time, only inside function bodies)."""
    eager, deferred = _memo(path, "imports", lambda: [sorted(m) for m in _read_imports(path)])
    return frozenset(eager), frozenset(deferred)


def _read_imports(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    tree = _parsed(path)[1]
    if tree is None:
        tree = ast.parse(path.read_text(), str(path))   # raises the SyntaxError, naming the file
    eager: set[str] = set()
    deferred: set[str] = set()
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, in_function = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (deferred if in_function else eager).update(_imported_names(path, node))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        todo.extend((child, inside) for child in ast.iter_child_nodes(node))
    eager_modules = _package_modules(eager)
    return frozenset(eager_modules), frozenset(_package_modules(deferred) - eager_modules)


def _data_files(path: Path) -> list[str]:
    """The files beside the module at `path` that it names (see _read_data_names) and that exist."""
    names = _memo(path, "data", lambda: _read_data_names(path))
    return [str(path.with_name(n)) for n in names if path.with_name(n).is_file()]


def _is_module_file(node: ast.AST) -> bool:
    """`Path(__file__)`."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__file__")


def _read_data_names(path: Path) -> list[str]:
    """Files the module reads beside itself, named as `Path(__file__).with_name("name")` or
    `Path(__file__).parent / "name"`."""
    tree = _parsed(path)[1]
    names = set()
    for node in ast.walk(tree) if tree is not None else ():
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "with_name"
                and _is_module_file(node.func.value) and len(node.args) == 1):
            name = node.args[0]
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Attribute)
              and node.left.attr == "parent" and _is_module_file(node.left.value)):
            name = node.right
        else:
            continue
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            names.add(name.value)
    return sorted(names)


@lru_cache(maxsize=None)
def module_sources(*modules: str, without: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Sorted paths of every package file that importing `modules` executes, and of the files those modules read
    beside themselves by name (a kernel's CUDA source, a schema).

    `without`: modules the caller's code path never imports, such as the INT4 modules on the fp32 side.
    They must be imported only inside functions (deferred), never when a module loads; a module-level
    import of one is an error, since the stage would then execute it.
    """
    todo = sorted(_package_modules({PACKAGE, *modules}))   # a module's packages run first
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            raise ValueError(f"{name} is not a module of the {PACKAGE} package")
        seen[name] = path
        eager, deferred = _imports(path)
        loaded = sorted(m for m in eager if _excluded(m, without))
        if loaded:
            raise ValueError(f"{path} imports {', '.join(loaded)} at module level, so every stage that runs "
                             f"{name} executes it: import it inside the function that needs it")
        todo.extend(m for m in (eager | deferred) - seen.keys() if not _excluded(m, without))
    data = {f for p in seen.values() for f in _data_files(p)}
    return tuple(sorted({str(p) for p in seen.values()} | data))


def with_imports(paths: list[str] | tuple[str, ...]) -> list[str]:
    """`paths` and, for each that is a module of the package, what importing it executes or reads
    (module_sources): an engine's declared Python sources stand for all the package code they run."""
    modules = []
    for p in paths:
        path = Path(p).resolve()
        if path.suffix == ".py" and path.is_relative_to(PACKAGE_DIR):
            modules.append(_module_name(path))
    return sorted({os.path.abspath(p) for p in paths} | set(module_sources(*sorted(modules)) if modules else ()))


def script_modules(path: str | Path) -> tuple[str, ...]:
    """The package modules a workflow script imports (anywhere in it): what its rule's code digest starts
    from, so a stage's declared code follows the script and cannot name a module the script left."""
    eager, deferred = _imports(Path(path))
    return tuple(sorted(eager | deferred))


def _excluded(module: str, without: tuple[str, ...]) -> bool:
    return any(module == w or module.startswith(w + ".") for w in without)


def _meaning(path: str) -> bytes:
    st = os.stat(path)
    return _meaning_of(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=None)
def _meaning_of(path: str, mtime_ns: int, size: int) -> bytes:
    """The file's syntax tree without comments, layout and docstrings (kept where the file reads
    `__doc__`, say for its --help); the raw bytes of a file that is not Python."""
    data, tree = _parse(path, mtime_ns, size)
    if tree is None:
        return b"bytes:" + data
    if b"__doc__" not in data:
        # in place, once (this function is cached): _imports reads the same tree, and a docstring is no import
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    node.body = node.body[1:] or [ast.Pass()]
    return b"ast:" + ast.dump(tree).encode()


def code_digest(paths: list[str] | tuple[str, ...], root: str) -> str:
    """sha256 over each file's path relative to `root` (a moved or copied checkout has the same digest) and the
    sha256 of its meaning (see `_meaning`), which _FILE_MEMO keeps per file."""
    h = hashlib.sha256()
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        path = os.path.abspath(path)
        meaning = _memo(path, "meaning", lambda: hashlib.sha256(_meaning(path)).hexdigest())
        h.update(f"{Path(os.path.relpath(path, root)).as_posix()}\0{meaning}\0".encode())
    return "code-meaning-2:" + h.hexdigest()


def _file_state(path: str) -> list[int] | None:
    """What says a file is unchanged: its mtime, size, inode and ctime (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns]


class DigestCache:
    """Code digests kept across Snakemake starts, in a JSON file: each under a key (the stage and its modules),
    with the state of every file it covers, and reused only while none of those files changed (their
    mtime, size, inode and ctime). Reading the imports and syntax trees of every stage's modules takes about
    1.5 s per workflow start on a 2-core machine; checking the files' states, milliseconds. Beside them, per
    file, its imports and the sha256 of its meaning (_FILE_MEMO): after an edit, a digest that covers the
    edited file is made again from the other files' kept results, parsing the edited file alone. A cache that
    cannot be read, or of another format, is ignored (and rewritten)."""

    FORMAT = "k2vec-code-digests-3"   # 3: engines digest what their sources import and read

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict) and data.get("format") == self.FORMAT and isinstance(data.get("entries"), dict) \
                    and isinstance(data.get("files"), dict):
                self.entries = data["entries"]
                _FILE_MEMO.update(data["files"])
        except (OSError, ValueError):
            pass

    def digest(self, key: str, files: Callable[[], list[str] | tuple[str, ...]], root: str) -> str:
        """code_digest(files(), root), from the cache while every file it covered is as it was."""
        entry = self.entries.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("files"), list) and isinstance(entry.get("digest"), str) \
                and all(isinstance(f, list) and len(f) == 2 and _file_state(f[0]) == f[1] for f in entry["files"]):
            return entry["digest"]
        paths = [os.path.abspath(p) for p in files()]
        states = [[p, _file_state(p)] for p in paths]   # before reading: an edit meanwhile makes a miss next time
        value = code_digest(paths, root)
        self.entries[key] = {"files": states, "digest": value}
        self.dirty = True
        return value

    def save(self) -> None:
        """Write the cache if it changed (atomically: a half-written cache would only be ignored, but a reader
        must never see one)."""
        if not (self.dirty or _FILE_MEMO_CHANGED[0]):
            return
        from k2vec.atomic import write_text_atomic

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            files = {p: e for p, e in _FILE_MEMO.items() if e.get("state") is not None}
            write_text_atomic(self.path, json.dumps({"format": self.FORMAT, "entries": self.entries, "files": files}))
            self.dirty = _FILE_MEMO_CHANGED[0] = False
        except OSError:
            pass   # a cache: the next start recomputes
