"""Configs refused before any job: too big for this machine (memory, files), duplicated keys and
YAML syntax errors with their line, engine command templates with a stray brace."""
import math
import re
import time

import pytest

from conftest import REPO, copy_workflow, default_config, snakemake, write_config
from k2vec.config import read, resources
from k2vec.model.architecture import tensor_shapes
from k2vec.config.read import ConfigFileError, check_config_file
from k2vec.config.read import main as configfile_main
from k2vec.errors import ConfigError
from k2vec.config import engines
from k2vec.config.engines import check_command_template
from k2vec.config.expand import resolve_model


def _run(tmp_path, config: dict, *args, timeout: int = 600) -> tuple[int, str]:
    """(exit status, everything Snakemake printed: its log goes to stdout or stderr depending on when)."""
    cfg = write_config(tmp_path / "user.yaml", config)
    res = snakemake(*args, "--directory", str(tmp_path), "--configfile", str(cfg), "--replace-workflow-config",
                    cwd=tmp_path, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def _run_in(root, *args) -> tuple[int, str]:
    res = snakemake(*args, cwd=root, snakefile=root / "Snakefile")
    return res.returncode, res.stdout + res.stderr


def _one_model(**overrides) -> dict:
    config = default_config()
    config["models"] = {"big": {"preset": "small", **overrides}}
    return config


# ------------------------------------------------------------------------------ resource budget


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "real-run"])
@pytest.mark.parametrize("key, value, stage", [("vocab_size", 200_000_000, "golden"),
                                               ("num_hidden_layers", 100_000, "golden")])
def test_config_too_big_for_memory_stops_before_any_job(tmp_path, key, value, stage, dry):
    rc, out = _run(tmp_path, _one_model(**{key: value}), *(["-n"] if dry else ["--cores", "1"]))
    assert rc != 0
    m = re.search(r"Invalid configuration: config key 'models\.big\.(\w+)': the (\w+) stage of model 'big' "
                  r"needs ~([\d.]+) GiB of memory \((.*?)\); this machine has ([\d.]+) GiB available", out)
    assert m, out[-2000:]
    assert m.group(1) == key and m.group(2) == stage
    assert float(m.group(3)) > float(m.group(5)) > 0  # both sides of the comparison are in the message
    assert not (tmp_path / "results").exists()


