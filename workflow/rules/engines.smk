# Engine runs (docs/engine-contract.md): an optional build per engine, then one run per
# (engine, model, precision, mode), each wrapped by k2vec.engines.runner: time limit, GPU lease,
# and a result file whatever happens. An engine's sources are declared by its own jobs only (other
# files as inputs, Python files by meaning: common.smk engine_code), so editing a kernel reruns
# exactly that engine's runs and the report.


rule engine_build:
    input:
        sources=lambda wc: engine_sources(wc.engine),
    output:
        engine_stamp(),
    log:
        "results/logs/engines/{engine}/build.log",
    benchmark:
        "results/benchmarks/engines/{engine}/build.tsv"
    conda:
        "../envs/pipeline.yaml"
    params:
        code=engine_code("engine_build.py", "k2vec.engines.build", "k2vec.pipeline.stage"),
        # every source, Python ones included, hashed into the stamp
        sources=lambda wc: engine_source_paths(wc.engine),
        command=lambda wc: ENGINES[wc.engine]["build"],
        timeout_s=lambda wc: ENGINES[wc.engine]["build_timeout_s"],
    script:
        "../scripts/engine_build.py"


rule engine_run:
    input:
        unpack(engine_run_inputs),
        bundle=bundle_kdtr(),
    output:
        run_result(),
    log:
        engine="results/logs/runs/{engine}/{model}-{precision}-{mode}.engine.log",
        runner="results/logs/runs/{engine}/{model}-{precision}-{mode}.log",
    benchmark:
        "results/benchmarks/runs/{engine}/{model}-{precision}-{mode}.tsv"
    conda:
        "../envs/pipeline.yaml"
    resources:
        gpu=lambda wc: ENGINES[wc.engine]["gpus"],
        # Read only by the SLURM executor plugin (profiles/slurm): `gpu` and `gpu_model` become
        # sbatch --gpus=<model>:<n>, slurm_partition -p; None leaves the option out.
        gpu_model=lambda wc: config["slurm"]["gpu_model"] if ENGINES[wc.engine]["gpus"] else None,
        slurm_partition=lambda wc: slurm_partition(ENGINES[wc.engine]["gpus"]),
    params:
        # the runner's code and the engine's Python sources (its other sources are inputs)
        code=engine_code("engine_run.py", "k2vec.engines.runner", "k2vec.kdtr", "k2vec.pipeline.stage"),
        # The engine's own settings only: changing another engine's settings reruns nothing here.
        engine=lambda wc: engine_settings(wc.engine),
        # the engine's working directory, removed after an ok run (docs/engine-contract.md section 2)
        scratch="results/scratch/{engine}/{model}-{precision}-{mode}",
    script:
        "../scripts/engine_run.py"
