"""The `engines:` section resolved: defaults, command templates checked, source globs expanded, the runs each engine
gets."""

from __future__ import annotations

import copy
import itertools
import math
import re
from typing import Any, Callable, Iterable

from k2vec.config.expand import require
from k2vec.model.conventions import CONVENTIONS, variant_key

# -------------------------------------------------------------------------------------------- engines

# max_result_mb: the largest legitimate result of the default config is about 2 MB (small model,
# greedy: 4 prompts x 24 steps of full fingerprints), so a 100-prompt config writes about 51 MB
# compact or 71 MB indented; anything larger is refused before it is read (docs/engine-contract.md
# section 5). Configs with wider models or longer decodes raise it per engine.
# sandbox: on by default; an engine left at the default runs unsandboxed where bubblewrap cannot run
# (with a notice, and its report rows flagged not tamper-proof), an explicit `sandbox: true` is refused
# there (check_sandboxes), an explicit `sandbox: false` opts out.
ENGINE_DEFAULTS: dict[str, Any] = {"build": None, "sources": [], "gpus": 0, "timeout_s": 600.0,
                                   "build_timeout_s": 1800.0, "precisions": ["fp32", "int4"],
                                   "modes": ["greedy", "ddtree", "score"], "max_result_mb": 96.0,
                                   "sandbox": True, "precision": "float32", "requires": [],
                                   "requires_commands": [], "requires_check": None, "requires_model": None,
                                   "ddtree_budgets": None, "conventions": []}
_PLACEHOLDERS = ("bundle", "mode", "budget", "output", "batch", "gpus", "python")
# What a single run's command names that a batch engine reads from its {batch} listing instead.
_PER_RUN = ("mode", "budget", "output")
# The largest value of each numeric limit (the schema's maxima, kept equal by a test): a run or build
# that may wait a week waits long enough; 64 GiB is far above any result file yet fits int64 bytes.
# (1e308 once reached int() in the runner: OverflowError, no result, the engine left running.)
ENGINE_LIMITS = {"timeout_s": 7 * 24 * 3600, "build_timeout_s": 7 * 24 * 3600, "max_result_mb": 65536}


# An environment assignment leading a command (OMP_NUM_THREADS=1): not part of the program's name.
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
# A command template's tokens, as str.format reads them: escaped braces, a {placeholder}, a lone brace.
_TEMPLATE_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_BRACE_HELP = "for a brace the shell should see, write it twice ({{ or }})"


def check_command_template(template: str, key: str) -> set[str]:
    """The placeholder names of an engine command template; ConfigError naming `key`, the character
    position and the text around it for a stray brace or an unknown placeholder."""
    known = ", ".join("{" + p + "}" for p in _PLACEHOLDERS)

    def where(i: int) -> str:
        return f"at character {i + 1} (near {template[max(0, i - 25): i + 25]!r})"

    fields = set()
    for m in _TEMPLATE_TOKEN.finditer(template):
        token = m.group(0)
        if token in ("{{", "}}"):
            continue
        require(token not in ("{", "}"), key, f"stray {token!r} {where(m.start())}; {_BRACE_HELP}")
        name = re.split(r"[!:]", m.group(1), maxsplit=1)[0]
        require(name in _PLACEHOLDERS, key, f"unknown placeholder {token} {where(m.start())}; known: {known}; "
                 f"{_BRACE_HELP}")
        require(token == "{" + name + "}", key, f"placeholder {token} {where(m.start())} has a conversion or "
                 f"format spec; write {{{name}}}: values are shell-quoted strings")
        fields.add(name)
    return fields


# A source glob is a list of the engine's own files, so it stays small and close: at most this many
# files each (the shipped engines' largest matches 13), and no pattern that would walk a whole
# filesystem (`/**`, `/home/*/...`) before it is found to be a mistake.
MAX_SOURCE_FILES = 10_000


