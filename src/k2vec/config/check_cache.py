"""The config checks of a workflow start, remembered across starts: the strict read of each config file
(k2vec.config.read) by the file's bytes, and the schema check by the schema's bytes and the loaded config.

Snakemake's `validate` reads the 15 KB schema with a pure-Python YAML reader and imports jsonschema at every
start: with the strict read, about 0.15 s of a 1.5 s dry run on a 2-core machine (bench/RESULTS.md). Here the
schema is read with libyaml, and a config checked before takes its checked form (the schema's defaults filled
in, as `validate` fills them) from `.snakemake/k2vec/config-check.json` without importing jsonschema. A config
that does not survive a JSON round trip unchanged (a key that is not a string) is checked every time. The cache
holds only while the checks' own code is as it was (this module and k2vec.config.read, by their bytes); the
jsonschema release is not part of it (Draft 2020-12's keywords this schema uses do not change between releases).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from k2vec.config import read
from k2vec.config.read import MAX_CONFIG_BYTES, check_config_file
from k2vec.errors import ConfigError

FORMAT = "k2vec-config-check-1"


def _code() -> str:
    """sha256 of the checks' code: what they passed before says nothing once a rule changed."""
    return hashlib.sha256(Path(read.__file__).read_bytes() + b"\0" + Path(__file__).read_bytes()).hexdigest()


class ConfigCheckCache:
    """What earlier starts checked: sha256s of config files that passed the strict read, and the checked
    config of the last (schema, config) pair that passed the schema. A cache that cannot be read, or of
    another format, is ignored (and rewritten)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: set[str] = set()
        self.checked: dict[str, Any] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("format") == FORMAT and data.get("code") == _code() \
                and isinstance(data.get("files"), list) and isinstance(data.get("checked"), dict):
            self.files = {f for f in data["files"] if isinstance(f, str)}
            self.checked = data["checked"]

    def save(self) -> None:
        """Write the cache if it changed, atomically; a cache that cannot be written is recomputed next time."""
        if not self.dirty:
            return
        from k2vec.atomic import write_text_atomic

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.path, json.dumps({"format": FORMAT, "code": _code(), "files": sorted(self.files),
                                                     "checked": self.checked}))
            self.dirty = False
        except OSError:
            pass


def check_config_files(paths, cache: ConfigCheckCache) -> None:
    """k2vec.config.read.check_config_file on each existing path (a missing one is Snakemake's to report),
    skipped for a file whose bytes passed it before."""
    for p in paths:
        try:
            with open(p, "rb") as fh:
                data = fh.read(MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            continue
        except OSError:
            data = None   # check_config_file names the error
        digest = hashlib.sha256(data).hexdigest() if data is not None and len(data) <= MAX_CONFIG_BYTES else None
        if digest is not None and digest in cache.files:
            continue
        check_config_file(p)
        if digest is not None:
            cache.files.add(digest)
            cache.dirty = True


def _defaulting_validator(schema: dict):
    """Draft 2020-12, filling each property's `default` in before checking the properties: what
    snakemake.utils.validate does with set_default=True (the recipe of jsonschema's FAQ)."""
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties(validator, props, instance, subschema):
        if isinstance(instance, dict):
            for name, sub in props.items():
                if isinstance(sub, dict) and "default" in sub:
                    instance.setdefault(name, sub["default"])
        yield from check_properties(validator, props, instance, subschema)

    return validators.extend(Draft202012Validator, {"properties": properties})(schema)


def _key(schema_bytes: bytes, config: dict) -> str | None:
    try:
        text = json.dumps(config, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):   # a key that is not a string, a value JSON has no form for, NaN
        return None
    return hashlib.sha256(hashlib.sha256(schema_bytes).digest() + text.encode()).hexdigest()


def validate_config(config: dict, schema_path: str | Path, cache: ConfigCheckCache) -> None:
    """Check `config` against the YAML schema at `schema_path` and fill in its defaults, in place; ConfigError
    naming the dotted key of the most specific violation (k2vec.config.expand.schema_error)."""
    import yaml

    schema_bytes = Path(schema_path).read_bytes()
    key = _key(schema_bytes, config)
    hit = cache.checked.get("config") if key is not None and cache.checked.get("key") == key else None
    if isinstance(hit, dict):
        config.clear()
        config.update(hit)
        return
    schema = yaml.load(schema_bytes, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    validator = _defaulting_validator(schema)
    if next(validator.iter_errors(config), None) is not None:
        from k2vec.config.expand import schema_error

        raise schema_error(config, str(schema_path)) or ConfigError("(top level)", "does not match the schema")
    if key is not None and json.loads(json.dumps(config)) == config:
        cache.checked = {"key": key, "config": config}
        cache.dirty = True
