"""divergence.html: self-contained, every table and plot present, and rendered by headless Chromium.

The Chromium tests skip when no chromium binary is installed (CI installs it with apt). Set
K2VEC_REPORT_SCREENSHOT=/some/path.png to keep the screenshot.
"""

import base64
import re
import os
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from test_report_metrics import flip, make_goldens

from k2vec.kdtr import open_bundle
from k2vec.report import OUTPUTS, build_report
from k2vec.report.figures import PLOTS
from support.synthetic import perfect_result, write_result

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or \
    ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
PLOT_IDS = [fid for fid, _ in PLOTS.values()]


class _Dom(HTMLParser):
    """Elements by id, and every <img> with the id of the nearest enclosing element that has one."""

    def __init__(self):
        super().__init__()
        self.ids, self.imgs, self.stack, self.tags = {}, [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if "id" in a:
            self.ids[a["id"]] = tag
        if tag == "img":
            self.imgs.append((next((i for i in reversed(self.stack) if i), None), a))
        elif tag not in ("meta", "br", "link", "input"):
            self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if tag != "img" and self.stack:
            self.stack.pop()


def parse(text: str) -> _Dom:
    d = _Dom()
    d.feed(text)
    return d


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    return make_goldens(tmp_path_factory.mktemp("report-goldens"))   # shared with test_report_metrics


@pytest.fixture(scope="module")
def report(tmp_path_factory, goldens):
    root = tmp_path_factory.mktemp("report-html")
    fp32 = goldens[("tiny", "fp32")]
    with open_bundle(fp32) as b:
        gold = {k: np.array(b[k]) for k in b.keys()}
    results = {"good greedy": ("greedy", perfect_result(fp32, "greedy"))}
    bad = perfect_result(fp32, "greedy")
    flip(bad, 1, 4, gold)
    results["flipped"] = ("greedy", bad)
    tree = perfect_result(fp32, "ddtree-b4")
    rnd = tree["runs"][0]["prompts"][0]["rounds"][0]
    rnd["tokens"][1] += 1
    results["tree"] = ("ddtree-b4", tree)
    results["crash"] = ("ddtree-b1", {"format": "k2vec-engine-result", "version": 1, "status": "failed",
                                      "reason": "timed out after 600 s (killed)", "stderr_tail": "step 3 ...",
                                      "runs": []})
    runs = []
    for engine, (mode, res) in results.items():
        path = root / f"{engine.replace(' ', '_')}.json"
        write_result(path, res)
        runs.append({"engine": engine, "model": "tiny", "precision": "fp32", "mode": mode, "result": str(path)})
    return build_report(runs, goldens, root / "out")


def test_outputs_are_written_and_plots_embedded(report):
    for key, name in OUTPUTS.items():
        assert report.paths[key] == report.paths["html"].parent / name and report.paths[key].stat().st_size > 0
    text = report.paths["html"].read_text()
    dom = parse(text)
    for fid in ["verdict", "summary-text", "summary-table", "divergence-table", "tree-table", "failure-table",
                "format-effect", "format-model-table", "format-table", *PLOT_IDS]:
        assert fid in dom.ids, fid
    by_figure = {fid: a for fid, a in dom.imgs}
    assert sorted(by_figure) == sorted(PLOT_IDS)
    for name, (fid, _) in PLOTS.items():
        src = by_figure[fid]["src"]
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        w, h = png_size(data)
        assert w > 100 and h > 50
        assert data == (report.paths["html"].parent / name).read_bytes()   # the standalone PNG is the same
    # self-contained: no external stylesheet, script or image
    assert "<link" not in text and "<script" not in text and 'src="http' not in text
    # summary table: one body row per run x accuracy (greedy 1, ddtree-b4 2, failed ddtree-b1 2, greedy 1)
    summary = text.split('id="summary-table"', 1)[1].split("</table>", 1)[0]
    assert summary.count("<tr>") - 1 == len(report.runs) == 6
    assert "timed out after 600 s (killed)" in summary
    assert "<h2>FAIL: real 1, failed 4, tree differs 1</h2>" in text and report.strict_problem is not None
    div = text.split('id="divergence-table"', 1)[1].split("</table>", 1)[0]
    assert div.count("<tr>") - 1 == 1 and "flipped" in div


def render_in_chromium(html: Path, tmp_path: Path) -> np.ndarray:
    """Load `html` in headless Chromium: check the summary table and that every plot decoded, then
    take a screenshot; return its pixels (and keep it at $K2VEC_REPORT_SCREENSHOT if set)."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2000"]
    # a copy with a probe that records each image's decoded size in the DOM once the page has loaded
    probe = tmp_path / "probe.html"
    probe.write_text(html.read_text().replace("</body>", (
        "<script>window.addEventListener('load', () => { document.querySelectorAll('img').forEach("
        "i => i.setAttribute('data-natural', i.naturalWidth + 'x' + i.naturalHeight)); "
        "document.body.setAttribute('data-probed', 'yes'); });</script></body>")))
    out = subprocess.run([*flags, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = parse(out.stdout)
    assert any(t == "body" and a.get("data-probed") == "yes" for t, a in dom.tags)   # the probe ran
    assert "summary-table" in dom.ids
    seen = {fid: a.get("data-natural") for fid, a in dom.imgs}
    assert sorted(seen) == sorted(PLOT_IDS)
    for fid, size in seen.items():
        w, h = (int(v) for v in size.split("x"))
        assert w > 100 and h > 50, (fid, size)

    shot = tmp_path / "report.png"
    out = subprocess.run([*flags, f"--screenshot={shot}", html.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[:2] == (2000, 1400)
    assert img[..., :3].std() > 0.05                          # not a blank page
    if os.environ.get("K2VEC_REPORT_SCREENSHOT"):
        shutil.copy(shot, os.environ["K2VEC_REPORT_SCREENSHOT"])
    return img[..., :3]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_chromium_renders_every_plot_and_a_nonblank_page(report, tmp_path):
    assert "divergence-table" in parse(report.paths["html"].read_text()).ids
    rgb = render_in_chromium(report.paths["html"], tmp_path)
    red = (rgb[..., 0] > 0.8) & (rgb[..., 1] < 0.35) & (rgb[..., 2] < 0.35)
    assert red.sum() > 200                                    # the verdict bar and the "real" badges


def test_cli_and_snakemake_entry_points(report, goldens, tmp_path):
    from k2vec.pipeline.stage import stage_logging
    from k2vec.report import main, write_report
    from k2vec.report.gate import StrictFailure

    good = [r for r in report.rows.drop_duplicates("run").itertuples() if r.engine == "good greedy"][0]
    args = ["--out", str(tmp_path / "cli"), "--run", "good", "tiny", "fp32", "greedy", good.result]
    for (model, precision), path in goldens.items():
        args += ["--golden", model, precision, str(path)]
    assert main(args + ["--strict"]) == 0 and (tmp_path / "cli" / "divergence.html").exists()
    crash = [r for r in report.rows.drop_duplicates("run").itertuples() if r.engine == "crash"][0]
    assert main(args + ["--run", "crash", "tiny", "fp32", "ddtree-b1", crash.result]) == 0
    assert main(args + ["--strict", "--run", "crash", "tiny", "fp32", "ddtree-b1", crash.result]) == 1
    assert main(["--out", str(tmp_path / "x"), "--run", "good", "tiny", "int4", "greedy", good.result]) == 2

    # rule report's script: the rule's params as plain arguments, inside the stage's log
    out = tmp_path / "smk" / "divergence.html"
    runs = [{"engine": "good", "model": "tiny", "precision": "fp32", "mode": "greedy", "result": good.result}]
    golden_params = {f"{m}/{p}": str(v) for (m, p), v in goldens.items()}
    with stage_logging(str(tmp_path / "report.log"), "report"):
        res = write_report(runs, golden_params, out.parent, strict=True)
    assert res.paths["html"] == out and all(p.exists() for p in res.paths.values())
    log = (tmp_path / "report.log").read_text()
    assert "stage report done" in log and res.summary.splitlines()[0] in log
    runs.append({"engine": "crash", "model": "tiny", "precision": "fp32", "mode": "ddtree-b1", "result": crash.result})
    assert write_report(runs, golden_params, tmp_path / "lax").strict_problem  # strict=False: no raise
    with pytest.raises(StrictFailure, match="strict"):
        write_report(runs, golden_params, out.parent, strict=True)


@pytest.fixture(scope="module")
def one_engine_report(tmp_path_factory, goldens):
    """One greedy run of one engine with a long name, diverging on every prompt (the golden's second
    choice taken at step 2)."""
    root = tmp_path_factory.mktemp("report-one")
    fp32 = goldens[("tiny", "fp32")]
    with open_bundle(fp32) as b:
        gold = {k: np.array(b[k]) for k in b.keys()}
    res = perfect_result(fp32, "greedy")
    for p in range(len(res["runs"][0]["prompts"])):
        flip(res, p, 2, gold)
    write_result(root / "run.json", res)
    runs = [{"engine": "vendor_engine_bfloat16_experimental", "model": "tiny", "precision": "fp32",
             "mode": "greedy", "result": str(root / "run.json")}]
    return build_report(runs, goldens, root / "out"), gold


def test_counts_are_singular_for_one(one_engine_report):
    from k2vec.report.words import plural

    rep, _ = one_engine_report
    assert rep.summary.startswith("k2vec divergence report: 1 run, 1 engine, ")
    text = rep.paths["html"].read_text()
    assert '<p class="sub">1 engine run, ' in text
    plurals_of_one = re.findall(r"\b1 (?:runs|engines|engine runs|rows|prompts|traces|trees)\b", rep.summary + text)
    assert plurals_of_one == []
    assert [plural(n, "engine") for n in (0, 1, 2, 1000)] == ["0 engines", "1 engine", "2 engines", "1,000 engines"]
    assert (plural(1, "row exceeds", "rows exceed") == "1 row exceeds"
            and plural(3, "row exceeds", "rows exceed") == "3 rows exceed")


def test_ranks_are_one_based_and_token_ids_plain(one_engine_report):
    from k2vec.report.html import fmt

    rep, gold = one_engine_report
    # the engine took the golden's second choice, and ranked it first: both ranks are "second place"
    assert "golden's ranked #2 by the engine, engine's #2 by the golden" in rep.summary
    assert "#1" not in rep.summary
    div = rep.paths["html"].read_text().split('id="divergence-table"', 1)[1].split("</table>", 1)[0]
    cells = re.findall(r'<td class="num">([^<]*)</td>', div)
    assert cells.count("2 / 2") == len(rep.rows)
    golden_ids = [int(gold[f"golden.p{p}.tokens"][2]) for p in range(len(rep.rows))]
    engine_ids = [int(gold[f"golden.p{p}.topk_ids"][2, 1]) for p in range(len(rep.rows))]
    assert (sorted(c for c in cells if "\u2192" in c)
            == sorted(f"{g} \u2192 {e}" for g, e in zip(golden_ids, engine_ids)))
    assert (fmt(163839, "id"), fmt(0, "rank"), fmt(163839, "int")) == ("163839", "1", "163,839")
    assert "1 = top" in rep.paths["html"].read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_divergence_table_fits_a_1400_px_window(one_engine_report, tmp_path):
    """Layout test: in Chromium at 1400 px, the divergent-prompts table needs no horizontal scrolling."""
    rep, _ = one_engine_report
    probe = tmp_path / "probe.html"
    probe.write_text(rep.paths["html"].read_text().replace("</body>", (
        "<script>window.addEventListener('load', () => { const t = document.getElementById('divergence-table'); "
        "document.body.setAttribute('data-widths', t.scrollWidth + ' ' + t.parentElement.clientWidth + ' ' + "
        "document.documentElement.scrollWidth); });</script></body>")))
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900",
                          "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    table, card, page = (int(v) for v in re.search(r'data-widths="(\d+) (\d+) (\d+)"', out.stdout).groups())
    assert table <= card and page <= 1400, (table, card, page)
