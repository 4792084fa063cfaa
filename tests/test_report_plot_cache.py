"""The report's plot cache (k2vec/report/plot_cache.py): a report whose plots did not change draws none and writes
the same bytes; a changed input, changed drawing code or a damaged entry draws again."""
from dataclasses import dataclass

import numpy as np
import pytest

from test_report_metrics import flip, make_goldens

from k2vec.kdtr import open_bundle
from k2vec.report import build_report, plot_cache, plots
from k2vec.report.figures import PLOTS
from support.synthetic import perfect_result, write_result

PLOT_FUNCTIONS = ["match_grid", "logit_error", "first_bad_layer", "acceptance", "format_effect", "score_kl"]


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("plot-cache-goldens"))


@pytest.fixture
def runs(tmp_path, goldens):
    fp32 = goldens[("tiny", "fp32")]
    with open_bundle(fp32) as b:
        gold = {k: np.array(b[k]) for k in b.keys()}
    bad = perfect_result(fp32, "greedy")
    flip(bad, 1, 4, gold)
    out = []
    for engine, mode, result in [("good", "greedy", perfect_result(fp32, "greedy")), ("bad", "greedy", bad),
                                 ("tree", "ddtree-b4", perfect_result(fp32, "ddtree-b4"))]:
        path = write_result(tmp_path / f"{engine}.json", result)
        out.append({"engine": engine, "model": "tiny", "precision": "fp32", "mode": mode, "result": str(path)})
    return out


def _count_draws(monkeypatch) -> dict[str, int]:
    drawn = {name: 0 for name in PLOT_FUNCTIONS}
    for name in PLOT_FUNCTIONS:
        real = getattr(plots, name)

        def counted(*args, _real=real, _name=name):
            drawn[_name] += 1
            return _real(*args)

        monkeypatch.setattr(plots, name, counted)
    return drawn


@dataclass(frozen=True)
class Case:
    name: str
    change: str      # what happens between the first report and the second
    redrawn: int     # plots drawn by the second


CASES = [
    Case("nothing changed", "none", 0),
    Case("a damaged entry", "damage", 1),
    Case("the drawing code changed", "code", 6),
    Case("one more greedy run (the DDTree and format plots stay)", "run", 4),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_second_report_draws_only_what_changed(tmp_path, goldens, runs, monkeypatch, case):
    cache = tmp_path / "cache"
    first = build_report(runs, goldens, tmp_path / "a", cache=cache)
    fresh = build_report(runs, goldens, tmp_path / "fresh")   # no cache: every plot drawn
    entries = sorted(cache.glob("*.png"))
    assert len(entries) == len(PLOTS)
    second_runs = runs
    if case.change == "damage":
        entries[0].write_bytes(entries[0].read_bytes()[:-1] + b"\0")
    elif case.change == "code":
        monkeypatch.setattr(plot_cache, "_code_key", lambda: "another drawing code")
    elif case.change == "run":
        second_runs = runs + [{**runs[0], "engine": "again"}]
    drawn = _count_draws(monkeypatch)
    second = build_report(second_runs, goldens, tmp_path / "b", cache=cache)
    assert sum(drawn.values()) == case.redrawn, drawn
    if case.change != "run":
        for name in PLOTS:   # the bytes a fresh drawing gives
            assert (second.paths["html"].parent / name).read_bytes() == (fresh.paths["html"].parent / name).read_bytes()
        assert second.paths["html"].read_bytes() == first.paths["html"].read_bytes()
    assert len(list(cache.glob("*.png"))) == len(PLOTS)   # only the last report's entries are kept


def test_the_plot_code_list_holds_every_module_the_plots_import():
    """PLOT_CODE (the code a cached plot is keyed by) is closed under the package imports of its modules, parent
    packages aside: a module a plot imports, left out of it, would keep a stale plot after an edit."""
    import ast

    for path in plot_cache.plot_code_files():
        tree = ast.parse(open(path).read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                    and n.module.startswith("k2vec")}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                     if a.name.startswith("k2vec")}
        assert imported <= set(plot_cache.PLOT_CODE), (path, imported - set(plot_cache.PLOT_CODE))
