"""The report's result cache (k2vec/engines/contract/result_cache.py): a second report parses only the results whose
bytes changed, writes the same outputs as a report without a cache, and keeps only its own entries; a report whose plots
are all cached does not load matplotlib."""
import json
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from test_report_plot_cache import goldens, runs  # noqa: F401  (fixtures)

from conftest import REPO
from k2vec.engines.contract import result_cache
from k2vec.report import build_report

OUTPUTS = ("divergence.csv", "divergence.html", "summary.txt", "score.csv")


@dataclass(frozen=True)
class Case:
    name: str
    change: str      # what happens between the first report and the second
    parsed: int      # results the second report parses from their JSON


CASES = [
    Case("nothing changed", "none", 0),
    Case("a damaged entry", "damage", 1),
    Case("one result rewritten with other bytes", "rewrite", 1),
    Case("one result unreadable", "garble", 1),
]


def _count_parses(monkeypatch) -> list[int]:
    parsed = [0]

    def counted(data):
        parsed[0] += 1
        return json.loads(data)

    monkeypatch.setattr(result_cache, "json", SimpleNamespace(loads=counted))
    return parsed


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_second_report_parses_only_what_changed(tmp_path, goldens, runs, monkeypatch, case):  # noqa: F811
    cache = tmp_path / "cache"
    build_report(runs, goldens, tmp_path / "a", cache=cache)
    entries = sorted(cache.glob("*.marshal"))
    assert len(entries) == len(runs)
    if case.change == "damage":
        entries[0].write_bytes(entries[0].read_bytes()[:-1] + b"\0")
    elif case.change == "rewrite":   # same content, other bytes: a new key, the old entry pruned
        path = runs[0]["result"]
        with open(path) as fh:
            data = json.load(fh)
        with open(path, "w") as fh:
            json.dump(data, fh, indent=1)
    elif case.change == "garble":
        with open(runs[0]["result"], "w") as fh:
            fh.write("{not json")
    parsed = _count_parses(monkeypatch)
    second = build_report(runs, goldens, tmp_path / "b", cache=cache)
    assert parsed[0] == case.parsed, parsed
    fresh = build_report(runs, goldens, tmp_path / "fresh")   # no cache: every result parsed
    for name in OUTPUTS:
        assert (second.paths["html"].parent / name).read_bytes() == (fresh.paths["html"].parent / name).read_bytes()
    assert len(list(cache.glob("*.marshal"))) == len(runs) - (case.change == "garble")
    changed = second.rows[second.rows["engine"] == runs[0]["engine"]]
    assert (changed["status"] == "ok").all() == (case.change in ("none", "damage")), changed["status"].tolist()


def test_a_report_with_its_plots_cached_does_not_load_matplotlib(tmp_path, goldens, runs):  # noqa: F811
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"runs": runs, "goldens": [[m, p, str(v)] for (m, p), v in goldens.items()]}))
    script = ("import json, sys; from k2vec.report import build_report; s = json.load(open(sys.argv[1])); "
              "build_report(s['runs'], {(m, p): v for m, p, v in s['goldens']}, sys.argv[2], cache=sys.argv[3]); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    loaded = []
    for out in ("a", "b"):   # the first draws the plots, the second finds them all in the cache
        res = subprocess.run([sys.executable, "-c", script, str(spec), str(tmp_path / out), str(tmp_path / "cache")],
                             capture_output=True, text=True,
                             env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        loaded.append(res.stdout.strip() != "[]")
    assert loaded == [True, False]
    assert (tmp_path / "b" / "divergence.html").read_bytes() == (tmp_path / "a" / "divergence.html").read_bytes()
