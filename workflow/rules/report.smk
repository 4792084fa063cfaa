# The divergence report (docs in src/k2vec/report): every engine run judged against the golden
# data, and the fp32 golden against the int4 one. With `report.strict: true` the `strict_gate`
# rule fails the pipeline on a real divergence or a failed run, after the report is written (and, with
# `report.fail_on_left_out: true`, on a configured engine that got no run). Runs
# whose result, bundle or golden changed after they ran are shown as `changed`, not judged.


rule report:
    input:
        results=[run_result(*run) for run in RUNS],
        format_effect=expand(format_effect_json(), model=MODELS),
        goldens=expand(golden_kdtr(), model=MODELS, precision=PRECISIONS),
        # checked by the report, with each result's own record and the bundle it used (report/integrity.py)
        golden_sha256=expand(sha256_of(golden_kdtr()), model=MODELS, precision=PRECISIONS),
        noise=[noise_kdtr(c, p, m) for m, p, c in NOISE_MODELS],
        noise_sha256=[sha256_of(noise_kdtr(c, p, m)) for m, p, c in NOISE_MODELS],
        conventions=[convention_kdtr(v, p, m) for m, p, v in CONVENTION_VARIANTS],
        conventions_sha256=[sha256_of(convention_kdtr(v, p, m)) for m, p, v in CONVENTION_VARIANTS],
    output:
        html=report("results/report/divergence.html", caption="../report/divergence.rst", category="Divergence"),
        csv=report("results/report/divergence.csv", caption="../report/divergence_csv.rst", category="Divergence"),
        format_csv="results/report/format_effect.csv",
        score_csv="results/report/score.csv",
        resolution_csv="results/report/resolution.csv",
        summary="results/report/summary.txt",
        # each configured engine: ran, or left out and why (read by strict_gate under report.fail_on_left_out)
        engines_csv="results/report/engines.csv",
        plots=report(
            expand("results/report/{plot}.png", plot=REPORT_PLOTS),
            caption="../report/plots.rst",
            category="Plots",
        ),
    log:
        "results/logs/report.log",
    benchmark:
        "results/benchmarks/report.tsv"
    conda:
        "../envs/report.yaml"
    params:
        code=stage_code("report.py", "k2vec.report", "k2vec.pipeline.stage"),
        runs=[run_record(*run) for run in RUNS] + [format_effect_record(m) for m in MODELS],
        goldens={f"{m}/{p}": golden_kdtr(p, m) for m in MODELS for p in PRECISIONS},
        noise={f"{m}/{p}/{c}": noise_kdtr(c, p, m) for m, p, c in NOISE_MODELS},
        conventions={f"{m}/{p}/{v}": convention_kdtr(v, p, m) for m, p, v in CONVENTION_VARIANTS},
        near_tie=config["report"]["near_tie"],
        router_near_tie=config["report"]["router_near_tie"],
        fingerprint_rtol=config["report"]["fingerprint_rtol"],
        budgets=config["report"].get("budgets", {}),
        noise_rule=config["report"].get("noise", {}),
        left_out=LEFT_OUT,
        fail_on_left_out=config["report"]["fail_on_left_out"],
        float32_engines=FLOAT32_ENGINES,
        mutation_resolution=MUTATION_RESOLUTION,
        mutation_resolution_sha256=MUTATION_RESOLUTION_SHA256,
        # made by the first engine run (k2vec.engines.runner); not an input: nothing reruns on it
        integrity_key=str(integrity_key_path("results")),
        # what a later report reuses: plots, by what they show and the code that draws them
        # (k2vec/report/plot_cache.py), and the parses of the results, by their bytes, most of them put there
        # by the runner as it wrote the result (k2vec/engines/contract/result_cache.py)
        cache=str(report_cache_dir("results")),
    script:
        "../scripts/report.py"


rule strict_gate:
    input:
        csv=rules.report.output.csv,
        engines_csv=rules.report.output.engines_csv,
    output:
        "results/report/strict.ok",
    log:
        "results/logs/strict_gate.log",
    benchmark:
        "results/benchmarks/strict_gate.tsv"
    conda:
        "../envs/report.yaml"
    params:
        code=stage_code("strict_gate.py", "k2vec.report.gate", "k2vec.pipeline.stage"),
        fail_on_left_out=config["report"]["fail_on_left_out"],
    script:
        "../scripts/strict_gate.py"