def source_glob(pattern: str, basedir: str, key: str) -> list[str]:
    """The files `pattern` matches, sorted. A relative pattern is relative to `basedir` (the repository)
    and must not leave it (no `..`). An absolute one, or one whose fixed directory (the part before the
    first wildcard) resolves outside the repository through a link, must name a directory at least two
    levels below the root (`/opt/myengine/...`, not `/` or `/opt/*`) and use no `**` there. ConfigError
    naming `key` for such a pattern, one matching no file or more than MAX_SOURCE_FILES."""
    import glob
    import os

    parts = pattern.replace(os.sep, "/").split("/")
    require(".." not in parts, key, f"pattern {pattern!r} has a '..' component; write a path inside the "
            f"repository without it, or an absolute one")
    absolute = os.path.isabs(pattern)
    path = pattern if absolute else os.path.join(basedir, pattern)
    fixed = []  # the directories before the first wildcard (or the file name)
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    prefix = os.path.realpath(os.path.join(basedir, "/".join(fixed) or ("/" if absolute else ".")))
    repo = os.path.realpath(basedir)
    if os.path.commonpath([prefix, repo]) != repo:
        depth = len([p for p in prefix.split(os.sep) if p])
        require(depth >= 2, key, f"pattern {pattern!r} would search {prefix} (the root or a directory right "
                f"below it): name the engine's own directory, at least two levels below the root, "
                f"e.g. /opt/myengine/src/*.cu")
        require("**" not in pattern, key, f"pattern {pattern!r}: '**' outside the repository ({repo}) "
                f"could walk a whole tree; list the directories, or keep the sources in the repository")
    found = (p for p in glob.iglob(path, recursive=True) if os.path.isfile(p))
    matched = sorted(itertools.islice(found, MAX_SOURCE_FILES + 1))
    require(bool(matched), key, f"pattern {pattern!r} matches no file")
    require(len(matched) <= MAX_SOURCE_FILES, key, f"pattern {pattern!r} matches more than {MAX_SOURCE_FILES:,} "
            f"files (k2vec.config.engines.MAX_SOURCE_FILES): an engine's sources, not a directory tree")
    return matched


