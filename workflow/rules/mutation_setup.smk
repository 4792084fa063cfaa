# The plan of the mutation run (`snakemake mutation_report`, workflow/rules/mutation.smk): which mutant
# runs on which bundle in which modes, and the helpers of its two rules.
from k2vec.mutation.catalogue import MUTANTS
from k2vec.mutation.plan import UNMUTATED, mutant_command
from k2vec.mutation.plan import plan as mutation_plan

MUTATION_PLAN, MUTATION_PROBLEM = mutation_plan(config, ENGINES, RUNS, CASES)


def mutation_ready(wildcards=None):
    if MUTATION_PROBLEM:
        raise WorkflowError(f"Invalid configuration: {MUTATION_PROBLEM}")
    return []


# the reduced precisions of the mutation run and the bundles judged at each: they need noise models
MUTATION_NOISE = sorted({(m, p, c) for _, m, p, c in MUTATION_PLAN if c != "float32"})


def mutant_modes(wildcards):
    return MUTATION_PLAN[(wildcards.mutant, wildcards.model, wildcards.precision, wildcards.compute)]


def mutant_engine(mutant, compute="float32"):
    """The report's engine name of a mutant run: mutant-NAME, mutant-NAME-PRECISION at a reduced one, and
    numpy-PRECISION for the unmutated engine there."""
    if mutant == UNMUTATED:
        return f"numpy-{compute}"
    return f"mutant-{mutant}" + ("" if compute == "float32" else f"-{compute}")


def mutant_records():
    return [
        {
            "engine": mutant_engine(mu, c),
            "model": m,
            "precision": p,
            "mode": mode,
            "result": f"{mutant_runs_dir(mu, m, p, c)}/{mode}.json",
            "precision_class": c,
        }
        for (mu, m, p, c), modes in MUTATION_PLAN.items()
        for mode in modes
    ]


def mutant_code(wildcards):
    """What a mutant run executes, by meaning: its script, the runner, the mutation engine with the
    catalogue (k2vec.mutation.engine), and the numpy engine's Python sources."""
    python = [p for p in ENGINES["numpy"]["source_files"] if p.endswith(".py")]
    modules = ("k2vec.engines.runner", "k2vec.kdtr", "k2vec.pipeline.stage", "k2vec.mutation.engine")
    return cached_code("mutant", lambda: [*stage_files("mutant_runs.py", *modules), *python], python)
