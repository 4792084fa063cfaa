# Shared set-up: validate the config, expand it into resolved cases, and list the package
# code each stage runs (Snakemake does not track modules imported by scripts).
import atexit
import functools
import json

from snakemake.exceptions import WorkflowError

# k2vec imports come from this checkout's src/, which the Snakefile puts first on sys.path and PYTHONPATH.
from k2vec.config.check_cache import validate_config
from k2vec.config.resources import check_config
from k2vec.config.imports import source_files
from k2vec.pipeline.code_digest import DigestCache, module_sources, script_modules, with_imports
from k2vec.errors import ConfigError
from k2vec.engines.gpus import device_pool
from k2vec.engines.isolation import sandbox_problem
from k2vec.digests import integrity_key_path, sha256_file
from k2vec.engines.contract.result_cache import report_cache_dir
from k2vec.config.engines import (
    check_sandboxes,
    convention_variants,
    float32_counterparts,
    noise_models,
    engine_modes,
    engine_runs,
    engines_failing_checks,
    engines_missing_commands,
    engines_missing_modules,
    engines_off_models,
    engines_short_of_gpus,
    left_out_engines,
    left_out_on_models,
    resolve_engines,
)
from k2vec.config.expand import check_finite, expand_config, resolve_model
from k2vec.model.precision import FORMATS

CONFIG_SCHEMA = os.path.join(workflow.basedir, "workflow", "schemas", "config.schema.yaml")
try:
    # snakemake.utils.validate's check (the schema's defaults filled in), remembered across starts
    validate_config(config, CONFIG_SCHEMA, CONFIG_CHECKS)
    check_finite(config)  # .nan and .inf pass the schema's bounds
    ENGINES = resolve_engines(config, workflow.basedir, defined_engines(CONFIG_FILES))
    UNSANDBOXED = check_sandboxes(ENGINES, sandbox_problem)
except ConfigError as err:  # every check names the offending key first
    raise WorkflowError(f"Invalid configuration: {err}") from None

if UNSANDBOXED and workflow.is_main_process:
    # engines left at the default sandbox: true run unsandboxed here; their results say why
    print(
        f"k2vec: engine(s) {', '.join(UNSANDBOXED)} run unsandboxed: {sandbox_problem()}; the report flags "
        f"their rows (and every row judged beside them) as not tamper-proof; set sandbox: false to opt out",
        file=sys.stderr,
    )
# The report's plot files (k2vec.report.OUTPUTS; a test keeps the two lists equal).
REPORT_PLOTS = ["match_grid", "logit_error", "first_bad_layer", "acceptance", "format_effect", "score_kl"]
PRECISIONS = ["fp32", "int4"]
# Devices of the GPU slot pool; looked up only when some engine needs GPUs.
GPU_DEVICES = device_pool(config["gpus"]["devices"]) if any(e["gpus"] for e in ENGINES.values()) else []
# Local execution shares this node's pool. (Remote executors give each job its own devices: neither
# step below applies there.)
GPU_LEFT_OUT = []
if workflow.local_exec:
    # Without enough devices a GPU engine's runs could only fail: leave them out, say so in one line.
    GPU_LEFT_OUT = engines_short_of_gpus(ENGINES, len(GPU_DEVICES))
    if GPU_LEFT_OUT and workflow.is_main_process:
        print(
            f"k2vec: no run of GPU engine(s) {', '.join(GPU_LEFT_OUT)}: the GPU pool has "
            f"{len(GPU_DEVICES)} device(s) (config gpus.devices)",
            file=sys.stderr,
        )
    # A GPU job started while every device is leased would sit holding a core until one frees up:
    # cap the `gpu` resource (the profile says 8) at the pool's size so the scheduler never starts it.
    # (Only where GPU jobs remain: otherwise the limit is moot and stays as given.)
    _gpu_limit = workflow.global_resources.get("gpu").value
    _gpu_jobs = any(e["gpus"] for name, e in ENGINES.items() if name not in GPU_LEFT_OUT)
    # (gpus.jobs_per_device > 1 lets that many jobs share each device.)
    _gpu_slots = len(GPU_DEVICES) * config["gpus"]["jobs_per_device"]
    if _gpu_jobs and (_gpu_limit is None or _gpu_limit > _gpu_slots):
        workflow.register_resource("gpu", _gpu_slots)
# An engine whose packages (its `requires`) this interpreter cannot import could only fail: leave it
# out too, in one line (the transformers engine where transformers or torch is not installed).
MODULES_LEFT_OUT = engines_missing_modules(ENGINES)
if MODULES_LEFT_OUT and workflow.is_main_process:
    _absent = sorted({m for ms in MODULES_LEFT_OUT.values() for m in ms})
    print(
        f"k2vec: no run of engine(s) {', '.join(MODULES_LEFT_OUT)}: {', '.join(_absent)} not importable by "
        f"{sys.executable} (engines.<name>.requires)",
        file=sys.stderr,
    )
