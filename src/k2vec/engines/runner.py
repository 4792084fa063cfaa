"""Run one engine on one bundle, under a time limit, and always leave a valid result file per run.

Whatever the engine does (crash, hang, no output, invalid or hostile JSON, wrong token counts) and
whatever state its bundle is in, each run ends with a result JSON at its final path: the engine's own
result marked `status: ok`, or a result with `status: failed`, the reason and the tail of the
engine's stderr. So one broken engine run never stops the others, and the report shows it as a
FAILED row.

A single-run engine (its command takes {mode}, {budget} and {output}) is started once per run. A batch
engine (its command takes {batch}: docs/engine-contract.md section 2, "Several runs in one process") is
started once for all the runs of a bundle and writes their results in order; each run keeps its own time
limit, counted from the previous run's result, and a run that hangs or crashes fails alone: the engine is
started again on the runs after it.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Sequence

from k2vec.atomic import claim_directory
from k2vec.digests import IntegrityError, integrity_key_path, load_or_create_key, sha256_file, verify_kdtr
from k2vec.engines.contract.checks import check_result
from k2vec.engines.contract.errors import InvalidResult
from k2vec.engines.contract.expectations import Expectations, expectations_from_bundle
from k2vec.engines.contract.files import read_result, write_result
from k2vec.engines.contract.modes import BATCH_FORMAT, parse_mode
from k2vec.engines.contract.result_cache import ResultCache
from k2vec.engines.gpus import GpuError, identify, lease
from k2vec.engines.isolation import (Reaper, fresh_scratch, make_read_only, make_undumpable, remove_tree,
                                     sandbox_command, sandbox_problem)

PLACEHOLDERS = ("bundle", "mode", "budget", "output", "batch", "gpus", "python")
# How often a batch engine's next result is looked for while it runs (it starts the next run's time limit).
PROGRESS_POLL_S = 0.02
STDERR_TAIL_LINES = 20
KILL_GRACE_S = 5.0
# An engine log (its stdout and stderr) past 64 MiB keeps its last 4 MiB.
LOG_LIMIT_BYTES = 64 << 20
LOG_KEEP_BYTES = 4 << 20




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


def is_batch_command(command: str) -> bool:
    """A batch engine's command takes {batch}: every run of a bundle in one process."""
    return "{batch}" in command


@dataclass(frozen=True)
class Finished:
    """How the engine process ended: rc None when killed at the time limit; epoch seconds around it;
    how many processes it left behind (all killed), and why some could not be, if so; `marks`: the
    epoch seconds at which each watched result appeared, in order (as many as appeared)."""

    rc: int | None
    started_at: float
    ended_at: float
    wall_s: float
    leftovers: int | None
    leftover_problem: str | None
    marks: tuple[float, ...] = ()


def _wait(proc: subprocess.Popen, timeout: float | None) -> int:
    """proc.wait(timeout), woken by the kernel when the process exits (a pidfd): Popen.wait polls with
    sleeps of up to 50 ms, a delay every run would pay."""
    if timeout is None:
        return proc.wait()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):   # not Linux, an old kernel, or a process already reaped
        return proc.wait(timeout=timeout)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(min(max(0, math.ceil(timeout * 1000)), 2**31 - 1)):
            raise subprocess.TimeoutExpired(proc.args, timeout)
    finally:
        os.close(fd)
    return proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the engine's process group, SIGKILL it KILL_GRACE_S later, and reap the engine."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            _wait(proc, grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _run_with_limit(argv: Sequence[str], env: dict[str, str], cwd: Path, stderr_path: Path,
                    timeout_s: float, watch: Sequence[Path] = ()) -> Finished:
    """Run `argv` in its own process group; on timeout kill the whole group. Then kill every process
    the engine left, in any session or group (the runner adopts them as child subreaper).

    `watch`: the result paths of a batch, in order. Each one that appears starts the next run's
    `timeout_s`; without them the limit is the process's."""
    with open(stderr_path, "ab") as err, Reaper() as reaper:
        started_at, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=err, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                env=env, start_new_session=True)
        marks: list[float] = []
        deadline = start + timeout_s
        rc: int | None = None
        while True:
            step = deadline - time.perf_counter()
            if len(marks) < len(watch):
                step = min(step, PROGRESS_POLL_S)
            try:
                rc = _wait(proc, max(0.0, step))
            except subprocess.TimeoutExpired:
                while len(marks) < len(watch) and watch[len(marks)].exists():
                    marks.append(time.time())
                    deadline = time.perf_counter() + timeout_s
                if time.perf_counter() < deadline:
                    continue
                _kill_group(proc)
                rc = None
            break
        ended_at, wall = time.time(), time.perf_counter() - start
        while len(marks) < len(watch) and watch[len(marks)].exists():   # written since the last look
            marks.append(ended_at)
        leftovers, problem = reaper.kill_leftovers()
    return Finished(rc, started_at, ended_at, wall, leftovers, problem, tuple(marks))


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


