"""What the report checks before it judges anything: its inputs are the files their stages wrote.

- A golden must pass every KDTR checksum and match its sha256 record; otherwise the report stops
  with the file and tensor (or byte offset) named: no run is judged against a damaged golden.
- An engine result must match the sha256 record the runner wrote beside it. A result rewritten
  afterwards (by another engine, say) is shown as `changed`, not judged: its engine is not blamed
  for what another process wrote into it.
- The bundle a result records (path and sha256, checked by the runner before and after the run)
  must still have that hash and record, and must have been built from the golden the report uses;
  otherwise the run is `changed` too: its input changed under it.
- A result straight from an engine (the judge, report/judge.py, on a result with no runner record) has
  neither record to check: the contract checks the runner would make are made on it instead
  (metrics.py, the run entry's `contract`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from k2vec.digests import IntegrityError, check_record, recorded, sha256_file, verify_kdtr
from k2vec.kdtr import KdtrError, open_bundle

CHANGED = "changed"  # the row status and class of a run whose result or inputs changed after it ran


def verify_golden(model: str, precision: str, path: str | Path) -> str:
    """The golden's sha256 once every check passes; IntegrityError naming the file and tensor otherwise."""
    try:
        return verify_kdtr(path)
    except IntegrityError as err:
        raise IntegrityError(f"golden for model {model!r} precision {precision!r} is not readable as its stage "
                             f"wrote it, so no run was judged: {err}. Rebuild it: delete {path} and rerun "
                             f"Snakemake") from None


class RunChecks:
    """The integrity of each run's result and bundle, bundles hashed once per report."""

    def __init__(self, golden_sha256: Mapping[tuple[str, str], str]):
        self.golden_sha256 = golden_sha256
        self._bundles: dict[str, str] = {}

    def problem(self, spec: Mapping[str, Any], result: Mapping[str, Any] | None) -> str | None:
        """Why this run cannot be judged, or None when its result and inputs are as they were written.
        `result`: the loaded JSON, None when it could not be read (garbage written over it is `changed`).
        spec["bundle"], where given (the judge's --bundle): the bundle the run is judged on, in place of the
        path the result records (relative to the directory the pipeline ran in)."""
        if not Path(spec["result"]).is_file() or spec.get("contract") is not None:
            return None   # a missing result is a failed run; one straight from an engine has no records
        try:
            check_record(spec["result"])
        except IntegrityError as err:
            return f"result changed after the engine runner wrote it, not judged: {err}"
        if result is None or result.get("status", "ok") != "ok":
            return None   # nothing is judged; its own record is intact
        bundle = (result.get("inputs") or {}).get("bundle")
        if not isinstance(bundle, Mapping):
            return None   # not written by the runner (e.g. tests/support/synthetic.py): no bundle to check
        given = spec.get("bundle")
        return self._bundle_problem(str(given or bundle.get("path")), str(bundle.get("sha256")), spec, given is not None)

    def _bundle_problem(self, path: str, used: str, spec: Mapping[str, Any], given: bool) -> str | None:
        if path not in self._bundles:
            try:
                self._bundles[path] = sha256_file(path)
            except OSError as err:
                self._bundles[path] = f"unreadable ({err.strerror})"
        now = self._bundles[path]
        if now != used:
            what = "is not the bundle this run used" if given else "changed since this run used it"
            return f"input bundle {path} {what} (sha256 now {now}, at the run {used}), not judged"
        try:
            if recorded(path) != used:
                return f"input bundle {path} no longer matches its sha256 record (rebuilt since this run), not judged"
            with open_bundle(path) as b:
                built_from = b.metadata.get("golden_sha256")
        except (IntegrityError, KdtrError) as err:
            return f"input bundle {path}: {err}"
        golden = self.golden_sha256.get((spec["model"], spec["precision"]))
        if built_from != golden:
            return (f"input bundle {path} was built from another golden (sha256 {built_from}) than the one judged "
                    f"against ({golden}), not judged")
        return None