# Likewise an engine whose build or run needs a command that is not on PATH (its `requires_commands`: the
# native engine without cmake or a C++ compiler).
COMMANDS_LEFT_OUT = engines_missing_commands(ENGINES)
if COMMANDS_LEFT_OUT and workflow.is_main_process:
    _absent = sorted({c for cs in COMMANDS_LEFT_OUT.values() for c in cs})
    print(
        f"k2vec: no run of engine(s) {', '.join(COMMANDS_LEFT_OUT)}: command(s) missing: {', '.join(_absent)} "
        f"(engines.<name>.requires_commands)",
        file=sys.stderr,
    )
# And one whose `requires_check` fails (the native engine without the JSON library's headers).
CHECKS_LEFT_OUT = engines_failing_checks({n: e for n, e in ENGINES.items() if n not in COMMANDS_LEFT_OUT})
if CHECKS_LEFT_OUT and workflow.is_main_process:
    for _name, _why in CHECKS_LEFT_OUT.items():
        print(f"k2vec: no run of engine {_name}: {_why} (engines.{_name}.requires_check)", file=sys.stderr)
# Every configured engine that gets no run, with its reason: the report names them all.
LEFT_OUT = left_out_engines(
    config["engines"],
    GPU_LEFT_OUT,
    len(GPU_DEVICES),
    MODULES_LEFT_OUT,
    sys.executable,
    COMMANDS_LEFT_OUT,
    CHECKS_LEFT_OUT,
)
try:
    # And an engine on a model its `requires_model` rejects (vLLM's MLA on latent widths it does not take):
    # no run there, named in the report as "<engine> on <model>".
    # (the models resolved only where a running engine has a test: no start-up work otherwise)
    _TESTED = {n: e for n, e in ENGINES.items() if n not in LEFT_OUT and e["requires_model"] is not None}
    OFF_MODELS = engines_off_models(
        _TESTED,
        {m: resolve_model(m, entry) for m, entry in config["models"].items()} if _TESTED else {},
    )
except ConfigError as err:
    raise WorkflowError(f"Invalid configuration: {err}") from None
if OFF_MODELS and workflow.is_main_process:
    for _name, _off in OFF_MODELS.items():
        print(
            f"k2vec: no run of engine {_name} on model(s) {', '.join(sorted(_off))}: "
            f"{'; '.join(_off[m] for m in sorted(_off))} (engines.{_name}.requires_model)",
            file=sys.stderr,
        )
LEFT_OUT.update(left_out_on_models(OFF_MODELS, ENGINES))
RUNS = engine_runs(ENGINES, config["decoding"]["ddtree"]["budgets"], list(LEFT_OUT), OFF_MODELS)
try:
    # Resource budget (k2vec.config.resources): a config whose memory, disk or file count cannot fit here stops
    # now, counting only the runs that will run, before expand_config lists every tensor of every model and
    # before any job.
    check_config(config, RUNS, os.path.abspath("results"))
    CASES = expand_config(config)
except ConfigError as err:
    raise WorkflowError(f"Invalid configuration: {err}") from None
MODELS = sorted(CASES)
# Models whose weights are a slice of the user's checkpoint (rule import_checkpoint), not synthetic.
IMPORTED_MODELS = [m for m in MODELS if "source" in CASES[m]["model"]]
# Batch engines (a command with {batch}) run every mode of a bundle in one job (rules engine_batch_<engine>);
# the modes of each, in the order its runs are listed to it.
BATCH_ENGINES = [name for name, e in ENGINES.items() if e["batch"]]
ENGINE_MODES = {name: engine_modes(e, config["decoding"]["ddtree"]["budgets"]) for name, e in ENGINES.items()}
# (model, precision, precision class) of each noise model (rule noise) the report judges an engine with.
NOISE_MODELS = noise_models(ENGINES, RUNS)
# (model, precision, variant) of each convention variant (rule convention) the report judges an engine with.
CONVENTION_VARIANTS = convention_variants(ENGINES, RUNS)
# Per reduced-precision engine, the float32 engine of its command family: named where it passes clean.
FLOAT32_ENGINES = float32_counterparts(ENGINES)
# The mutation run's per-bundle resolvability (rule mutation_report), from which the report names the catalogue's
# bugs below each reduced-precision verdict's resolution. Not an input: the report neither waits for nor reruns
# the mutation run; its digest is a parameter, so a new mutation run reruns the report.
MUTATION_RESOLUTION = "results/mutation/mutation_resolution.csv"
MUTATION_RESOLUTION_SHA256 = sha256_file(MUTATION_RESOLUTION) if os.path.exists(MUTATION_RESOLUTION) else None


