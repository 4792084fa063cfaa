"""Run one engine on one bundle, under a time limit, and always leave a valid result file.

Whatever the engine does (crash, hang, no output, invalid or hostile JSON, wrong token counts) and
whatever state its bundle is in, the run ends with a result JSON at the final path: the engine's own
result marked `status: ok`, or a result with `status: failed`, the reason and the tail of the
engine's stderr. So one broken engine run never stops the others, and the report shows it as a
FAILED row.
"""

from __future__ import annotations

import json
import math
import os
import select
import shlex
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..atomic import claim_directory, write_text_atomic
from ..digests import IntegrityError, sha256_bytes, sha256_file, verify_kdtr, write_record
from ..gpus import GpuError, identify, lease
from .fast_schema import conforms, is_integer, is_number
from .isolation import Reaper, fresh_scratch, make_read_only, remove_tree, sandbox_command, sandbox_problem

SCHEMA_PATH = Path(__file__).with_name("result.schema.json")
PLACEHOLDERS = ("bundle", "mode", "budget", "output", "gpus", "python")
STDERR_TAIL_LINES = 20
KILL_GRACE_S = 5.0
# A valid result nests 8 deep ({runs: [{prompts: [{fingerprints: [[[ ... ); the limit leaves room for
# free-form keys while keeping every later step (schema check, JSON writer, report) far from
# Python's recursion limit.
MAX_RESULT_NESTING = 32
_SCAN_CHUNK = 1 << 22


class InvalidResult(Exception):
    """The engine's output breaks the contract; the message becomes the failure reason."""


@dataclass(frozen=True)
class Expectations:
    """What a valid result must hold, from the bundle's metadata."""

    n_prompts: int
    max_new_tokens: int
    vocab_size: int
    accuracies: tuple[float, ...] = ()  # ddtree: one run per drafter accuracy
    # The shapes of the optional per-step arrays (section 4); None where the bundle does not say.
    prompt_lengths: tuple[int, ...] | None = None
    layers: int | None = None
    moe_layers: int | None = None
    experts: int | None = None            # n_routed_experts
    experts_per_token: int | None = None  # num_experts_per_tok


