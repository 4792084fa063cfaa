# The plan of the mutation run (`snakemake mutation_report`, workflow/rules/mutation.smk): which mutant
# runs on which bundle in which modes, and the helpers of its two rules.
from k2vec.mutation.catalogue import MUTANTS
from k2vec.mutation.plan import mutant_command
from k2vec.mutation.plan import plan as mutation_plan

MUTATION_PLAN, MUTATION_PROBLEM = mutation_plan(config, ENGINES, RUNS, CASES)


def mutation_ready(wildcards=None):
    if MUTATION_PROBLEM:
        raise WorkflowError(f"Invalid configuration: {MUTATION_PROBLEM}")
    return []


def mutant_modes(wildcards):
    return MUTATION_PLAN[(wildcards.mutant, wildcards.model, wildcards.precision)]


def mutant_engine(mutant):
    return f"mutant-{mutant}"


def mutant_records():
    return [
        {
            "engine": mutant_engine(mu),
            "model": m,
            "precision": p,
            "mode": mode,
            "result": f"{mutant_runs_dir(mu, m, p)}/{mode}.json",
            "precision_class": "float32",
        }
        for (mu, m, p), modes in MUTATION_PLAN.items()
        for mode in modes
    ]


def mutant_code(wildcards):
    """What a mutant run executes, by meaning: its script, the runner, the mutation engine with the
    catalogue (k2vec.mutation.engine), and the numpy engine's Python sources."""
    python = [p for p in ENGINES["numpy"]["source_files"] if p.endswith(".py")]
    return code_digest(
        [
            *stage_files(
                "mutant_runs.py", "k2vec.engines.runner", "k2vec.kdtr", "k2vec.pipeline.stage", "k2vec.mutation.engine"
            ),
            *python,
        ],
        workflow.basedir,
    )
