"""What the report checks before it judges anything: its inputs are the files their stages wrote.

- A golden must pass every KDTR checksum and match its sha256 record; otherwise the report stops
  with the file and tensor (or byte offset) named: no run is judged against a damaged golden.
- An engine result must match the keyed record (HMAC-SHA256 under the results directory's integrity
  key) the runner wrote beside it; without a key (a report run by hand without `--integrity-key`),
  its sha256 record. A result rewritten afterwards (by another engine, say) is shown as `changed`,
  not judged: its engine is not blamed for what another process wrote into it. Rewriting the
  record too does not help without the key, which sandboxed engines never see.
- Whether a verdict is tamper-proof (tamper_verdict): only if the report had the key, the run was
  sandboxed, and no engine judged beside it ran unsandboxed (an unsandboxed engine runs as the
  pipeline's user: it can read the key and rewrite any result, bundle or golden).
- The bundle a result records (path and sha256, checked by the runner before and after the run)
  must still have that hash and record, and must have been built from the golden the report uses;
  otherwise the run is `changed` too: its input changed under it.
- A result straight from an engine (the judge, report/judge.py, on a result with no runner record) has
  neither record to check: the contract checks the runner would make are made on it instead
  (metrics.py, the run entry's `contract`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from k2vec.digests import IntegrityError, check_keyed_record, check_record, read_key, recorded, sha256_file, verify_kdtr
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


NO_KEY = ("the report was given no integrity key, so results were checked against their sha256 records, which "
          "whoever rewrites a result can rewrite too")


class RunChecks:
    """The integrity of each run's result and bundle, bundles hashed once per report. `key_file`: the
    results directory's integrity key (digests.integrity_key_path); None checks sha256 records only."""

    def __init__(self, golden_sha256: Mapping[tuple[str, str], str], key_file: str | Path | None = None):
        self.golden_sha256 = golden_sha256
        self._bundles: dict[str, str] = {}
        self._built_from: dict[str, str | None] = {}   # bundle path -> the golden sha256 it was built from
        self.key_file = key_file
        self.key: bytes | None = None
        self.key_problem: str | None = None
        if key_file is not None:
            try:
                self.key = read_key(key_file)
            except IntegrityError as err:
                self.key_problem = str(err)

    def _check_result_record(self, spec: Mapping[str, Any]) -> None:
        if spec.get("reference") or self.key_file is None:
            check_record(spec["result"])   # a stage's output (the int4-format run), or no key given
        elif self.key is None:
            raise IntegrityError(f"cannot be verified: {self.key_problem}")
        else:
            check_keyed_record(spec["result"], self.key)

    def tamper_verdict(self, spec: Mapping[str, Any], result: Mapping[str, Any] | None, status: str,
                       unsandboxed: Sequence[str]) -> str | None:
        """Why this run's verdict is not tamper-proof, or None when it is. `unsandboxed`: the engines of
        this report that ran (at least once) without the sandbox."""
        why = []
        if self.key_file is None:
            why.append(NO_KEY)
        if status == CHANGED:
            why.append("its result or input changed after the run")
        elif result is None:
            why.append("its result could not be read")
        elif not spec.get("reference") and result.get("sandbox") is not True:
            problem = result.get("sandbox_problem")
            why.append("it ran unsandboxed" + (f" (the sandbox could not run: {problem})" if problem else
                                                " (sandbox: false)") +
                       ": as the pipeline's user it could rewrite its own inputs and records")
        others = [e for e in unsandboxed if e != spec["engine"]]
        if others:
            why.append(f"engine(s) {', '.join(others)} ran unsandboxed as the pipeline's user and could have rewritten "
                       f"this run's result with a valid record (the integrity key is readable to them), its bundle, "
                       f"or the golden")
        return "; ".join(why) or None

    def problem(self, spec: Mapping[str, Any], result: Mapping[str, Any] | None) -> str | None:
        """Why this run cannot be judged, or None when its result and inputs are as they were written.
        `result`: the loaded JSON, None when it could not be read (garbage written over it is `changed`).
        spec["bundle"], where given (the judge's --bundle): the bundle the run is judged on, in place of the
        path the result records (relative to the directory the pipeline ran in)."""
        if not Path(spec["result"]).is_file() or spec.get("contract") is not None:
            return None   # a missing result is a failed run; one straight from an engine has no records
        try:
            self._check_result_record(spec)
        except IntegrityError as err:
            return f"result changed after the engine runner wrote it, not judged: {err}"
        if result is None or result.get("status", "ok") != "ok":
            return None   # nothing is judged; its own record is intact
        bundle = (result.get("inputs") or {}).get("bundle")
        if not isinstance(bundle, Mapping):
            return None   # not written by the runner (e.g. tests/support/synthetic.py): no bundle to check
        given = spec.get("bundle")
        return self._bundle_problem(str(given or bundle.get("path")), str(bundle.get("sha256")), spec,
                                    given is not None)

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
            if path not in self._built_from:   # one bundle serves many runs: its directory is parsed once
                with open_bundle(path) as b:
                    self._built_from[path] = b.metadata.get("golden_sha256")
            built_from = self._built_from[path]
        except (IntegrityError, KdtrError) as err:
            return f"input bundle {path}: {err}"
        golden = self.golden_sha256.get((spec["model"], spec["precision"]))
        if built_from != golden:
            return (f"input bundle {path} was built from another golden (sha256 {built_from}) than the one judged "
                    f"against ({golden}), not judged")
        return None
