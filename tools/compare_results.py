"""Are two results/ trees the same pipeline output, apart from what a run's clock and checkout decide?

    python tools/compare_results.py BASE/results NEW/results

For a restructuring that must not change behaviour: every output file is byte-identical, except
- run results (runs/**.json): their start/end times, wall_s, the engine's own timing, and the checkout
  path in the recorded command; their .sha256 records follow the JSON, and so do their keyed .hmac records,
  each valid under its own tree's integrity key (.integrity.key: random per results tree, not compared);
- divergence.csv: the tokens_per_s, decode_tokens_per_s and wall_s columns; summary.txt: the throughput
  line; divergence.html: the Runs table's tok/s column and the summary text's throughput line.
Logs and benchmark tables (logs/, benchmarks/) are not outputs and are not compared. Prints one line per
differing file and exits 1 if any differ beyond these; exits 0 with a count otherwise.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from k2vec.digests import KEY_NAME, check_keyed_record, read_key  # noqa: E402

SKIP_DIRS = ("logs", "benchmarks", "scratch")
RUN_CLOCK = ("started_at", "ended_at", "wall_s", "timing")
CSV_CLOCK = ("tokens_per_s", "decode_tokens_per_s", "wall_s")
THROUGHPUT = re.compile(r"^\s*throughput: .*$", re.M)


def outputs(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
            and p.relative_to(root).parts[0] not in SKIP_DIRS}


def run_json(path: Path, root: Path) -> dict:
    data = json.loads(path.read_text())
    for k in RUN_CLOCK:
        data.pop(k, None)
    if isinstance(data.get("command"), str):
        data["command"] = data["command"].replace(str(root.resolve().parent), "<checkout>")
    return data


def divergence_csv(path: Path) -> list[dict]:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    return [{k: v for k, v in r.items() if k not in CSV_CLOCK} for r in rows]


def report_html(path: Path) -> str:
    text = THROUGHPUT.sub("", path.read_text())
    start = text.index('id="summary-table"')
    end = text.index("</table>", start)
    table = text[start:end]
    headers = re.findall(r"<th(?:\s[^>]*)?>([^<]*)", table.split("</tr>", 1)[0])
    col = headers.index("tok/s")

    def mask(row: re.Match) -> str:
        cells = re.split(r"(?=<t[dh])", row.group(0))
        cells = [c for c in cells if c]
        if len(cells) > col + 1 and cells[col + 1].startswith("<td"):
            cells[col + 1] = re.sub(r">[^<]*", ">*", cells[col + 1], count=1)
        return "".join(cells)

    return text[:start] + re.sub(r"<tr>.*?</tr>", mask, table, flags=re.S) + text[end:]


def same(rel: str, a: Path, b: Path, roots: tuple[Path, Path]) -> bool:
    if a.read_bytes() == b.read_bytes():
        return True
    parts = Path(rel).parts
    if rel == KEY_NAME:
        return True   # drawn at random for each results tree: the records under it are what is compared
    if parts[0] == "runs" and rel.endswith(".json.hmac"):
        target = rel[: -len(".hmac")]
        for root in roots:
            check_keyed_record(root / target, read_key(root / KEY_NAME))   # IntegrityError unless it matches
        return same(target, roots[0] / target, roots[1] / target, roots)
    if parts[0] == "runs" and rel.endswith(".json"):
        return run_json(a, roots[0]) == run_json(b, roots[1])
    if parts[0] == "runs" and rel.endswith(".json.sha256"):
        target = rel[: -len(".sha256")]
        return same(target, roots[0] / target, roots[1] / target, roots)
    if rel == "report/divergence.csv":
        return divergence_csv(a) == divergence_csv(b)
    if rel == "report/summary.txt":
        return THROUGHPUT.sub("", a.read_text()) == THROUGHPUT.sub("", b.read_text())
    if rel == "report/divergence.html":
        return report_html(a) == report_html(b)
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    base, new = (Path(p) for p in argv)
    a, b = outputs(base), outputs(new)
    problems = [f"only in {base}: {r}" for r in sorted(a - b)] + [f"only in {new}: {r}" for r in sorted(b - a)]
    identical = 0
    for rel in sorted(a & b):
        if (base / rel).read_bytes() == (new / rel).read_bytes():
            identical += 1
        elif not same(rel, base / rel, new / rel, (base, new)):
            problems.append(f"differs: {rel}")
    for p in problems:
        print(p)
    n = len(a & b)
    print(f"{n} output files: {identical} byte-identical, "
          f"{n - identical - len([p for p in problems if p.startswith('differs')])} "
          f"equal apart from clock and checkout, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