def resolve_engines(config: dict[str, Any], basedir: str, defined: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Engine settings with defaults filled in and source globs expanded (relative to `basedir`).
    An entry set to null (`engines: {numpy: null}` in an overlay config) disables that engine; it must
    name an engine that some config file defines (`defined`, config.read.defined_engines), so that a
    misspelt name is an error instead of a silent no-op."""
    entries = config.get("engines") or {}
    known = sorted({*defined, *(n for n, e in entries.items() if e is not None)})
    for name, entry in entries.items():
        require(entry is not None or name in known, f"engines.{name}",
                f"null disables an engine, but no config file defines one named {name!r}; "
                f"known engines: {', '.join(known) or 'none'}")
    engines = {}
    for name, entry in entries.items():
        if entry is None:
            continue
        key = f"engines.{name}"
        e = {**copy.deepcopy(ENGINE_DEFAULTS), "models": sorted(config["models"]), **copy.deepcopy(entry)}
        for k, top in ENGINE_LIMITS.items():
            v = e[k]
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= top,
                    f"{key}.{k}", f"must be a number above 0 and at most {top:g}, got {v!r}")
        fields = check_command_template(e["command"], f"{key}.command")
        # a batch engine (docs/engine-contract.md section 2) serves every run of a bundle in one process
        e["batch"] = "batch" in fields
        if e["batch"]:
            per_run = [f"{{{f}}}" for f in _PER_RUN if f in fields]
            require("bundle" in fields, f"{key}.command", "a batch command (one with {batch}) must use {bundle}")
            require(not per_run, f"{key}.command", f"a batch command (one with {{batch}}) cannot use "
                    f"{', '.join(per_run)}: each run's mode, budget and output are in the batch listing")
        else:
            require("output" in fields and "bundle" in fields, f"{key}.command",
                    "must use {bundle} and {output} (or {bundle} and {batch}: several runs in one process)")
        for m in e["models"]:
            require(m in config["models"], f"{key}.models", f"unknown model {m!r}")
        if e["requires_model"] is not None:
            _model_test(e["requires_model"], f"{key}.requires_model")
        budgets = config["decoding"]["ddtree"]["budgets"]
        if e["ddtree_budgets"] is None:
            e["ddtree_budgets"] = list(budgets)
        unknown = [b for b in e["ddtree_budgets"] if b not in budgets]
        require(not unknown, f"{key}.ddtree_budgets", f"budget(s) {unknown} not in decoding.ddtree.budgets "
                 f"{budgets}: the golden has DDTree traces for those budgets only")
        require(len(set(e["ddtree_budgets"])) == len(e["ddtree_budgets"]), f"{key}.ddtree_budgets", "has duplicates")
        unknown = [c for c in e["conventions"] if c not in CONVENTIONS]
        require(not unknown, f"{key}.conventions", f"unknown convention(s) {unknown}; known: "
                f"{', '.join(CONVENTIONS)} (k2vec.model.conventions)")
        files: list[str] = []
        for pattern in e["sources"]:
            files.extend(source_glob(pattern, basedir, f"{key}.sources"))
        e["source_files"] = sorted(set(files))
        # asked for by name: a host that cannot sandbox must refuse it, not fall back
        e["sandbox_required"] = entry.get("sandbox") is True
        engines[name] = e
    return engines


def check_sandboxes(engines: dict[str, dict[str, Any]], sandbox_problem: Callable[[], str | None]) -> list[str]:
    """Refuse an explicit `sandbox: true` where this host cannot sandbox (`sandbox_problem`: the
    engines' own probe, k2vec.engines.isolation, asked only when an engine wants the sandbox). Returns
    the engines left at the default (sandboxed) that will run unsandboxed here, for a notice: their
    runs record why, and the report flags their rows as not tamper-proof."""
    wanted = [name for name, e in engines.items() if e["sandbox"]]
    if not wanted:
        return []
    problem = sandbox_problem()
    if problem is None:
        return []
    required = [name for name in wanted if engines[name].get("sandbox_required", True)]
    if required:
        require(False, f"engines.{required[0]}.sandbox", f"{problem}; or set sandbox: false")
    return wanted


def engines_short_of_gpus(engines: dict[str, dict[str, Any]], n_devices: int) -> list[str]:
    """Engines that need more GPUs per run than the node's pool has (all GPU engines on a CPU machine)."""
    return [name for name, e in engines.items() if e["gpus"] > n_devices]


def engines_missing_modules(engines: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Engine name -> the modules of its `requires` that the pipeline's Python cannot import (e.g. the
    transformers engine where transformers is not installed); engines missing none are not listed."""
    import importlib.util

    missing = {}
    for name, e in engines.items():
        absent = [m for m in e["requires"] if importlib.util.find_spec(m) is None]
        if absent:
            missing[name] = absent
    return missing


def engines_missing_commands(engines: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Engine name -> the commands of its `requires_commands` not found on PATH (shutil.which; e.g. cmake or
    a C++ compiler for the native engine's build); engines missing none are not listed."""
    import shutil

    missing = {}
    for name, e in engines.items():
        absent = [c for c in e.get("requires_commands", []) if shutil.which(c) is None]
        if absent:
            missing[name] = absent
    return missing


def engines_failing_checks(engines: dict[str, dict[str, Any]], timeout_s: float = 30.0) -> dict[str, str]:
    """Engine name -> why its `requires_check` (a shell command that must exit 0, e.g. that a library's
    header is there for its build) failed; engines without one, or passing it, are not listed."""
    import subprocess

    failing = {}
    for name, e in engines.items():
        check = e.get("requires_check")
        if not check:
            continue
        try:
            res = subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=timeout_s,
                                 stdin=subprocess.DEVNULL)
            said = (res.stderr.strip().splitlines() or [""])[-1][:200]
            problem = None if res.returncode == 0 else f"exit code {res.returncode}" + (f": {said}" if said else "")
        except (OSError, subprocess.TimeoutExpired) as err:
            problem = str(err)
        if problem:
            failing[name] = f"{check!r} failed ({problem})"
    return failing


def _model_test(expression: str, key: str):
    """The compiled `requires_model` expression; ConfigError naming `key` where it is not one."""
    try:
        return compile(expression, key, "eval")
    except SyntaxError as err:
        require(False, key, f"not a Python expression: {err.msg} in {expression!r}")


def engines_off_models(engines: dict[str, dict[str, Any]],
                       models: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Engine name -> {model: why} for each model of its `models` that its `requires_model` rejects: an
    expression over the model's resolved architecture (`models`: name -> config.expand.resolve_model), e.g.
    vLLM's MLA taking only some latent widths. Such an engine gets no run on that model; engines whose
    every model passes are not listed."""
    out: dict[str, dict[str, str]] = {}
    for name, e in engines.items():
        if e["requires_model"] is None:
            continue
        code = _model_test(e["requires_model"], f"engines.{name}.requires_model")
        names = sorted(code.co_names)
        for m in e["models"]:
            try:
                ok = eval(code, {"__builtins__": {}}, dict(models[m]))
            except NameError as err:
                require(False, f"engines.{name}.requires_model", f"{err}: the expression may name the resolved "
                        f"architecture's settings, e.g. kv_lora_rank, qk_rope_head_dim, hidden_size")
            except Exception as err:  # noqa: BLE001 -- any failure of the user's expression names the key
                require(False, f"engines.{name}.requires_model", f"{type(err).__name__}: {err} on model {m!r}")
            if not ok:
                given = ", ".join(f"{k} {models[m][k]}" for k in names if k in models[m])
                out.setdefault(name, {})[m] = f"requires_model {e['requires_model']!r} is false ({given})"
    return out


def left_out_on_models(off_models: dict[str, dict[str, str]], engines: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The report's left-out entries for `off_models` (engines_off_models): an engine rejected on all its
    models is left out by name; otherwise each model it skips is, as "<engine> on <model>"."""
    out = {}
    for name, off in off_models.items():
        if set(off) >= set(engines[name]["models"]):
            out[name] = "no model it can run on: " + "; ".join(f"{m}: {why}" for m, why in sorted(off.items())) \
                + f" (engines.{name}.requires_model)"
        else:
            out.update({f"{name} on {m}": f"{why} (engines.{name}.requires_model)" for m, why in sorted(off.items())})
    return out


def left_out_engines(entries: dict[str, Any], gpu_left_out: list[str], n_devices: int,
                     missing_modules: dict[str, list[str]], python: str,
                     missing_commands: dict[str, list[str]] | None = None,
                     failed_checks: dict[str, str] | None = None) -> dict[str, str]:
    """Each configured engine (`entries`: the config's `engines:`) that gets no run, with the reason the
    report names it by: disabled, short of GPUs (`gpu_left_out`, engines_short_of_gpus), a package
    of its `requires` missing (`missing_modules`, engines_missing_modules), a command of its
    `requires_commands` (`missing_commands`, engines_missing_commands), or its `requires_check`
    failing (`failed_checks`, engines_failing_checks)."""
    reasons = {}
    for name, entry in entries.items():
        why = [f"disabled (engines.{name}: null)"] if entry is None else []
        if name in gpu_left_out:
            why.append(f"no GPU: needs {entry.get('gpus')} per run, the pool has {n_devices} (gpus.devices, "
                       f"CUDA_VISIBLE_DEVICES)")
        if name in missing_modules:
            why.append(f"package(s) missing: {', '.join(missing_modules[name])} not importable by {python} "
                       f"(engines.{name}.requires)")
        if name in (missing_commands or {}):
            why.append(f"command(s) missing: {', '.join(missing_commands[name])} not on PATH "
                       f"(engines.{name}.requires_commands)")
        if name in (failed_checks or {}):
            why.append(f"requirement not met: {failed_checks[name]} (engines.{name}.requires_check)")
        if why:
            reasons[name] = "; ".join(why)
    return reasons


def noise_models(engines: dict[str, dict[str, Any]], runs) -> list[tuple[str, str, str]]:
    """The (model, precision, precision class) noise models the report needs: one per bundle that an
    engine of a reduced precision (anything but float32) runs on, among `runs` (engine_runs)."""
    return sorted({(m, p, engines[e]["precision"]) for e, m, p, _ in runs if engines[e]["precision"] != "float32"})


def command_family(command: str) -> tuple[str, ...]:
    """The program a command template runs: its words before the first option (`--...`), leading environment
    assignments (NAME=value) left out. One program at two precisions (hf_fp32, hf_bf16) is one family."""
    words = itertools.dropwhile(lambda w: _ASSIGNMENT.fullmatch(w), command.split())
    return tuple(itertools.takewhile(lambda w: not w.startswith("--"), words))


def float32_counterparts(engines: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per engine of a reduced precision, the float32 engine of its command family (the first by name), where
    one is configured: the run that sees the bugs below its precision's resolution (report/resolution.py)."""
    float32 = sorted((command_family(e["command"]), n) for n, e in engines.items() if e["precision"] == "float32")
    out = {}
    for name, e in sorted(engines.items()):
        family = command_family(e["command"])
        same = [n for f, n in float32 if f == family]
        if e["precision"] != "float32" and same:
            out[name] = same[0]
    return out


def convention_variants(engines: dict[str, dict[str, Any]], runs) -> list[tuple[str, str, str]]:
    """The (model, precision, variant) convention variants the report needs (k2vec.model.conventions,
    variant_key): per bundle an engine runs on, the variant of the conventions it declares, or each known
    convention where it declares none (what the report checks a failing engine against)."""
    out = set()
    for e, m, p, _ in runs:
        declared = engines[e]["conventions"]
        out.update((m, p, v) for v in ([variant_key(declared)] if declared else CONVENTIONS))
    return sorted(out)


def engine_modes(engine: dict[str, Any], budgets: list[int]) -> list[str]:
    """The run modes of one engine on each of its bundles, in order: greedy, ddtree-b<budget> per DDTree budget of
    `budgets` that it runs (its `ddtree_budgets`), and score (forced decoding of the golden tokens)."""
    e = engine
    return (["greedy"] if "greedy" in e["modes"] else []) + (
        [f"ddtree-b{b}" for b in budgets if b in e["ddtree_budgets"]] if "ddtree" in e["modes"] else []) + (
        ["score"] if "score" in e["modes"] else [])


def engine_runs(engines: dict[str, dict[str, Any]], budgets: list[int], left_out: list[str] = (),
                off_models: dict[str, dict[str, str]] | None = None) -> list[tuple[str, str, str, str]]:
    """Every (engine, model, precision, mode) run (engine_modes on each of its bundles); none for the engines in
    `left_out`, nor on the models `off_models` (engines_off_models) takes from an engine."""
    off = off_models or {}
    return [(name, m, p, mode) for name, e in engines.items() if name not in left_out
            for m in e["models"] if m not in off.get(name, {}) for p in e["precisions"]
            for mode in engine_modes(e, budgets)]
