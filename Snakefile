# k2vec: config expansion -> synthetic fp32 weights -> INT4 -> golden -> KDTR bundles -> engine runs -> report.
# Stages live in workflow/rules/<stage>.smk; their logic in the k2vec package under src/.
import gc
import sys
import time

from snakemake.utils import min_version

min_version("9.0")

# Whatever the environment's install points at, the package that runs is this checkout's: here, in
# every stage script and in engine commands (jobs inherit PYTHONPATH, which precedes site-packages).
sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from k2vec.pipeline import setup as workflow_setup

workflow_setup.put_checkout_first(os.path.join(workflow.basedir, "src"))

from k2vec.pipeline import checksum_once, lazy_pandas

checksum_once.install()  # a finished job's inputs hashed once for its metadata, not once per output
lazy_pandas.install()  # params compared without importing pandas (which no param is)
lazy_pandas.install_script_params()  # nor imported for the params of a script job's preamble

# A plain rerun after a kill: drop the Snakemake lock and the temporaries that dead runs left here
# (a live run's are kept, so a second concurrent run is still refused). Snakemake checks its lock
# after parsing, so this cannot wait for `onstart`. Only in the Snakemake that was started: a job's
# own Snakemake (on a cluster node) takes no lock, and on another node than the writer's it would
# take the writer of every temporary for dead (pids are per node) and delete running jobs' files.
if workflow.is_main_process:
    for message in workflow_setup.claim_working_directory().messages():
        print(message, file=sys.stderr)


# The summary is printed at the end only when this invocation rebuilt the report (onsuccess).
STARTED = time.time()


include: "workflow/rules/config.smk"  # configfile: config.yaml, after a strict read of every config file
include: "workflow/rules/common.smk"
include: "workflow/rules/cases.smk"
include: "workflow/rules/weights.smk"
include: "workflow/rules/quantize.smk"
include: "workflow/rules/prompts.smk"
include: "workflow/rules/import.smk"
include: "workflow/rules/golden.smk"
include: "workflow/rules/noise.smk"
include: "workflow/rules/convention.smk"
include: "workflow/rules/bundles.smk"
include: "workflow/rules/engines.smk"
include: "workflow/rules/format_effect.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/mutation_setup.smk"
include: "workflow/rules/mutation.smk"  # off by default: `snakemake mutation_report` (docs/mutants.md)


# Every stage's output is a target, not only the report: Snakemake rebuilds a missing file only where
# something requested needs it, and the report being up to date would hide a deleted run, golden,
# bundle or weights directory ("Nothing to be done"). As targets, deleting one reruns it and, where its
# bytes changed, what reads it.
rule all:
    default_target: True
    input:
        expand(case_json(), model=MODELS),
        expand(weights_dir(), model=MODELS, precision=PRECISIONS),
        expand(compressed_tensors_dir(), model=MODELS),
        expand(prompts_json(), model=MODELS, precision=PRECISIONS),
        expand(bundle_kdtr(), model=MODELS, precision=PRECISIONS),
        [engine_stamp(e) for e in sorted({run[0] for run in RUNS}) if ENGINES[e]["build"]],
        rules.report.input,
        rules.report.output,
        rules.strict_gate.output if config["report"]["strict"] else [],


include: "workflow/rules/slurm.smk"  # last: partitions for every rule declared above


onsuccess:
    workflow_setup.print_summary(rules.report.output.summary, STARTED)
    workflow_setup.cancel_timers()


onerror:
    workflow_setup.cancel_timers()


# What the parse made (Snakemake's modules, this workflow's rules and config) lives as long as this process:
# frozen, the collections while Snakemake builds the DAG and finishes jobs, and the last one as Python exits,
# skip it (every `snakemake` call, a no-op dry run included: bench/RESULTS.md). New objects are collected as before.
gc.freeze()