wildcard_constraints:
    model="|".join(MODELS),
    section="model|quantization|prompts|decoding",
    precision="|".join(PRECISIONS),
    engine="|".join(ENGINES) or "^$",
    mode=r"greedy|score|ddtree-b\d+",
    precision_class="|".join(c for c in FORMATS),
    convention=r"[a-z0-9_]+(\+[a-z0-9_]+)*",


# Where each stage writes what other stages read, defined once: the rules' output: and input: take
# these paths from here, and so do the input functions below. (The report's own files, the mutation
# report's, the logs and the benchmarks are written where their rules say.) A wildcard not given stays a wildcard: weights_dir("fp32") is
# "results/models/{model}/fp32", golden_kdtr() "results/golden/{model}/{precision}.kdtr".


def case_section_json(section="{section}", model="{model}"):
    """Rule case_section: one section of a case."""
    return f"results/cases/{model}/{section}.json"


def case_json(model="{model}"):
    """Rule case: the fully resolved case."""
    return f"results/cases/{model}.json"


def weights_dir(precision="{precision}", model="{model}"):
    """Rules weights (fp32) and quantize (int4), or import_checkpoint (both) for an imported model."""
    return f"results/models/{model}/{precision}"


def compressed_tensors_dir(model="{model}"):
    """Rule export_compressed_tensors."""
    return f"results/models/{model}/compressed-tensors"


def prompts_json(precision="{precision}", model="{model}"):
    """Rule prompts."""
    return f"results/prompts/{model}-{precision}.json"


def golden_kdtr(precision="{precision}", model="{model}"):
    """Rule golden."""
    return f"results/golden/{model}/{precision}.kdtr"


def noise_kdtr(precision_class="{precision_class}", precision="{precision}", model="{model}"):
    """Rule noise."""
    return f"results/noise/{model}/{precision}-{precision_class}.kdtr"


def convention_kdtr(convention="{convention}", precision="{precision}", model="{model}"):
    """Rule convention."""
    return f"results/conventions/{model}/{precision}-{convention}.kdtr"


def bundle_kdtr(precision="{precision}", model="{model}"):
    """Rule bundle."""
    return f"results/bundles/{model}-{precision}.kdtr"


def engine_stamp(engine="{engine}"):
    """Rule engine_build."""
    return f"results/engines/{engine}/build.stamp"


def run_result(engine="{engine}", model="{model}", precision="{precision}", mode="{mode}"):
    """Rule engine_run."""
    return f"results/runs/{engine}/{model}-{precision}-{mode}.json"


def format_effect_json(model="{model}"):
    """Rule format_effect."""
    return f"results/format-effect/{model}.json"


def mutant_runs_dir(mutant="{mutant}", model="{model}", precision="{precision}", compute="{compute}"):
    """Rule mutant_runs: one result file per mode inside; `compute`: the engine's emulated precision."""
    return f"results/mutation/runs/{compute}/{mutant}/{model}-{precision}"


def sha256_of(path):
    """The sha256 record written beside a golden, a bundle or a format-effect result."""
    return f"{path}.sha256"


# Imported by the int4 side only, inside functions: the fp32 golden and bundle never run the quantizer.
INT4_ONLY = ("k2vec.model.int4_checkpoint",)


def stage_files(script, *modules, without=()):
    """A stage's script and the package files it imports (k2vec.pipeline.code_digest.script_modules), and
    those of `modules` besides."""
    path = os.path.join(workflow.basedir, "workflow", "scripts", script)
    return [path, *module_sources(*script_modules(path), *modules, without=without)]


# Code digests kept across starts (k2vec.pipeline.code_digest.DigestCache), per checkout: reused while the files
# they cover are unchanged, so a start reads no syntax tree it read before.
CODE_DIGESTS = DigestCache(".snakemake/k2vec/code-digests.json")
atexit.register(CODE_DIGESTS.save)


def cached_code(kind, files, *key):
    """CODE_DIGESTS.digest of `files()` under (this checkout, kind, key)."""
    return CODE_DIGESTS.digest(json.dumps([workflow.basedir, kind, *key]), files, workflow.basedir)


def stage_code(script, *modules, without=()):
    """What a stage executes, as a `params:` value: the meaning (k2vec.pipeline.code_digest.code_digest) of its script
    and of the package modules it imports. Comment, docstring and layout edits change nothing; any other
    edit reruns exactly the stages that execute the file."""
    return cached_code("stage", lambda: stage_files(script, *modules, without=without), script, modules, without)