@lru_cache(maxsize=1)
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=1)
def _validator():
    """The schema's validator with strict types: JSON Schema counts 5.0 as an integer, and Python's
    reader turns 1e999 into inf; token ids must be integers and every number finite."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many({
        "integer": lambda _, x: is_integer(x),
        "number": lambda _, x: is_number(x),
    })
    strict = jsonschema.validators.extend(base, type_checker=checker)
    return strict(_schema())


def parse_mode(mode: str) -> tuple[str, int]:
    """'greedy' -> ('greedy', 0); 'score' -> ('score', 0); 'ddtree-b16' -> ('ddtree', 16)."""
    if mode in ("greedy", "score"):
        return mode, 0
    if mode.startswith("ddtree-b") and mode[len("ddtree-b"):].isdigit() and int(mode[len("ddtree-b"):]) > 0:
        return "ddtree", int(mode[len("ddtree-b"):])
    raise ValueError(f"unknown mode {mode!r}: expected 'greedy', 'score' or 'ddtree-b<budget>'")


def check_result(result: Any, mode: str, expect: Expectations) -> None:
    """Raise InvalidResult naming the first contract violation."""
    # jsonschema, slow on long arrays, only for results the quick check does not pass: it names the error
    err = None if conforms(result, _schema()) else next(iter(_validator().iter_errors(result)), None)
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        what = err.message
        if err.validator == "type" and err.validator_value == "integer":
            what = f"{err.instance!r} is not a JSON integer (write token ids and indices without a fraction)"
        elif err.validator == "type" and err.validator_value == "number" and isinstance(err.instance, float):
            what = f"{err.instance!r} is not a finite number"
        raise InvalidResult(f"result does not match the schema at {where}: {what}")
    kind, _ = parse_mode(mode)
    runs = result["runs"]
    want_drafters = [None] if kind in ("greedy", "score") else [{"accuracy": a} for a in expect.accuracies]
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
            if kind != "ddtree":
                _check_step_arrays(prompt, kind, p_i, expect)


def _array(value: Any, dtype, what: str) -> np.ndarray:
    """A nested list as an array; InvalidResult when its rows have different lengths."""
    try:
        return np.array(value, dtype=dtype)
    except ValueError:
        raise InvalidResult(f"{what}: rows of different lengths (expected a rectangular array)") from None
    except OverflowError:   # the schema bounds integers below only: 2**70 is a valid JSON token id
        raise InvalidResult(f"{what}: an integer does not fit in 64 bits") from None


def _check_step_arrays(prompt: dict, kind: str, p_i: int, expect: Expectations) -> None:
    """The per-step arrays of a greedy or score result (section 4): their lengths, the top-k order,
    and expert ids. Score mode requires the top-k and reports routing for every fed token."""
    n = expect.max_new_tokens
    where = f"prompt {p_i}"
    if kind == "score":
        missing = [k for k in ("topk_ids", "topk_logits") if k not in prompt]
        if missing:
            raise InvalidResult(f"{where}: score mode requires {' and '.join(missing)} (at least 1 per step)")
    if "topk_ids" in prompt or "topk_logits" in prompt:
        ids = _array(prompt.get("topk_ids", []), np.int64, f"{where} topk_ids")
        logits = _array(prompt.get("topk_logits", []), np.float64, f"{where} topk_logits")
        if ids.shape != logits.shape or ids.ndim != 2 or ids.shape[0] != n or ids.shape[1] < 1:
            raise InvalidResult(f"{where}: topk_ids {list(ids.shape)} and topk_logits {list(logits.shape)} must "
                                f"both be [max_new_tokens = {n}][k >= 1]")
        if (ids >= expect.vocab_size).any():
            step, col = np.argwhere(ids >= expect.vocab_size)[0]
            raise InvalidResult(f"{where} step {step}: topk id {ids[step, col]} outside the vocabulary "
                                f"(size {expect.vocab_size})")
        rising = np.argwhere(np.diff(logits, axis=1) > 0)
        if rising.size:
            raise InvalidResult(f"{where} step {rising[0][0]}: topk_logits are not in descending order")
        if kind == "score" and not np.array_equal(ids[:, 0], prompt["tokens"]):
            step = int(np.flatnonzero(ids[:, 0] != np.asarray(prompt["tokens"]))[0])
            raise InvalidResult(f"{where} step {step}: tokens must be the engine's own argmax, topk_ids[j][0]")
    if "router_experts" in prompt and expect.moe_layers is not None:
        # score mode: every fed token (P prompt tokens, then golden 0..N-2); greedy: the token of each step
        rows = expect.prompt_lengths[p_i] + n - 1 if kind == "score" else n
        routed = _array(prompt["router_experts"], np.int64, f"{where} router_experts")
        want = (rows, expect.moe_layers, expect.experts_per_token)
        if routed.shape != want:
            fed = "P + N - 1 fed positions (prompt, then golden tokens)" if kind == "score" else "N steps"
            raise InvalidResult(f"{where}: router_experts is {list(routed.shape)}, expected {list(want)}: "
                                f"[{fed}][MoE layers][num_experts_per_tok]")
        if routed.size and (routed >= expect.experts).any():
            pos = np.argwhere(routed >= expect.experts)[0]
            raise InvalidResult(f"{where}: router_experts{pos.tolist()} = {routed[tuple(pos)]} is not an expert "
                                f"(n_routed_experts = {expect.experts})")
        repeated = np.diff(np.sort(routed, axis=-1), axis=-1) == 0
        if repeated.any():
            pos = np.argwhere(repeated)[0][:2]
            raise InvalidResult(f"{where}: router_experts{pos.tolist()} names an expert twice")
    if "fingerprints" in prompt and expect.layers is not None:
        fp = _array(prompt["fingerprints"], np.float64, f"{where} fingerprints")
        if fp.ndim != 3 or fp.shape[:2] != (n, expect.layers):
            raise InvalidResult(f"{where}: fingerprints is {list(fp.shape)}, expected [max_new_tokens = {n}]"
                                f"[layers = {expect.layers}][hidden]")


def expectations_from_bundle(path: str | os.PathLike, verify: bool = True) -> Expectations:
    """What the engine's result must hold, from the bundle's metadata (the engine sees the same).

    The bundle's checksums are verified first (`verify=False` only where the caller has just verified
    them): an engine must never be run, nor judged, on a damaged bundle. Raises InvalidResult naming
    the file and what is wrong, so the run becomes a failed row."""
    from ..kdtr import KdtrError, open_bundle

    try:
        with open_bundle(path, verify=verify) as b:
            meta = b.metadata
            lengths = {t.name: int(np.prod(t.shape)) for t in b.tensors if t.name.startswith("prompt.p")}
    except (KdtrError, OSError) as err:
        raise InvalidResult(f"bundle {path} failed verification, the engine was not run: {err}") from None
    fields = {"n_prompts": ("golden", "prompts"), "max_new_tokens": ("decoding", "max_new_tokens"),
              "vocab_size": ("model", "vocab_size"), "accuracies": ("golden", "ddtree", "accuracies")}
    got: dict[str, Any] = {}
    for name, keys in fields.items():
        value: Any = meta
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        ok = isinstance(value, list) and all(type(a) in (int, float) for a in value) if name == "accuracies" \
            else type(value) is int and value > 0
        if not ok:
            raise InvalidResult(f"bundle {path}: metadata {'.'.join(keys)} is {value!r}, expected "
                                f"{'a list of numbers' if name == 'accuracies' else 'a positive integer'}")
        got[name] = tuple(value) if name == "accuracies" else value
    return Expectations(**got, **_shapes(meta, lengths, path, got["n_prompts"]))


def _shapes(meta: dict, tensor_sizes: dict[str, int], path: Any, n_prompts: int) -> dict[str, Any]:
    """Prompt lengths and the layer/expert counts that fix the per-step arrays' shapes."""
    c = meta.get("hf_config")
    keys = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok")
    if not isinstance(c, dict) or any(type(c.get(k)) is not int for k in keys):
        raise InvalidResult(f"bundle {path}: metadata hf_config lacks integer {', '.join(keys)}")
    names = [f"prompt.p{i}.tokens" for i in range(n_prompts)]
    absent = [n for n in names if n not in tensor_sizes]
    if absent:
        raise InvalidResult(f"bundle {path}: tensor {absent[0]} is missing (metadata golden.prompts = {n_prompts})")
    layers = c["num_hidden_layers"]
    return {"prompt_lengths": tuple(tensor_sizes[n] for n in names), "layers": layers,
            "moe_layers": max(0, layers - c["first_k_dense_replace"]),
            "experts": c["n_routed_experts"], "experts_per_token": c["num_experts_per_tok"]}


