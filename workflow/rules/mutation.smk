# The mutation run (docs/mutants.md), off by default: `snakemake mutation_report`. Every mutant of the
# catalogue (k2vec.mutation.catalogue) is the numpy engine with that fault injected through its hook
# (k2vec.mutation.engine), run with the numpy engine's settings through the same runner on the same bundles, on each of the numpy engine's runs that executes its code path; the
# report's code judges them beside the unmutated engine's own runs (the false-alarm check). One job per
# (mutant, model, precision) runs its modes one after the other: fewer Snakemake jobs, same engine runs.


rule mutant_runs:
    input:
        mutation_ready,
        sources=lambda wc: engine_sources("numpy"),
        bundle=bundle_kdtr(),
    output:
        directory(mutant_runs_dir()),
    log:
        runner="results/logs/mutation/{compute}/{mutant}/{model}-{precision}.log",
        engine="results/logs/mutation/{compute}/{mutant}/{model}-{precision}.engine.log",  # every mode's stderr, in turn
    benchmark:
        "results/benchmarks/mutation/{compute}/{mutant}/{model}-{precision}.tsv"
    wildcard_constraints:
        mutant="|".join([*MUTANTS, UNMUTATED]),
        compute="|".join(["float32", *FORMATS]),
    conda:
        "../envs/pipeline.yaml"
    params:
        code=mutant_code,
        engine=lambda wc: {
            **engine_settings("numpy"),
            "command": mutant_command(wc.mutant, wc.compute),
        },
        name=lambda wc: mutant_engine(wc.mutant, wc.compute),
        modes=mutant_modes,
        devices=GPU_DEVICES,
        lock_dir=config["gpus"]["lock_dir"],
        scratch="results/scratch/mutants/{compute}/{mutant}/{model}-{precision}",
    script:
        "../scripts/mutant_runs.py"


rule mutation_report:
    input:
        mutation_ready,
        control=[run_result(*run) for run in RUNS if run[0] == "numpy"],
        mutants=[mutant_runs_dir(mu, m, p, c) for mu, m, p, c in MUTATION_PLAN],
        noise=[noise_kdtr(c, p, m) for m, p, c in MUTATION_NOISE],
        noise_sha256=[sha256_of(noise_kdtr(c, p, m)) for m, p, c in MUTATION_NOISE],
        goldens=expand(golden_kdtr(), model=MODELS, precision=PRECISIONS),
        golden_sha256=expand(sha256_of(golden_kdtr()), model=MODELS, precision=PRECISIONS),
    output:
        html="results/mutation/mutation.html",
        csv="results/mutation/mutation.csv",
        rows_csv="results/mutation/mutation_rows.csv",
        resolution_csv=MUTATION_RESOLUTION,
    log:
        "results/logs/mutation_report.log",
    benchmark:
        "results/benchmarks/mutation_report.tsv"
    conda:
        "../envs/report.yaml"
    params:
        code=stage_code("mutation_report.py", "k2vec.mutation.score", "k2vec.pipeline.stage"),
        runs=[run_record(*run) for run in RUNS if run[0] == "numpy"] + mutant_records(),
        mutants={
            mutant_engine(mu, c): {
                "name": mu,
                "precision": c,
                "area": MUTANTS[mu].area,
                "changes": MUTANTS[mu].changes,
                "stands_for": MUTANTS[mu].stands_for,
            }
            for mu, c in sorted({(k[0], k[3]) for k in MUTATION_PLAN if k[0] != UNMUTATED})
        },
        # the unmutated engine per compute precision: the false-alarm check
        controls={"float32": "numpy", **{c: mutant_engine(UNMUTATED, c) for _, _, c in MUTATION_NOISE}},
        noise={f"{m}/{p}/{c}": noise_kdtr(c, p, m) for m, p, c in MUTATION_NOISE},
        noise_rule=config["report"].get("noise", {}),
        goldens={f"{m}/{p}": golden_kdtr(p, m) for m in MODELS for p in PRECISIONS},
        near_tie=config["report"]["near_tie"],
        router_near_tie=config["report"]["router_near_tie"],
        fingerprint_rtol=config["report"]["fingerprint_rtol"],
        budgets=config["report"].get("budgets", {}),
    script:
        "../scripts/mutation_report.py"