def precision_code(script, *modules):
    """stage_code per {precision}: the fp32 side without the INT4 modules."""
    by_precision = {p: stage_code(script, *modules, without=() if p == "int4" else INT4_ONLY) for p in PRECISIONS}
    return lambda wildcards: by_precision[wildcards.precision]


@functools.cache
def engine_source_paths(engine):
    """All of an engine's sources, relative (a moved checkout with its results/ reruns nothing); asked for by
    every job of the engine, made once."""
    return [os.path.relpath(p) for p in ENGINES[engine]["source_files"]]


def engine_sources(engine):
    """An engine's non-Python sources, declared as inputs (their checksums decide); its Python sources
    are in engine_code."""
    return [p for p in engine_source_paths(engine) if not p.endswith(".py")]


def engine_code(script, *modules, engine=None):
    """stage_code per {engine} (or for `engine`), with the meaning of the engine's own Python sources and, for those
    in the package, of what they import and read (code_digest.with_imports: a shipped engine's kernels)."""

    def digest(wildcards):
        name = engine or wildcards.engine
        python = [p for p in ENGINES[name]["source_files"] if p.endswith(".py")]
        return cached_code(
            "engine", lambda: [*stage_files(script, *modules), *with_imports(python)], script, modules, python
        )

    return digest


def engine_settings(engine):
    """An engine's settings as its runs' params, without the absolute paths its source globs resolved
    to (declared by engine_sources and engine_code): a moved or copied checkout with its results/ reruns nothing."""
    # ddtree_budgets and the requirements only say which runs exist: adding a budget (or a key, to every
    # engine's defaults) must not rerun the others; conventions only say how the report judges them
    return {
        k: v
        for k, v in ENGINES[engine].items()
        if k
        not in (
            "source_files",
            "ddtree_budgets",
            "requires_commands",
            "requires_check",
            "requires_model",
            "conventions",
        )
    }


def slurm_partition(gpus):
    """The partition of a job that needs `gpus` GPUs (config `slurm:`); None: the cluster's default."""
    return (config["slurm"]["gpu_partition"] or config["slurm"]["partition"]) if gpus else config["slurm"]["partition"]


def engine_inputs(engine):
    """The engine's sources, and its build stamp when it has a build step."""
    inputs = {"sources": engine_sources(engine)}
    if ENGINES[engine]["build"]:
        inputs["stamp"] = engine_stamp(engine)
    return inputs


def of_engine(function, engine):
    """`function(engine)` as an input or resource function of a rule made for one engine (engine_batch_<engine>)."""
    return lambda wildcards: function(engine)


def engine_run_inputs(wildcards):
    """engine_inputs of the {engine} wildcard."""
    return engine_inputs(wildcards.engine)


def import_sources(wildcards):
    """The files of the user's checkpoint an imported model's slice reads."""
    return source_files(CASES[wildcards.model]["model"])


def prompts_inputs(wildcards):
    """The prompts stage reads the weights of its precision; int4 starts from the fp32 prompts."""
    inputs = {"weights": weights_dir(wildcards.precision, wildcards.model)}
    if wildcards.precision == "int4":
        inputs["fp32_weights"] = weights_dir("fp32", wildcards.model)
        inputs["fp32_prompts"] = prompts_json("fp32", wildcards.model)
    return inputs


def golden_weights(wildcards):
    """The weights a golden reads: fp32, plus the INT4 files for the int4 precision."""
    weights = {"fp32": weights_dir("fp32", wildcards.model)}
    if wildcards.precision == "int4":
        weights["int4"] = weights_dir("int4", wildcards.model)
    return weights


def bundle_inputs(wildcards):
    inputs = {
        "fp32": weights_dir("fp32", wildcards.model),
        "golden": golden_kdtr(wildcards.precision, wildcards.model),
    }
    if wildcards.precision == "int4":
        inputs["int4"] = weights_dir("int4", wildcards.model)
    return inputs


def format_effect_record(model):
    """The format-effect run (rule format_effect), judged like an engine `int4-format` score run on fp32."""
    return {
        "engine": "int4-format",
        "model": model,
        "precision": "fp32",
        "mode": "score",
        "result": format_effect_json(model),
        "reference": True,
    }


def run_record(engine, model, precision, mode):
    """What the report needs to know about one engine run."""
    return {
        "engine": engine,
        "model": model,
        "precision": precision,
        "mode": mode,
        "result": run_result(engine, model, precision, mode),
        # the declared compute precision, not the bundle's fp32/int4: picks the report's budget
        "precision_class": ENGINES[engine]["precision"],
        # the conventions it follows: judged against that variant of the reference (docs/report.md)
        "conventions": ENGINES[engine]["conventions"],
    }