_OPEN, _CLOSE, _QUOTE, _BACKSLASH = 1, 2, 3, 4
_BYTE_KIND = np.zeros(256, np.uint8)
_BYTE_KIND[[ord("["), ord("{")]] = _OPEN
_BYTE_KIND[[ord("]"), ord("}")]] = _CLOSE
_BYTE_KIND[ord('"')] = _QUOTE
_BYTE_KIND[ord("\\")] = _BACKSLASH


def json_nesting(data: bytes, stop_above: int | None = None) -> tuple[int, int]:
    """(deepest nesting of arrays and objects, byte offset where it is first reached) of JSON text,
    brackets inside strings not counted; before parsing, so that no depth can exhaust the parser.

    Vectorised over chunks, on the bracket, quote and backslash bytes only. Carried between chunks:
    the depth, whether a string is open, and how many backslashes end the chunk (an odd run escapes
    the quote right after it). With `stop_above`, stops after the first chunk deeper than that."""
    depth, in_string, slashes, best = 0, 0, 0, (0, -1)
    for lo in range(0, len(data), _SCAN_CHUNK):
        kinds = _BYTE_KIND[np.frombuffer(data, np.uint8, count=min(_SCAN_CHUNK, len(data) - lo), offset=lo)]
        pos = np.flatnonzero(kinds)
        if pos.size == 0:
            slashes = 0
            continue
        kind = kinds[pos]
        bs = kind == _BACKSLASH
        ids = np.arange(pos.size)
        # adjacent[i]: element i directly follows element i-1 (element 0: the previous chunk's last byte)
        adjacent = np.concatenate(([pos[0] == 0], np.diff(pos) == 1))
        prev_bs = np.concatenate(([slashes > 0], bs[:-1]))
        run_start = np.maximum.accumulate(np.where(bs & ~(adjacent & prev_bs), ids, -1))
        run = np.where(run_start >= 0, ids - run_start + 1, ids + 1 + slashes)   # backslashes ending here
        before = np.where(adjacent & prev_bs, np.concatenate(([slashes], run[:-1])), 0)
        quote = (kind == _QUOTE) & (before % 2 == 0)
        outside = (np.cumsum(quote) + in_string) % 2 == 0   # a quote is never a bracket: its parity is moot
        step = ((kind == _OPEN) & outside).astype(np.int64) - ((kind == _CLOSE) & outside)
        level = depth + np.cumsum(step)
        top = int(level.argmax())
        if level[top] > best[0]:
            best = (int(level[top]), lo + int(pos[top]))
            if stop_above is not None and best[0] > stop_above:
                break
        depth, in_string = int(level[-1]), (in_string + int(quote.sum())) % 2
        slashes = int(run[-1]) if bs[-1] and pos[-1] == kinds.size - 1 else 0
    return best


