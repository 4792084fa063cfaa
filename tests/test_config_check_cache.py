"""The config checks remembered across starts (k2vec.config.check_cache): the same checked config as
Snakemake's `validate`, taken from the cache only for the same schema and config, and a config file's
strict read skipped only for bytes that passed it."""
import copy
import json

import pytest
import yaml

from conftest import REPO, default_config
from k2vec.config import check_cache
from k2vec.config.check_cache import ConfigCheckCache, check_config_files, validate_config
from k2vec.config.read import ConfigFileError
from k2vec.errors import ConfigError

SCHEMA = REPO / "workflow/schemas/config.schema.yaml"


def _snakemake_validated(config: dict) -> dict:
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(SCHEMA))
    return config


def _without_defaults(config: dict) -> dict:
    """The default config with keys left out that the schema fills in (gpus.jobs_per_device)."""
    config = copy.deepcopy(config)
    del config["gpus"]["jobs_per_device"]
    return config


@pytest.mark.parametrize("name, make", [("shipped", lambda c: c), ("defaults-left-out", _without_defaults)])
def test_checked_config_is_snakemakes(tmp_path, name, make):
    config = make(default_config())
    mine = copy.deepcopy(config)
    validate_config(mine, SCHEMA, ConfigCheckCache(tmp_path / "c.json"))
    assert mine == _snakemake_validated(config)
    assert mine["gpus"]["jobs_per_device"] == 4


def test_a_config_checked_before_comes_from_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    first = ConfigCheckCache(path)
    expected = _without_defaults(default_config())
    validate_config(expected, SCHEMA, first)
    first.save()

    def no_validator(schema):
        raise AssertionError("validated again")

    monkeypatch.setattr(check_cache, "_defaulting_validator", no_validator)
    again = _without_defaults(default_config())
    validate_config(again, SCHEMA, ConfigCheckCache(path))
    assert again == expected and again["gpus"]["jobs_per_device"] == 4


@pytest.mark.parametrize("change", ["config", "schema"])
def test_another_config_or_schema_is_checked_again(tmp_path, change):
    path = tmp_path / "c.json"
    cache = ConfigCheckCache(path)
    schema = tmp_path / "schema.yaml"
    schema.write_bytes(SCHEMA.read_bytes())
    validate_config(default_config(), schema, cache)
    cache.save()
    bad = default_config()
    if change == "config":
        bad["gpus"]["jobs_per_device"] = 0
    else:   # the same config under a schema that now refuses it
        text = yaml.safe_load(SCHEMA.read_text())
        text["properties"]["gpus"]["properties"]["jobs_per_device"]["minimum"] = 100
        schema.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError, match=r"config key 'gpus\.jobs_per_device'"):
        validate_config(bad, schema, ConfigCheckCache(path))


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "other", "files": [], "checked": {}}),
                                     json.dumps({"format": check_cache.FORMAT, "code": check_cache._code(), "files": 3,
                                                 "checked": {}})])
def test_an_unreadable_cache_is_ignored(tmp_path, content):
    path = tmp_path / "c.json"
    path.write_text(content)
    cache = ConfigCheckCache(path)
    assert cache.files == set() and cache.checked == {}
    bad = default_config()
    bad["gpus"]["jobs_per_device"] = 0
    with pytest.raises(ConfigError, match=r"gpus\.jobs_per_device"):
        validate_config(bad, SCHEMA, cache)


def test_a_config_json_cannot_hold_is_not_remembered(tmp_path):
    cache = ConfigCheckCache(tmp_path / "c.json")
    config = default_config()
    config["models"] = {7: config["models"]["small"]}   # a YAML key `7:`, "7" in JSON
    validate_config(config, SCHEMA, cache)   # the schema's name pattern applies to strings only
    assert cache.checked == {} and not cache.dirty
    assert 7 in config["models"]


def test_a_config_file_is_read_strictly_again_once_its_bytes_change(tmp_path):
    cfg = tmp_path / "user.yaml"
    cfg.write_text("a: 1\nb: 2\n")
    path = tmp_path / "c.json"
    cache = ConfigCheckCache(path)
    check_config_files([cfg, tmp_path / "missing.yaml"], cache)
    cache.save()
    assert len(ConfigCheckCache(path).files) == 1
    cfg.write_text("a: 1\na: 2\n")
    with pytest.raises(ConfigFileError, match="duplicate key 'a'"):
        check_config_files([cfg], ConfigCheckCache(path))


def test_what_older_checks_passed_is_not_reused(tmp_path, monkeypatch):
    """A rule of the strict read or of the schema check that changed (another version of their code) may refuse
    what the old one passed."""
    path = tmp_path / "c.json"
    cache = ConfigCheckCache(path)
    cfg = tmp_path / "user.yaml"
    cfg.write_text("a: 1\n")
    check_config_files([cfg], cache)
    validate_config(default_config(), SCHEMA, cache)
    cache.save()
    assert ConfigCheckCache(path).files and ConfigCheckCache(path).checked
    monkeypatch.setattr(check_cache, "_code", lambda: "another version")
    again = ConfigCheckCache(path)
    assert again.files == set() and again.checked == {}
