"""Strict reading of config files: YAML syntax errors and duplicated keys, with file and line.

Snakemake's own loader keeps the last of two equal keys without a word and reports a syntax error
without its place, so the workflow reads each config file here first (workflow/rules/config.smk).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from k2vec.errors import K2VecError


class ConfigFileError(K2VecError):
    """A config file that is not valid YAML, or has a key twice in one mapping."""


def _place(path: Path, mark) -> str:
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}"


def check_config_file(path: str | Path) -> None:
    """Raise ConfigFileError at the first syntax error or duplicated key of the file at `path`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"{path}: cannot read the config file: {e}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
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


def check_config_files(paths) -> None:
    """check_config_file on each existing path (a missing one is Snakemake's to report)."""
    for p in paths:
        if Path(p).exists():
            check_config_file(p)


def defined_engines(paths) -> set[str]:
    """The engine names that the existing config files among `paths` define with settings (not null):
    the names an overlay's `engines: {name: null}` may disable."""
    names: set[str] = set()
    for p in paths:
        if Path(p).exists():
            doc = yaml.safe_load(Path(p).read_text(encoding="utf-8"))
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