def run_engine(*, mode: str, output: str, **kwargs: Any) -> dict[str, Any]:
    """One run: run_engine_batch with a single (mode, output)."""
    return run_engine_batch(runs=[(mode, output)], **kwargs)[0]


@dataclass
class _Run:
    """One run of a job: its final result path, where the engine writes it, and what the runner knows."""

    mode: str
    output: Path
    partial: Path
    record: dict[str, Any]
    final: dict[str, Any] | None = None
    text: str = ""   # an ok result's JSON (a failed one's is made when it is written)


def run_engine_batch(*, engine: str, command: str, bundle: str, runs: Sequence[tuple[str, str]],
                     gpus: int, devices: Sequence[str], lock_dir: str, timeout_s: float, stderr_path: str,
                     max_result_mb: float, scratch_dir: str, sandbox: bool = False, sandbox_required: bool = True,
                     results_dir: str | None = None, expect: Expectations | None = None,
                     extra_env: dict[str, str] | None = None, python: str = sys.executable,
                     jobs_per_device: int = 1, parse_cache: str | None = None) -> list[dict[str, Any]]:
    """Run the engine on `runs` ((mode, output) pairs, all of one bundle) and write each final result (ok or
    failed) atomically to its output; returns them in order.

    The engine runs in `scratch_dir` (wiped first; removed after a job whose runs are all ok, kept otherwise
    for inspection) and writes its results there; no process it starts outlives the job. A single-run
    command is started once per run; a batch command ({batch}) once for all, and again on the runs after one
    that hung or crashed. Each run has `timeout_s` (in a batch, from the previous run's result).
    `sandbox`: under bubblewrap, with `results_dir` hidden but for the bundle and the scratch directory; where
    bubblewrap cannot run, the job fails (`sandbox_required`, an explicit `sandbox: true`) or runs
    unsandboxed and its results say why (`sandbox_problem`: an engine left at the default).
    `results_dir`: also where the integrity key lives (digests.integrity_key_path), read before the
    engine starts; each result then gets a keyed record beside it. `max_result_mb`: larger result files
    are refused before they are read. `expect`: what a valid result holds; None (the pipeline) reads it
    from the bundle after verifying the bundle's checksums. `jobs_per_device`: how many jobs may share a GPU
    (config gpus.jobs_per_device). `parse_cache`: the report's cache of result parses
    (engines/contract/result_cache.py), given each result's parse as it is written: the report, which runs
    after every engine job, then parses none of them itself."""
    batch = is_batch_command(command)
    if sandbox and results_dir is None:
        raise ValueError("sandbox needs results_dir: the directory hidden from the engine")
    # Before the engine exists: the key is in this process's memory while the engine runs, and a
    # process of the same uid must not read it there (a sandboxed engine sees no other process at all).
    make_undumpable()
    key = load_or_create_key(integrity_key_path(results_dir)) if results_dir is not None else None
    scratch = Path(scratch_dir).resolve()
    stderr_file = Path(stderr_path)
    stderr_file.parent.mkdir(parents=True, exist_ok=True)
    stderr_file.write_bytes(b"")
    jobs: list[_Run] = []
    for mode, output in runs:
        kind, budget = parse_mode(mode)
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        # a single run writes out/result.json, as it always has; a batch's runs one file each
        partial = scratch / "out" / (f"{mode}.json" if batch else "result.json")
        jobs.append(_Run(mode, out, partial, {"engine": engine, "bundle": str(bundle), "mode": mode,
                                              "budget": budget, "sandbox": sandbox, "sandbox_problem": None}))
    try:
        dirs = fresh_scratch(scratch)
    except OSError as err:
        # What the last run left cannot be removed (a file it made immutable, chattr +i): failed rows
        # that say where, and no engine run on top of it.
        for r in jobs:
            r.final = _failed(r.record, f"cannot clear the scratch directory {scratch} that an earlier run left: "
                              f"{err} (remove it by hand, e.g. chattr -R -i, then rerun)", stderr_file, None)
            write_result(r.output, json.dumps(r.final, sort_keys=True) + "\n", key)
        return [r.final for r in jobs]
    # A runner killed with its job leaves the marker behind: the next start removes the directory.
    in_use = claim_directory(scratch)
    bundle_path = Path(bundle).resolve()   # the engine's working directory is its scratch directory
    try:
        bundle_sha256 = verify_bundle(bundle)
        shared: dict[str, Any] = {"inputs": {"bundle": {"path": str(bundle), "sha256": bundle_sha256}}}
        if expect is None:
            expect = expectations_from_bundle(bundle, verify=False)   # verify_bundle just checked every tensor
        if sandbox and (problem := sandbox_problem()) is not None:
            if sandbox_required:
                raise InvalidResult(f"sandbox: true, but {problem}")
            sandbox = False
            shared.update(sandbox=False, sandbox_problem=problem)
        for r in jobs:   # (a failed lease below still records the bundle and the sandbox)
            r.record.update(shared)
        if bundle_path.exists():
            make_read_only(bundle_path)
        with lease(gpus, devices, lock_dir, jobs_per_device=jobs_per_device) as assigned:
            env = {**os.environ, **(extra_env or {}), **(_gpu_environment(assigned) if gpus else {}),
                   "TMPDIR": str(dirs["tmp"]), "K2VEC_WORKDIR": os.getcwd()}
            # asked before the engine starts, so that a run the GPU made fail still names the GPU
            devices_found, identity_error = identify(assigned)
            for r in jobs:
                r.record.update(gpus=assigned, gpu_devices=devices_found, gpu_identity_error=identity_error)
            pending = list(jobs)
            while pending:
                attempt = pending if batch else pending[:1]
                pending = _attempt(attempt, batch=batch, engine=engine, command=command, bundle=bundle,
                                   bundle_path=bundle_path, bundle_sha256=bundle_sha256, assigned=assigned,
                                   python=python, sandbox=sandbox, results_dir=results_dir, dirs=dirs,
                                   scratch=scratch, env=env, stderr_file=stderr_file, timeout_s=timeout_s,
                                   max_result_mb=max_result_mb, expect=expect) + pending[len(attempt):]
    except (InvalidResult, GpuError) as err:   # no devices for it: failed rows too, not a crash
        for r in jobs:
            if r.final is None:
                r.final = _failed(r.record, str(err), stderr_file, None)
    cap_log(stderr_file)
    all_ok = all(r.final["status"] == "ok" for r in jobs)
    parses = ResultCache(parse_cache) if parse_cache is not None else None
    for r in jobs:
        if r.final["status"] != "ok":   # kept for inspection: what the engine wrote is there
            r.final["scratch_kept"] = str(scratch)
            r.text = json.dumps(r.final, sort_keys=True)
        text = r.text + "\n"
        try:
            write_result(r.output, text, key)
            _leave_parse(parses, text)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            # The engine's own output is the likeliest thing that filled the disk: make room, then say so.
            remove_tree(scratch)
            all_ok = False
            r.final = _failed(r.record, f"no space left on device for the result ({err.strerror}); its scratch "
                              f"directory was removed to make room", stderr_file, None)
            write_result(r.output, json.dumps(r.final, sort_keys=True) + "\n", key)
    if all_ok:
        remove_tree(scratch)
    elif scratch.exists():
        in_use.unlink(missing_ok=True)   # kept for inspection until this job's next attempt
    return [r.final for r in jobs]


