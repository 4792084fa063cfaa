"""Run one engine on one bundle, under a time limit, and always leave a valid result file.

Whatever the engine does (crash, hang, no output, invalid JSON, wrong token counts), the run ends
with a result JSON at the final path: the engine's own result marked `status: ok`, or a result with
`status: failed`, the reason and the tail of the engine's stderr. So one broken engine run never
stops the others, and the report shows it as a FAILED row.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..atomic import write_text_atomic
from ..digests import IntegrityError, sha256_bytes, sha256_file, verify_kdtr, write_record
from ..gpus import identify, lease

SCHEMA_PATH = Path(__file__).with_name("result.schema.json")
PLACEHOLDERS = ("bundle", "mode", "budget", "output", "gpus", "python")
STDERR_TAIL_LINES = 20
KILL_GRACE_S = 5.0


class InvalidResult(Exception):
    """The engine's output breaks the contract; the message becomes the failure reason."""


@dataclass(frozen=True)
class Expectations:
    """What a valid result must hold, from the bundle's metadata."""

    n_prompts: int
    max_new_tokens: int
    vocab_size: int
    accuracies: tuple[float, ...] = ()  # ddtree: one run per drafter accuracy


@lru_cache(maxsize=1)
def _validator():
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def parse_mode(mode: str) -> tuple[str, int]:
    """'greedy' -> ('greedy', 0); 'ddtree-b16' -> ('ddtree', 16)."""
    if mode == "greedy":
        return "greedy", 0
    if mode.startswith("ddtree-b") and mode[len("ddtree-b"):].isdigit() and int(mode[len("ddtree-b"):]) > 0:
        return "ddtree", int(mode[len("ddtree-b"):])
    raise ValueError(f"unknown mode {mode!r}: expected 'greedy' or 'ddtree-b<budget>'")


