"""The mutation run's plan: which mutant runs on which bundle, in which modes."""

from __future__ import annotations

from typing import Mapping

from k2vec.engines.contract.modes import parse_mode
from k2vec.mutation.catalogue import MUTANTS


def plan(config: Mapping, engines: Mapping[str, Mapping], runs, cases: Mapping[str, Mapping],
         control: str = "numpy") -> tuple[dict[tuple[str, str, str], list[str]], str | None]:
    """The mutation run: {(mutant, model, precision): modes}, one entry per mutant and bundle whose runs of
    the `control` engine (`runs`: the pipeline's (engine, model, precision, mode) list) execute the
    mutant's code path; and a problem (a message naming the config key) when it cannot run, else None."""
    wanted = (config.get("mutation") or {}).get("mutants", "all")
    if control not in engines:
        return {}, f"config key 'engines.{control}': the mutation run needs the numpy engine (its mutants are it)"
    names = list(MUTANTS) if wanted == "all" else list(wanted)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        return {}, (f"config key 'mutation.mutants': unknown mutant(s) {', '.join(unknown)}; "
                    f"the catalogue (docs/mutants.md): {', '.join(MUTANTS)}")
    out: dict[tuple[str, str, str], list[str]] = {}
    for name in names:
        mutant = MUTANTS[name]
        for engine, model, precision, mode in runs:
            kind, budget = parse_mode(mode)
            case = cases[model]
            if engine == control and mutant.exercised(case["model"], case["quantization"], precision, kind, budget):
                out.setdefault((name, model, precision), []).append(mode)
    return out, None


def mutant_command(name: str) -> str:
    """The engine command of mutant `name`: the numpy engine through the catalogue's hook, one BLAS
    thread as the numpy engine's own command runs it (config.yaml)."""
    return (f"OPENBLAS_NUM_THREADS=1 {{python}} -m k2vec.mutation.engine --mutant {name} "
            "--bundle {bundle} --mode {mode} --budget {budget} --output {output}")
