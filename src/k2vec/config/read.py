"""Strict reading of config files: YAML syntax errors and duplicated keys, with file and line; files
too large, and aliases that would expand past a size limit, refused before anything else reads them.

Snakemake's own loader keeps the last of two equal keys without a word and reports a syntax error
without its place, so the workflow reads each config file here first (workflow/rules/config.smk).
The loaded config is a tree in which an alias is the same object as its anchor, but the schema check
and every later walk visit it once per use: nine nested aliases of ten ("billion laughs", under 500
bytes) would make them walk 10^9 nodes, so the expanded size is counted here, over the node graph.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from k2vec.errors import K2VecError


class ConfigFileError(K2VecError):
    """A config file that is not valid YAML, has a key twice in one mapping, or is too large."""


# The shipped config.yaml is about 8 KiB and expands to about 300 nodes; a config a hundred times its size
# still fits both limits, while a 50 MB file took minutes to parse and validate.
MAX_CONFIG_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000


class _AliasComposer(yaml.SafeLoader):
    """The safe loader's composer, recording each alias (its mark and the node it stands for)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases: list[tuple[yaml.Mark, yaml.Node]] = []

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            self.aliases.append((mark, node))
            return node
        return super().compose_node(parent, index)


def _place(path: Path, mark) -> str:
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}"


def check_config_file(path: str | Path) -> None:
    """Raise ConfigFileError at the first syntax error or duplicated key of the file at `path`."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"{path}: the config file is larger than the limit of {MAX_CONFIG_BYTES:,} bytes "
                                  f"(k2vec.config.read.MAX_CONFIG_BYTES); a config is settings, not data")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{path}: cannot read the config file: {e}") from None
    loader = _AliasComposer(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = e.problem or e.context or "invalid YAML"
        if e.context and e.context_mark and e.problem_mark:
            what += f" ({e.context} started at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        if "'\\t'" in what:
            what += "; YAML indents with spaces, not tabs"
        raise ConfigFileError(f"{_place(path, mark) if mark else path}: YAML syntax error: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{path}: YAML error: {e}") from None
    finally:
        loader.dispose()
    if root is not None:
        _check_expansion(path, root, loader.aliases)
    # Walk the node graph (not the loaded dict, which has already dropped the first of two keys).
    stack = [(root, "")] if root is not None else []
    seen: set[int] = set()  # an alias repeats a node: walk it once (no exponential "billion laughs")
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first_seen: dict[tuple[str, str], yaml.Node] = {}
            for key_node, value_node in node.value:
                ident = (key_node.tag, str(key_node.value))
                dotted = f"{prefix}{key_node.value}"
                if ident in first_seen:
                    first = first_seen[ident].start_mark.line + 1
                    raise ConfigFileError(
                        f"{_place(path, key_node.start_mark)}: duplicate key '{dotted}' (first at line "
                        f"{first}); YAML would silently keep only the last one: remove or merge one of them")
                first_seen[ident] = key_node
                stack.append((value_node, dotted + "."))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{prefix[:-1]}[{i}].") for i, item in enumerate(node.value))


def _expanded_sizes(root: yaml.Node) -> dict[int, int]:
    """id(node) -> the number of nodes of its subtree with every alias expanded (mapping keys included),
    each node counted once (memoised: linear in the graph, whatever the expansion). A node that contains
    itself through an alias (a recursive anchor) gets size -1: its expansion never ends."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            on_path.discard(id(node))
            kids = _children(node)
            sizes[id(node)] = -1 if any(sizes[id(k)] < 0 for k in kids) else 1 + sum(sizes[id(k)] for k in kids)
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:  # reached again below itself
            sizes[id(node)] = -1
            continue
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in sizes)
    return sizes


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(path: Path, root: yaml.Node, aliases: list[tuple[yaml.Mark, yaml.Node]]) -> None:
    """ConfigFileError naming the alias at fault (the first, in the file, of those that expand most)
    where the document expands past MAX_EXPANDED_NODES nodes, or an alias that contains itself."""
    sizes = _expanded_sizes(root)
    total = sizes[id(root)]
    if 0 <= total <= MAX_EXPANDED_NODES:
        return
    recursive = [(m, n) for m, n in aliases if sizes[id(n)] < 0]
    if total < 0 and recursive:
        mark, _ = recursive[0]
        raise ConfigFileError(f"{_place(path, mark)}: this alias stands for a node that contains it; its "
                              f"expansion never ends: a config holds no recursive anchors")
    if not aliases:
        raise ConfigFileError(f"{path}: the document has {total:,} nodes, more than the limit of "
                              f"{MAX_EXPANDED_NODES:,} (k2vec.config.read.MAX_EXPANDED_NODES)")
    mark, node = max(aliases, key=lambda a: sizes[id(a[1])])
    raise ConfigFileError(
        f"{_place(path, mark)}: this alias expands to {sizes[id(node)]:,} nodes, and the whole document to "
        f"{total:,}, more than the limit of {MAX_EXPANDED_NODES:,} (k2vec.config.read.MAX_EXPANDED_NODES): every "
        f"alias is a copy of its anchor's subtree; nested aliases multiply (\"billion laughs\")")


def defined_engines(paths) -> set[str]:
    """The engine names that the existing config files among `paths` define with settings (not null):
    the names an overlay's `engines: {name: null}` may disable. Read with libyaml where PyYAML has it: the
    files passed the strict read (check_config_file) before."""
    names: set[str] = set()
    for p in paths:
        if Path(p).exists():
            doc = yaml.load(Path(p).read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            engines = doc.get("engines") if isinstance(doc, dict) else None
            if isinstance(engines, dict):  # anything else is the schema's to refuse
                names.update(n for n, e in engines.items() if isinstance(e, dict))
    return names


def main(argv: list[str] | None = None) -> int:
    """`python -m k2vec.config.read FILE...`: for files given with --configfile, whose syntax errors
    Snakemake's command line reports before the workflow is read, without file or line."""
    import sys

    paths = sys.argv[1:] if argv is None else argv
    try:
        for p in paths:
            check_config_file(p)
    except ConfigFileError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
