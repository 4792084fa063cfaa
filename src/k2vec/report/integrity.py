"""What the report checks before it judges anything: its inputs are the files their stages wrote.

- A golden must pass every KDTR checksum and match its sha256 record; otherwise the report stops
  with the file and tensor (or byte offset) named: no run is judged against a damaged golden.
- An engine result must match the sha256 record the runner wrote beside it. A result rewritten
  afterwards (by another engine, say) is shown as `changed`, not judged: its engine is not blamed
  for what another process wrote into it.
- The bundle a result records (path and sha256, checked by the runner before and after the run)
  must still have that hash and record, and must have been built from the golden the report uses;
  otherwise the run is `changed` too: its input changed under it.
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
        raise IntegrityError(f"golden for model {model!r} precision {precision!r} is not readable as the golden "
                             f"stage wrote it, so no run was judged: {err}. Rebuild it: delete {path} and rerun "
                             f"Snakemake") from None


class RunChecks:
    """The integrity of each run's result and bundle, bundles hashed once per report."""

    def __init__(self, golden_sha256: Mapping[tuple[str, str], str]):
        self.golden_sha256 = golden_sha256
        self._bundles: dict[str, str] = {}

    def problem(self, spec: Mapping[str, Any], result: Mapping[str, Any] | None) -> str | None:
        """Why this run cannot be judged, or None when its result and inputs are as they were written.
        `result`: the loaded JSON, None when it could not be read (garbage written over it is `changed`)."""
        if not Path(spec["result"]).is_file():
            return None   # a missing result is a failed run
        try:
            check_record(spec["result"])
        except IntegrityError as err:
            return f"result changed after the engine runner wrote it, not judged: {err}"
        if result is None or result.get("status", "ok") != "ok":
            return None   # nothing is judged; its own record is intact
        bundle = (result.get("inputs") or {}).get("bundle")
        if not isinstance(bundle, Mapping):
            return None   # not written by the runner (e.g. tests/support/synthetic.py): no bundle to check
        return self._bundle_problem(str(bundle.get("path")), str(bundle.get("sha256")), spec)

    def _bundle_problem(self, path: str, used: str, spec: Mapping[str, Any]) -> str | None:
        if path not in self._bundles:
            try:
                self._bundles[path] = sha256_file(path)
            except OSError as err:
                self._bundles[path] = f"unreadable ({err.strerror})"
        now = self._bundles[path]
        if now != used:
            return (f"input bundle {path} changed since this run used it (sha256 now {now}, at the run {used}), "
                    f"not judged")
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