def _non_finite(token: str) -> Any:
    raise InvalidResult(f"result holds {token}: every number must be finite")


def read_result(path: Path, max_bytes: int) -> Any:
    """The engine's result file, parsed, or InvalidResult saying why it cannot be: missing, not a
    regular file (a directory, a link, a FIFO), over `max_bytes` (checked before reading), not UTF-8,
    nested deeper than MAX_RESULT_NESTING, not JSON, numbers the reader refuses (NaN, Infinity,
    integers of thousands of digits)."""
    try:
        # O_NOFOLLOW: a link could point anywhere; O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InvalidResult(f"engine exited 0 but wrote no result file at {path}") from None
    except OSError as err:
        kind = "a symbolic link" if os.path.islink(path) else "unreadable"
        raise InvalidResult(f"the result at {path} is {kind} ({err.strerror}); write a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise InvalidResult(f"the result at {path} is {kind}; write a regular file")
        if st.st_size > max_bytes:
            raise InvalidResult(f"result file is {st.st_size:,} bytes, over the limit of {max_bytes:,} "
                                f"(engine setting max_result_mb)")
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, min(max_bytes + 1 - size, 1 << 24))):
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:   # still growing: a process of the engine is writing it
        raise InvalidResult(f"result file grew past the limit of {max_bytes:,} bytes while read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidResult(f"result file is not valid JSON: not UTF-8 at byte {err.start}") from None
    deepest, at = json_nesting(data, stop_above=MAX_RESULT_NESTING)
    if deepest > MAX_RESULT_NESTING:
        raise InvalidResult(f"result file nests arrays/objects {deepest} deep (reached at byte {at}); "
                            f"the limit is {MAX_RESULT_NESTING}")
    try:
        return json.loads(text, parse_constant=_non_finite)
    except json.JSONDecodeError as err:
        raise InvalidResult(f"result file is not valid JSON: {err}") from None
    except ValueError as err:   # e.g. an integer of more digits than Python converts
        raise InvalidResult(f"result file holds a number the JSON reader refuses: {err}") from None


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
    """How the engine process ended: rc None when killed at the time limit; epoch seconds around it;
    how many processes it left behind (all killed), and why some could not be, if so."""

    rc: int | None
    started_at: float
    ended_at: float
    wall_s: float
    leftovers: int | None
    leftover_problem: str | None


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


def _run_with_limit(argv: Sequence[str], env: dict[str, str], cwd: Path, stderr_path: Path,
                    timeout_s: float) -> Finished:
    """Run `argv` in its own process group; on timeout kill the whole group. Then kill every process
    the engine left, in any session or group (the runner adopts them as child subreaper)."""
    with open(stderr_path, "ab") as err, Reaper() as reaper:
        started_at, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=err, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                env=env, start_new_session=True)
        try:
            rc = _wait(proc, timeout_s)
        except subprocess.TimeoutExpired:
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
            rc = None
        ended_at, wall = time.time(), time.perf_counter() - start
        leftovers, problem = reaper.kill_leftovers()
    return Finished(rc, started_at, ended_at, wall, leftovers, problem)


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


def write_result(output: Path, text: str) -> None:
    """The final result and its sha256 record `<output>.sha256`, by which the report notices a result
    rewritten after the runner wrote it."""
    write_text_atomic(output, text)
    write_record(output, sha256_bytes(text.encode("utf-8")))


