"""The mutation run's plan: which mutant runs on which bundle, in which modes, at which compute precision."""

from __future__ import annotations

from typing import Mapping

from k2vec.engines.contract.modes import parse_mode
from k2vec.mutation.catalogue import MUTANTS

# The unmutated numpy engine at a reduced precision: the false-alarm check of that precision's mutants
# (at float32 the pipeline's own numpy runs are it).
UNMUTATED = "unmutated"
DEFAULT_PRECISIONS = ("float32", "bfloat16")
# At a reduced precision every mutant runs its score runs (every position compared); a DDTree mutant changes
# the tree, not the arithmetic, so it (and the unmutated engine beside it) runs DDTree and greedy there too.
REDUCED_KINDS = ("score",)
TREE_AREA = "ddtree"


def plan(config: Mapping, engines: Mapping[str, Mapping], runs, cases: Mapping[str, Mapping],
         control: str = "numpy") -> tuple[dict[tuple[str, str, str, str], list[str]], str | None]:
    """The mutation run: {(mutant, model, precision, compute precision): modes}, one entry per mutant, bundle
    and compute precision (`mutation.precisions`) whose runs of the `control` engine (`runs`: the pipeline's
    (engine, model, precision, mode) list) execute the mutant's code path, plus the unmutated engine's
    entries at each reduced precision; and a problem (a message naming the config key) when it cannot run,
    else None. At a reduced precision score runs are planned (REDUCED_KINDS: they compare every position, and
    the mutation run stays within its time), plus, with DDTree mutants, their DDTree and greedy runs and the
    unmutated engine's, whose verdict at that precision is the false-alarm check of theirs."""
    settings = config.get("mutation") or {}
    wanted = settings.get("mutants", "all")
    computes = list(settings.get("precisions", DEFAULT_PRECISIONS))
    if control not in engines:
        return {}, f"config key 'engines.{control}': the mutation run needs the numpy engine (its mutants are it)"
    names = list(MUTANTS) if wanted == "all" else list(wanted)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        return {}, (f"config key 'mutation.mutants': unknown mutant(s) {', '.join(unknown)}; "
                    f"the catalogue (docs/mutants.md): {', '.join(MUTANTS)}")
    # at a reduced precision: score runs; with DDTree mutants, DDTree runs and greedy runs too, the reference
    # of the lossless check (report/lossless.py), for the mutants and the unmutated engine alike
    tree = any(MUTANTS[n].area == TREE_AREA for n in names)
    reduced_kinds = REDUCED_KINDS + (("ddtree", "greedy") if tree else ())
    control_modes: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for engine, model, precision, mode in runs:
        if engine == control:
            control_modes.setdefault((model, precision), []).append(parse_mode(mode))

    def runs_mutant(name: str, model: str, precision: str, kind: str, budget: int) -> bool:
        m, case = MUTANTS[name], cases[model]
        if m.exercised(case["model"], case["quantization"], precision, kind, budget):
            return True
        # a DDTree mutant's greedy run (its code path unused there) where it runs DDTree: an engine's own
        # greedy run is what its DDTree tokens must equal
        return m.area == TREE_AREA and kind == "greedy" and any(
            m.exercised(case["model"], case["quantization"], precision, k, b)
            for k, b in control_modes[(model, precision)])

    out: dict[tuple[str, str, str, str], list[str]] = {}
    for compute in computes:
        reduced = compute != "float32"
        for engine, model, precision, mode in runs:
            kind, budget = parse_mode(mode)
            if engine != control or (reduced and kind not in reduced_kinds):
                continue
            if reduced:
                out.setdefault((UNMUTATED, model, precision, compute), []).append(mode)
            for name in names:
                if reduced and kind not in REDUCED_KINDS and MUTANTS[name].area != TREE_AREA:
                    continue
                if runs_mutant(name, model, precision, kind, budget):
                    out.setdefault((name, model, precision, compute), []).append(mode)
    return out, None


def mutant_command(name: str, compute: str = "float32") -> str:
    """The engine command of mutant `name` at `compute`: the numpy engine through the catalogue's hook (or
    unhooked, for UNMUTATED), emulating `compute` unless float32, one BLAS thread as the numpy engine's own
    command runs it (config.yaml)."""
    precision = "" if compute == "float32" else f" --precision {compute}"
    module = "k2vec.engines.numpy_engine" if name == UNMUTATED else f"k2vec.mutation.engine --mutant {name}"
    return (f"OPENBLAS_NUM_THREADS=1 {{python}} -m {module}{precision} "
            "--bundle {bundle} --mode {mode} --budget {budget} --output {output}")
