# Engine runs (docs/engine-contract.md): an optional build per engine, then one run per
# (engine, model, precision, mode), each wrapped by k2vec.engines.runner: time limit, GPU lease,
# and a result file whatever happens. A batch engine (a command with {batch}) makes every run of a
# bundle in one job and one process (rule engine_batch_<engine>), each run still with its own limit and result. An engine's sources are declared by its own jobs only (other
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
    wildcard_constraints:
        engine="|".join(e for e in ENGINES if e not in BATCH_ENGINES) or "^$",
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
        name="{engine}",
        modes=[],  # one run: its {mode}
        # the engine's working directory, removed after an ok run (docs/engine-contract.md section 2)
        scratch="results/scratch/{engine}/{model}-{precision}-{mode}",
    script:
        "../scripts/engine_run.py"


for _engine in BATCH_ENGINES:

    rule:
        name:
            f"engine_batch_{_engine}"
        input:
            unpack(of_engine(engine_inputs, _engine)),
            bundle=bundle_kdtr(),
        output:
            [run_result(_engine, mode=mode) for mode in ENGINE_MODES[_engine]],
        log:
            engine=f"results/logs/runs/{_engine}/{{model}}-{{precision}}.engine.log",
            runner=f"results/logs/runs/{_engine}/{{model}}-{{precision}}.log",
        benchmark:
            f"results/benchmarks/runs/{_engine}/{{model}}-{{precision}}.tsv"
        conda:
            "../envs/pipeline.yaml"
        resources:
            gpu=ENGINES[_engine]["gpus"],
            gpu_model=of_engine(lambda e: config["slurm"]["gpu_model"] if ENGINES[e]["gpus"] else None, _engine),
            slurm_partition=of_engine(lambda e: slurm_partition(ENGINES[e]["gpus"]), _engine),
        params:
            code=engine_code(
                "engine_run.py", "k2vec.engines.runner", "k2vec.kdtr", "k2vec.pipeline.stage", engine=_engine
            ),
            engine=engine_settings(_engine),
            name=_engine,
            # the runs' modes, in the order of the outputs
            modes=ENGINE_MODES[_engine],
            scratch=f"results/scratch/{_engine}/{{model}}-{{precision}}",
        script:
            "../scripts/engine_run.py"