def _leave_parse(parses: ResultCache | None, text: str) -> None:
    """Put the parse of a result just written into the report's cache; a cache that cannot be written only
    leaves the parse to the report."""
    if parses is None:
        return
    try:
        parses.parse(text.encode("utf-8"))
    except OSError:
        pass


def _attempt(attempt: list[_Run], *, batch: bool, engine: str, command: str, bundle: str, bundle_path: Path,
             bundle_sha256: str, assigned: Sequence[str], python: str, sandbox: bool, results_dir: str | None,
             dirs: dict[str, Path], scratch: Path, env: dict[str, str], stderr_file: Path, timeout_s: float,
             max_result_mb: float, expect: Expectations) -> list[_Run]:
    """Start the engine once on `attempt` and settle every run of it that it finished or that made it stop;
    returns the runs left to start it again on (a batch's runs after one that hung or crashed)."""
    first = attempt[0]
    if batch:
        listing = dirs["out"] / "batch.json"
        listing.write_text(json.dumps({"format": BATCH_FORMAT, "version": 1, "bundle": str(bundle_path),
                                       "runs": [{"mode": parse_mode(r.mode)[0], "budget": r.record["budget"],
                                                 "output": str(r.partial)} for r in attempt]}, indent=1))
        cmd = format_command(command, bundle=bundle_path, batch=listing, gpus=",".join(assigned), python=python)
    else:
        cmd = format_command(command, bundle=bundle_path, mode=parse_mode(first.mode)[0],
                             budget=first.record["budget"], output=first.partial, gpus=",".join(assigned),
                             python=python)
    if sandbox:
        hidden = Path(str(results_dir)).resolve()
        build = hidden / "engines" / engine   # what its build step made (rule engine_build), if anything
        cache = hidden / "cache" / engine     # its own, kept across its runs (compiled kernels)
        cache.mkdir(parents=True, exist_ok=True)
        argv = sandbox_command(cmd, bundle=bundle_path, scratch=scratch, home=dirs["home"], hidden=hidden,
                               build=build if build.is_dir() else None, cache=cache)
    else:
        argv = ["bash", "-c", cmd]
    done = _run_with_limit(argv, env, dirs["work"], stderr_file, timeout_s,
                           watch=[r.partial for r in attempt] if batch else ())
    # each run's span: from the previous run's result (the first: the start) to its own (the last: the exit)
    ends = [*done.marks[:len(attempt) - 1], *[done.ended_at] * (len(attempt) - min(len(done.marks), len(attempt) - 1))]
    starts = [done.started_at, *ends[:-1]]
    stop: str | None = None   # why the engine stopped before writing every result
    if done.rc is None:
        stop = f"timed out after {timeout_s:g} s (killed)"
    elif done.rc != 0:
        stop = f"engine {f'killed by signal {-done.rc}' if done.rc < 0 else f'exited with code {done.rc}'}"
    # what makes every run of the attempt untrustworthy: a process that survived SIGKILL, a bundle changed
    spoiled = done.leftover_problem
    if spoiled is None:
        try:
            check_bundle_unchanged(bundle, bundle_sha256)
        except InvalidResult as err:
            spoiled = str(err)
    retry: list[_Run] = []
    blamed = False
    for i, r in enumerate(attempt):
        wall = (ends[i] - starts[i]) if batch else done.wall_s
        r.record.update(command=cmd, started_at=starts[i], ended_at=ends[i], wall_s=round(wall, 6),
                        leftover_processes_killed=done.leftovers)
        present = r.partial.exists() or r.partial.is_symlink()
        try:
            if spoiled is not None:
                raise InvalidResult(spoiled)
            if stop is not None and (not present or not batch):
                if blamed:   # a batch's run after the one that stopped it: not started or not finished
                    retry.append(r)
                    continue
                blamed = True
                raise InvalidResult(stop)
            if not present and batch:
                raise InvalidResult(f"engine exited 0 but wrote no result file at {r.partial} (batch run {i + 1} "
                                    f"of {len(attempt)})")
            result = read_result(r.partial, int(max_result_mb * 2**20))
            check_result(result, r.mode, expect)
            r.final = {**result, **r.record, "status": "ok", "reason": None}
            try:
                r.text = json.dumps(r.final, sort_keys=True, allow_nan=False)
            except ValueError:   # 1e999 read as inf in a key the schema leaves free
                raise InvalidResult("result holds a number too large for a float (read as infinity)") from None
        except InvalidResult as err:
            r.final = _failed(r.record, str(err), stderr_file, None)   # written, with scratch_kept, by the caller
    return retry