def test_too_many_files_stops_before_any_job(tmp_path):
    # 300 layers of 64 tiny experts: little memory, but ~120,000 files (a .qw and .sc per weight)
    config = default_config()
    config["models"] = {"wide": {"preset": "tiny", "num_hidden_layers": 300, "n_routed_experts": 64,
                                 "moe_intermediate_size": 2}}
    rc, out = _run(tmp_path, config, "-n")
    assert rc != 0
    m = re.search(r"config key 'models\.wide\.(\w+)': model 'wide' would write ~([\d,]+) files .* more than the "
                  r"limit of 100,000", out)
    assert m, out[-2000:]
    assert m.group(1) == "num_hidden_layers" and int(m.group(2).replace(",", "")) > 100_000
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "n_shared_experts": 0}, {"first_k_dense_replace": 0},
                                       {"first_k_dense_replace": 3}, {"n_shared_experts": 2, "n_routed_experts": 32}])
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_closed_form_counts_match_the_checkpoint_layout(preset, overrides):
    m = resolve_model("m", {"preset": preset, **overrides})
    shapes = tensor_shapes(m)
    c = resources.counts(m)
    assert c.params == sum(math.prod(s) for s in shapes.values())
    assert c.tensors == len(shapes)
    assert c.largest_tensor == max(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    assert c.expert_params == experts
    assert c.mlp_params == sum(math.prod(s) for n, s in shapes.items() if n.endswith("_proj.weight") and ".mlp." in n)


def test_default_config_fits_and_a_small_disk_is_refused(monkeypatch, tmp_path):
    config = default_config()
    runs = [("numpy", m, p, "greedy") for m in config["models"] for p in ("fp32", "int4")]
    resources.check_config(config, runs, tmp_path / "results")  # this machine runs the default config
    monkeypatch.setattr(resources, "free_disk", lambda path: 10 << 20)
    with pytest.raises(ConfigError) as err:
        resources.check_config(config, runs, tmp_path / "results")
    assert re.search(r"the outputs need ~\d+ MiB of disk .* has 10 MiB free", err.value.reason), err.value
    monkeypatch.setenv(resources.SKIP_ENV, "1")
    resources.check_config(config, runs, tmp_path / "results")


def test_disk_estimate_counts_only_the_runs_that_run(monkeypatch, tmp_path):
    """A left-out engine's runs (engine_runs with left_out) are not in the estimate: a disk that holds the
    numpy engine's outputs but not those of ten more engines refuses the config only when they run."""
    config = default_config()
    numpy_runs = [("numpy", m, p, mode) for m in config["models"] for p in ("fp32", "int4")
                  for mode in ("greedy", "score")]
    many = numpy_runs + [(f"e{i}", *r[1:]) for i in range(10) for r in numpy_runs]
    models = {n: resolve_model(n, e) for n, e in config["models"].items()}
    need = {n: resources.output_disk(m, config, [r[3] for r in numpy_runs if r[1] == n]).amount
            for n, m in models.items()}
    monkeypatch.setattr(resources, "free_disk", lambda path: sum(need.values()) + (1 << 20))
    resources.check_config(config, numpy_runs, tmp_path / "results")
    with pytest.raises(ConfigError, match="of disk"):
        resources.check_config(config, many, tmp_path / "results")


def test_driver_is_the_overridden_key_that_grows_the_estimate():
    config = default_config()
    m = resolve_model("x", {"preset": "small", "vocab_size": 10**6, "num_attention_heads": 8})
    # the golden stage: the weights stage streams a fixed-size chunk, whatever the widths
    golden = lambda mm, cc: resources.stage_memory(mm, cc)[2].amount  # noqa: E731
    assert resources._driver(golden, m, config, "models.x") == "models.x.vocab_size"
    preset = resolve_model("x", {"preset": "small"})  # no override: the key whose doubling costs most
    key = resources._driver(golden, preset, config, "models.x")
    grow = lambda k: golden({**preset, k: 2 * preset[k]}, config)  # noqa: E731
    assert key.startswith("models.x.") and all(grow(key[9:]) >= grow(k) for k in resources.SIZE_KEYS if preset[k])


# ---------------------------------------------------------------------------- config file syntax


def test_duplicate_top_level_key_in_config_yaml_names_both_lines(tmp_path):
    root = copy_workflow(tmp_path)
    text = (root / "config.yaml").read_text()
    first = text.splitlines().index("report:") + 1
    (root / "config.yaml").write_text(text + "report:\n  strict: true\n")
    dup = len(text.splitlines()) + 1
    rc, out = _run_in(root, "-n")
    assert rc != 0
    assert f"config.yaml, line {dup}, column 1: duplicate key 'report' (first at line {first})" in out, out[-2000:]
    assert not (root / "results").exists()


def test_duplicate_nested_key_in_a_configfile_names_its_path_and_lines(tmp_path):
    cfg = tmp_path / "user.yaml"
    cfg.write_text("models:\n  tiny:\n    preset: tiny\n    seed: 1\n    seed: 2\n")
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(cfg), cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "user.yaml, line 5, column 5: duplicate key 'models.tiny.seed' (first at line 4)" in out, out[-2000:]


def test_yaml_syntax_error_in_config_yaml_names_line_and_column(tmp_path):
    root = copy_workflow(tmp_path)
    lines = (root / "config.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  count:"))
    lines[at] = "  count: [4"  # an unclosed flow sequence: the parser notices on the next line
    (root / "config.yaml").write_text("\n".join(lines) + "\n")
    rc, out = _run_in(root, "-n")
    assert rc != 0
    assert re.search(rf"config\.yaml, line {at + 2}, column \d+: YAML syntax error: .*started at line {at + 1}",
                     out), out[-2000:]


