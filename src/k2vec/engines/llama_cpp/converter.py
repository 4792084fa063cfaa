"""llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`), taken from the source the installed
llama-cpp-python was built from.

llama-cpp-python's wheel ships the library and its bindings only: the converter, its `conversion/` package
and the `gguf-py/` it is written against live in the source distribution (`vendor/llama.cpp/`, the llama.cpp
commit the library is built from). `install` copies those three out of the sdist of the installed version
(given, or fetched with `pip download`) into `<venv>/share/k2vec/llama.cpp-convert-<version>/`, with a
manifest naming the version, the llama.cpp commit and the sdist's sha256; the engine finds it there (or
where K2VEC_LLAMA_CONVERTER points). Nothing of it is copied into this repository.

    python -m k2vec.engines.llama_cpp.converter install [--sdist llama_cpp_python-X.tar.gz] [--into DIR]
    python -m k2vec.engines.llama_cpp.converter where
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from k2vec.atomic import atomic_directory
from k2vec.errors import K2VecError

DISTRIBUTION = "llama_cpp_python"
TREE_ENV = "K2VEC_LLAMA_CONVERTER"   # a directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/
SCRIPT = "convert_hf_to_gguf.py"
MEMBERS = (SCRIPT, "conversion", "gguf-py")   # what the script imports, relative to vendor/llama.cpp/
MANIFEST = "k2vec-converter.json"


class ConverterError(K2VecError):
    """llama.cpp's converter is missing, or its source does not match the installed llama-cpp-python."""


def installed_version() -> str:
    """The installed llama-cpp-python's version (its distribution metadata: no import of the library)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ConverterError("llama-cpp-python is not installed (pip install -e '.[llamacpp]')") from None


def default_tree(version: str | None = None) -> Path:
    """Where `install` puts the converter of this interpreter's llama-cpp-python."""
    return Path(sys.prefix) / "share" / "k2vec" / f"llama.cpp-convert-{version or installed_version()}"


def find_tree() -> tuple[Path, dict]:
    """(converter directory, its manifest): K2VEC_LLAMA_CONVERTER, else the default place. The manifest's
    version must be the installed llama-cpp-python's: a converter of another commit may map tensors or
    hyperparameters differently from what the library reads."""
    tree = Path(os.environ[TREE_ENV]) if os.environ.get(TREE_ENV) else default_tree()
    if not (tree / SCRIPT).is_file():
        raise ConverterError(
            f"llama.cpp's converter is not at {tree / SCRIPT}: llama-cpp-python's wheel does not ship it; "
            f"run `python -m k2vec.engines.llama_cpp.converter install` with the pipeline's interpreter "
            f"(docs/llama-cpp.md)")
    try:
        manifest = json.loads((tree / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ConverterError(f"{tree / MANIFEST}: unreadable converter manifest ({err}); rerun `install`") from None
    if manifest.get("llama_cpp_python") != installed_version():
        raise ConverterError(f"{tree / MANIFEST}: the converter comes from llama-cpp-python "
                             f"{manifest.get('llama_cpp_python')}, the installed library is {installed_version()}; "
                             f"rerun `install`")
    return tree, manifest


def _sdist_version(tar: tarfile.TarFile, top: str, path: Path) -> str:
    """The `__version__` line of the sdist's llama_cpp/__init__.py."""
    member = tar.extractfile(f"{top}/llama_cpp/__init__.py")
    for line in (member.read().decode() if member else "").splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ConverterError(f"{path}: llama_cpp/__init__.py states no __version__")


def extract(sdist: Path, into: Path, version: str) -> dict:
    """Unpack the converter of `sdist` (llama-cpp-python's source distribution of `version`) into `into`,
    atomically; returns the manifest written beside it."""
    digest = hashlib.sha256()
    with open(sdist, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        found = _sdist_version(tar, top, sdist)
        if found != version:
            raise ConverterError(f"{sdist} is llama-cpp-python {found}, the installed library is {version}")
        base = f"{top}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(base)
                   and m.name[len(base):].split("/", 1)[0] in MEMBERS and "__pycache__" not in m.name]
        if not any(m.name == base + SCRIPT for m in members):
            raise ConverterError(f"{sdist} holds no vendor/llama.cpp/{SCRIPT}")
        head = f"{top}/.git/modules/vendor/llama.cpp/HEAD"   # the vendored llama.cpp commit, where the sdist says
        commit = tar.extractfile(head).read().decode().strip() if head in tar.getnames() else None
        with atomic_directory(into) as tmp:
            for m in members:
                m.name = m.name[len(base):]
            # the "data" filter (no links out, no devices, no absolute names) where this Python has it (3.11.4+)
            tar.extractall(tmp, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            manifest = {"llama_cpp_python": version, "llama_cpp_commit": commit, "sdist": sdist.name,
                        "sdist_sha256": digest.hexdigest(), "members": list(MEMBERS)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def install(sdist: Path | None = None, into: Path | None = None) -> Path:
    """Extract the converter of the installed llama-cpp-python from `sdist`, or from its sdist fetched from
    the package index with pip (the same file pip builds the library from)."""
    version = installed_version()
    into = into or default_tree(version)
    if sdist is not None:
        extract(sdist, into, version)
        return into
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--dest", tmp, f"llama-cpp-python=={version}"], check=True)
        found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if len(found) != 1:
            raise ConverterError(f"pip download left {[p.name for p in Path(tmp).iterdir()]}, not one sdist")
        extract(found[0], into, version)
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="put the installed llama-cpp-python's converter where the engine finds it")
    inst.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (default: pip download it)")
    inst.add_argument("--into", type=Path, help=f"target directory (default: {default_tree('VERSION')})")
    sub.add_parser("where", help="print the converter directory the engine would use, or why there is none")
    args = ap.parse_args(argv)
    try:
        if args.command == "install":
            print(install(args.sdist, args.into))
        else:
            tree, manifest = find_tree()
            print(f"{tree}  (llama-cpp-python {manifest['llama_cpp_python']}, "
                  f"llama.cpp {manifest.get('llama_cpp_commit')})")
    except ConverterError as err:
        print(f"k2vec.engines.llama_cpp.converter: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