def check_result(result: Any, mode: str, expect: Expectations) -> None:
    """Raise InvalidResult naming the first contract violation."""
    err = next(iter(_validator().iter_errors(result)), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise InvalidResult(f"result does not match the schema at {where}: {err.message}")
    kind, _ = parse_mode(mode)
    runs = result["runs"]
    want_drafters = [None] if kind == "greedy" else [{"accuracy": a} for a in expect.accuracies]
    got = [None if r["drafter"] is None else {"accuracy": r["drafter"]["accuracy"]} for r in runs]
    if got != want_drafters:
        raise InvalidResult(f"runs are for drafters {got}, expected {want_drafters}")
    for r_i, run in enumerate(runs):
        if len(run["prompts"]) != expect.n_prompts:
            raise InvalidResult(f"run {r_i}: {len(run['prompts'])} prompts, the bundle has {expect.n_prompts}")
        for p_i, prompt in enumerate(run["prompts"]):
            tokens = prompt["tokens"]
            if len(tokens) != expect.max_new_tokens:
                raise InvalidResult(f"run {r_i} prompt {p_i}: {len(tokens)} tokens, "
                                    f"expected max_new_tokens = {expect.max_new_tokens}")
            bad = next((t for t in tokens if t >= expect.vocab_size), None)
            if bad is not None:
                raise InvalidResult(f"run {r_i} prompt {p_i}: token {bad} outside the vocabulary "
                                    f"(size {expect.vocab_size})")


def expectations_from_bundle(path: str) -> Expectations:
    """What the engine's result must hold, from the bundle's metadata (the engine sees the same)."""
    from ..kdtr import open_bundle

    meta = open_bundle(path).metadata
    return Expectations(n_prompts=meta["golden"]["prompts"], max_new_tokens=meta["decoding"]["max_new_tokens"],
                        vocab_size=meta["model"]["vocab_size"],
                        accuracies=tuple(meta["golden"]["ddtree"]["accuracies"]))


def format_command(template: str, **values: Any) -> str:
    """Fill the placeholders of an engine's command template, shell-quoted."""
    try:
        return template.format(**{k: shlex.quote(str(v)) for k, v in values.items()})
    except (KeyError, IndexError) as err:
        raise ValueError(f"engine command {template!r} uses an unknown placeholder {err}; "
                         f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class Finished:
    """How the engine process ended: rc None when killed at the time limit; epoch seconds around it."""

    rc: int | None
    started_at: float
    ended_at: float
    wall_s: float


def _run_with_limit(command: str, env: dict[str, str], stderr_path: Path, timeout_s: float) -> Finished:
    """Run `command` in its own process group; on timeout kill the whole group."""
    started_at, start = time.time(), time.perf_counter()
    with open(stderr_path, "ab") as err:
        proc = subprocess.Popen(["bash", "-c", command], stdout=err, stderr=err, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            proc.wait()
            rc = None
    return Finished(rc, started_at, time.time(), time.perf_counter() - start)


def _gpu_environment(assigned: Sequence[str]) -> dict[str, str]:
    """The engine sees exactly its devices, numbered as nvidia-smi numbers them (PCI bus order; CUDA's
    default order may differ), so the identity recorded for the run is the GPU it really used."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(assigned), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def verify_bundle(bundle: str) -> str:
    """The bundle's sha256, after all its KDTR checksums and its sha256 record (written by the bundle
    stage) have been checked; a damaged bundle makes a failed run, and the engine never sees it."""
    try:
        return verify_kdtr(bundle)
    except IntegrityError as err:
        raise InvalidResult(f"the input bundle failed verification, so the engine was not run: {err}") from None


def check_bundle_unchanged(bundle: str, sha256: str) -> None:
    """The bundle must leave the run as it entered it: engines share bundles, and the report judges
    every run that used one by its hash."""
    try:
        after = sha256_file(bundle)
    except OSError as err:
        after = f"unreadable ({err.strerror})"
    if after != sha256:
        raise InvalidResult(f"the input bundle {bundle} changed during the run (sha256 {sha256} before, {after} "
                            f"after): the engine or another process wrote into it; the result is not trusted")


def write_result(output: Path, result: dict[str, Any]) -> None:
    """The final result and its sha256 record `<output>.sha256`, by which the report notices a result
    rewritten after the runner wrote it."""
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    write_text_atomic(output, text)
    write_record(output, sha256_bytes(text.encode("utf-8")))


def run_engine(*, engine: str, command: str, bundle: str, mode: str, output: str, expect: Expectations | None,
               gpus: int, devices: Sequence[str], lock_dir: str, timeout_s: float, stderr_path: str,
               extra_env: dict[str, str] | None = None, python: str = sys.executable) -> dict[str, Any]:
    """Run the engine and write the final result (ok or failed) atomically to `output`.

    `expect`: None reads the expectations from the bundle, once it is verified."""
    kind, budget = parse_mode(mode)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.engine-{os.getpid()}.partial")
    stderr_file = Path(stderr_path)
    stderr_file.parent.mkdir(parents=True, exist_ok=True)
    stderr_file.write_bytes(b"")
    record: dict[str, Any] = {"engine": engine, "bundle": str(bundle), "mode": mode, "budget": budget}
    try:
        bundle_sha256 = verify_bundle(bundle)
        record["inputs"] = {"bundle": {"path": str(bundle), "sha256": bundle_sha256}}
        expect = expect or expectations_from_bundle(bundle)
        with lease(gpus, devices, lock_dir) as assigned:
            env = {**os.environ, **(extra_env or {}), **(_gpu_environment(assigned) if gpus else {})}
            cmd = format_command(command, bundle=bundle, mode=kind, budget=budget, output=partial,
                                 gpus=",".join(assigned), python=python)
            record["gpus"] = assigned
            # asked before the engine starts, so that a run the GPU made fail still names the GPU
            record["gpu_devices"], record["gpu_identity_error"] = identify(assigned)
            record["command"] = cmd
            done = _run_with_limit(cmd, env, stderr_file, timeout_s)
        record.update(started_at=done.started_at, ended_at=done.ended_at, wall_s=round(done.wall_s, 6))
        rc = done.rc
        check_bundle_unchanged(bundle, bundle_sha256)
        if rc is None:
            raise InvalidResult(f"timed out after {timeout_s:g} s (killed)")
        if rc != 0:
            how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            raise InvalidResult(f"engine {how}")
        if not partial.exists():
            raise InvalidResult(f"engine exited 0 but wrote no result file at {partial}")
        try:
            result = json.loads(partial.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise InvalidResult(f"result file is not valid JSON: {err}") from None
        check_result(result, mode, expect)
        final = {**result, **record, "status": "ok", "reason": None}
    except InvalidResult as err:
        final = {"format": "k2vec-engine-result", "version": 1, **record, "status": "failed",
                 "reason": str(err), "stderr_tail": _tail(stderr_file), "runs": []}
    finally:
        partial.unlink(missing_ok=True)
    write_result(out, final)
    return final