def run_engine(*, engine: str, command: str, bundle: str, mode: str, output: str,
               gpus: int, devices: Sequence[str], lock_dir: str, timeout_s: float, stderr_path: str,
               max_result_mb: float, scratch_dir: str, sandbox: bool = False, results_dir: str | None = None,
               expect: Expectations | None = None, extra_env: dict[str, str] | None = None,
               python: str = sys.executable) -> dict[str, Any]:
    """Run the engine and write the final result (ok or failed) atomically to `output`.

    The engine runs in `scratch_dir` (wiped first; removed after an ok run, kept after a failed one
    for inspection) and writes its result there; no process it starts outlives the run. `sandbox`:
    under bubblewrap, with `results_dir` hidden but for the bundle and the scratch directory.
    `max_result_mb`: larger result files are refused before they are read. `expect`: what a valid
    result holds; None (the pipeline) reads it from the bundle after verifying the bundle's checksums."""
    kind, budget = parse_mode(mode)
    if sandbox and results_dir is None:
        raise ValueError("sandbox needs results_dir: the directory hidden from the engine")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(scratch_dir).resolve()
    dirs = fresh_scratch(scratch)
    # A runner killed with its job leaves the marker behind: the next start removes the directory.
    in_use = claim_directory(scratch)
    partial = dirs["out"] / "result.json"
    bundle_path = Path(bundle).resolve()   # the engine's working directory is its scratch directory
    stderr_file = Path(stderr_path)
    stderr_file.parent.mkdir(parents=True, exist_ok=True)
    stderr_file.write_bytes(b"")
    record: dict[str, Any] = {"engine": engine, "bundle": str(bundle), "mode": mode, "budget": budget,
                              "sandbox": sandbox}
    try:
        bundle_sha256 = verify_bundle(bundle)
        record["inputs"] = {"bundle": {"path": str(bundle), "sha256": bundle_sha256}}
        if expect is None:
            expect = expectations_from_bundle(bundle, verify=False)   # verify_bundle just checked every tensor
        if sandbox and (problem := sandbox_problem()) is not None:
            raise InvalidResult(f"sandbox: true, but {problem}")
        if bundle_path.exists():
            make_read_only(bundle_path)
        with lease(gpus, devices, lock_dir) as assigned:
            env = {**os.environ, **(extra_env or {}), **(_gpu_environment(assigned) if gpus else {}),
                   "TMPDIR": str(dirs["tmp"]), "K2VEC_WORKDIR": os.getcwd()}
            cmd = format_command(command, bundle=bundle_path, mode=kind, budget=budget, output=partial,
                                 gpus=",".join(assigned), python=python)
            argv = sandbox_command(cmd, bundle=bundle_path, scratch=scratch, home=dirs["home"],
                                   hidden=Path(str(results_dir)).resolve()) if sandbox else ["bash", "-c", cmd]
            record["gpus"] = assigned
            # asked before the engine starts, so that a run the GPU made fail still names the GPU
            record["gpu_devices"], record["gpu_identity_error"] = identify(assigned)
            record["command"] = cmd
            done = _run_with_limit(argv, env, dirs["work"], stderr_file, timeout_s)
        record.update(started_at=done.started_at, ended_at=done.ended_at, wall_s=round(done.wall_s, 6),
                      leftover_processes_killed=done.leftovers)
        if done.leftover_problem is not None:
            raise InvalidResult(done.leftover_problem)
        rc = done.rc
        check_bundle_unchanged(bundle, bundle_sha256)
        if rc is None:
            raise InvalidResult(f"timed out after {timeout_s:g} s (killed)")
        if rc != 0:
            how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
            raise InvalidResult(f"engine {how}")
        result = read_result(partial, int(max_result_mb * 2**20))
        check_result(result, mode, expect)
        final = {**result, **record, "status": "ok", "reason": None}
        try:
            text = json.dumps(final, sort_keys=True, allow_nan=False)
        except ValueError:   # 1e999 read as inf in a key the schema leaves free
            raise InvalidResult("result holds a number too large for a float (read as infinity)") from None
    except (InvalidResult, GpuError) as err:   # no devices for it: a failed row too, not a crash
        final = {"format": "k2vec-engine-result", "version": 1, **record, "status": "failed",
                 "reason": str(err), "stderr_tail": _tail(stderr_file), "runs": [], "scratch_kept": str(scratch)}
        text = json.dumps(final, sort_keys=True)
    write_result(out, text + "\n")
    if final["status"] == "ok":
        remove_tree(scratch)
    else:
        in_use.unlink(missing_ok=True)   # kept for inspection until this run's next attempt
    return final
