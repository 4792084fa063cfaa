# Included last: every rule without a partition of its own (engine_run picks one per engine) gets
# config `slurm.partition` as its `slurm_partition` resource, which only the SLURM executor plugin
# reads (profiles/slurm). A partition given on the command line (--default-resources or
# --set-resources slurm_partition=...) is already set here and wins.
if config["slurm"]["partition"] is not None:
    for _rule in workflow.rules:
        _rule.resources.setdefault("slurm_partition", slurm_partition(0))


# Rules that only write a few JSON bytes run in the main Snakemake process, not as cluster jobs
# (which would wait in the queue and start a Python on a node each). Local runs are unaffected.
localrules:
    case_section,
    case,
    strict_gate,