def test_tab_indentation_is_explained(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("report:\n\tstrict: true\n")
    with pytest.raises(ConfigFileError, match=r"c\.yaml, line 2, column 1: .*not tabs"):
        check_config_file(cfg)
    # the command README points to for --configfile files, which Snakemake parses before the workflow
    assert configfile_main([str(cfg)]) == 1 and "line 2, column 1" in capsys.readouterr().err


def _laughs(levels: int) -> str:
    """A "billion laughs" document: `levels` levels of 10 aliases, 10^levels nodes once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text, message", [
    # 570 bytes, 10^10 nodes: the schema check walked it for minutes, memory growing
    (_laughs(10), r"c\.yaml, line 10, column 10: this alias expands to 1,111,111,111 nodes, and the whole document "
                  r"to 12,345,679,021, more than the limit of 100,000"),
    ("a: &a [x, *a]\n", r"c\.yaml, line 1, column 11: this alias stands for a node that contains it"),
], ids=["billion-laughs", "recursive-anchor"])
def test_alias_expansion_past_the_limit_is_refused_at_once(tmp_path, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigFileError, match=message):
        check_config_file(cfg)
    assert time.perf_counter() - start < 5


def test_too_many_nodes_without_aliases_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(read, "MAX_EXPANDED_NODES", 100, raising=False)  # (100,000 nodes take seconds to compose)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("x: [" + ", ".join(["1"] * 98) + "]\n")
    with pytest.raises(ConfigFileError, match=r"c\.yaml: the document has 101 nodes, more than the limit of 100 "):
        check_config_file(cfg)


def test_aliases_within_the_limit_pass(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_laughs(4))  # 11,111 nodes expanded: as the shipped config's shared engine sources, only more
    check_config_file(cfg)


def test_oversized_config_file_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# padding\n" * 120_000)  # 1.2 MB of comments: nothing the node count would see
    with pytest.raises(ConfigFileError, match=r"c\.yaml: the config file is larger than the limit of 1,048,576 bytes"):
        check_config_file(cfg)


def test_yaml_bomb_given_with_configfile_stops_the_workflow_at_once(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(_laughs(10))
    res = snakemake("-n", "--directory", str(tmp_path), "--configfile", str(cfg), cwd=tmp_path, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "Invalid configuration: " in out and "bomb.yaml, line 10, column 10: this alias expands" in out, out[-2000:]


# ------------------------------------------------------------------------- engine command templates


@pytest.mark.parametrize("command, problem, position", [
    ("{python} run.py --bundle {bundle} --output {output}}", "stray '}'", 52),
    ("awk '{print $1}' {bundle} > {output}", "unknown placeholder {print $1}", 6),
])
def test_engine_command_template_errors_name_key_and_position(tmp_path, command, problem, position):
    config = default_config()
    config["engines"] = {"mine": {"command": command}}
    rc, msg = _run(tmp_path, config, "-n")
    assert rc != 0
    assert f"config key 'engines.mine.command': {problem} at character {position}" in msg, msg[-2000:]
    assert "write it twice ({{ or }})" in msg
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("pattern, problem", [
    ("kernels/*.cu", "pattern 'kernels/*.cu' matches no file"),
    ("/**", "pattern '/**' would search / (the root or a directory right below it)"),  # walked the filesystem
])
def test_engine_sources_matching_nothing_or_everything_stop_a_dry_run(tmp_path, pattern, problem):
    config = default_config()
    config["engines"] = {"mine": {"command": "run {bundle} {output}", "sources": [pattern]}}
    rc, msg = _run(tmp_path, config, "-n", timeout=60)  # `/**` once walked the whole filesystem
    assert rc != 0
    assert f"config key 'engines.mine.sources': {problem}" in msg, msg[-2000:]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("pattern, problem", [
    ("/**/*.cu", "would search / (the root"),
    ("/usr/**", "would search /usr (the root or a directory right below it)"),
    ("/usr/*/include/*.h", "would search /usr (the root"),
    ("/usr/lib/**/*.so", "'**' outside the repository"),
    ("../*.py", "has a '..' component"),
    ("src/../../*", "has a '..' component"),
], ids=["root-recursive", "top-dir-recursive", "top-dir-wildcard", "recursive-outside", "dotdot", "dotdot-inside"])
def test_engine_sources_outside_the_repository_are_confined(pattern, problem):
    from k2vec.config.engines import source_glob
    with pytest.raises(ConfigError) as err:
        source_glob(pattern, str(REPO), "engines.e.sources")
    assert err.value.key == "engines.e.sources" and problem in err.value.reason, err.value


def test_engine_sources_absolute_but_narrow_are_allowed(tmp_path):
    from k2vec.config.engines import source_glob
    (tmp_path / "eng" / "src").mkdir(parents=True)
    (tmp_path / "eng" / "src" / "k.cu").write_text("")
    assert source_glob(str(tmp_path / "eng/src/*.cu"), str(REPO), "k") == [str(tmp_path / "eng/src/k.cu")]
    assert source_glob(f"{REPO}/src/k2vec/config/**/*.py", str(REPO), "k")  # '**' under the repository
    with pytest.raises(ConfigError, match=r"'\*\*' outside the repository"):
        source_glob(str(tmp_path / "eng/**/*.cu"), str(REPO), "k")


def test_engine_source_glob_matching_too_many_files_is_refused(monkeypatch):
    from k2vec.config.engines import source_glob
    monkeypatch.setattr(engines, "MAX_SOURCE_FILES", 3, raising=False)
    with pytest.raises(ConfigError, match=r"pattern 'src/k2vec/\*\*/\*\.py' matches more than 3 files"):
        source_glob("src/k2vec/**/*.py", str(REPO), "engines.e.sources")


def test_command_template_rules():
    ok = check_command_template("awk '{{print $1}}' {bundle} > {output}", "k")
    assert ok == {"bundle", "output"}
    for bad, what in [("x { {bundle} {output}", "stray '{' at character 3"),
                      ("x {bundle} {output!r}", "conversion or format spec"),
                      ("x {} {bundle} {output}", "unknown placeholder {}")]:
        with pytest.raises(ConfigError, match=re.escape(what)):
            check_command_template(bad, "engines.e.command")