def _failed(record: dict[str, Any], reason: str, stderr_file: Path, scratch: Path | None) -> dict[str, Any]:
    """A failed run's result: what the runner knows of the run, the reason and the engine's last words."""
    return {"format": "k2vec-engine-result", "version": 1, **record, "status": "failed", "reason": reason,
            "stderr_tail": _tail(stderr_file), "runs": [], "scratch_kept": str(scratch) if scratch else None}


def cap_log(path: Path) -> None:
    """Cut an engine log past LOG_LIMIT_BYTES down to its last LOG_KEEP_BYTES, under a line saying how
    much went: an engine's output is not bounded by anything else, and the tail is what explains a failure."""
    limit, keep = LOG_LIMIT_BYTES, LOG_KEEP_BYTES
    try:
        size = path.stat().st_size
        if size <= limit:
            return
        with open(path, "rb") as fh:
            fh.seek(size - keep)
            tail = fh.read()
        path.write_bytes(f"[k2vec: the first {size - len(tail)} bytes of the engine's output were cut (logs are "
                         f"kept to the last {keep} bytes past {limit})]\n".encode() + tail)
    except OSError:
        pass   # the log is the engine's; a failure to cut it must not cost the run its result


HOW_IT_RUNS = """\
It has no command line of its own: Snakemake's rule engine_run (workflow/rules/engines.smk) runs
workflow/scripts/engine_run.py, which calls run_engine(engine=, command=, bundle=, mode=, output=, ...)
once per (engine, model, precision, mode), with the engine's entry in config.yaml (docs/engine-contract.md
sections 1 and 2). One run of one engine, through the runner:

  snakemake --cores 2 results/runs/ENGINE/MODEL-PRECISION-MODE.json

While writing an engine, run it by hand on a bundle and judge its result without Snakemake; the judge
makes the runner's contract checks on a result the runner did not write:

  my_engine --bundle results/bundles/tiny-fp32.kdtr --mode greedy --budget 0 --output out/tiny-fp32-greedy.json
  k2vec judge --bundle results/bundles/tiny-fp32.kdtr --result out/tiny-fp32-greedy.json
"""


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """`python -m k2vec.engines.runner --help`: what the runner is and how it is run."""
    ap = argparse.ArgumentParser(prog="python -m k2vec.engines.runner", description=__doc__.split("\n\n")[0],
                                 epilog=HOW_IT_RUNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    ap.error("the runner is run by Snakemake's rule engine_run, not from the shell (--help says how)")


if __name__ == "__main__":
    sys.exit(main())
