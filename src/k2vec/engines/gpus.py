"""Hand each running job its own GPU(s).

Snakemake's `resources: gpu=1` with `--resources gpu=8` only counts: it keeps at most 8 GPU jobs
running, but does not say which device a job may use. Each engine run therefore leases devices from
a node-wide pool of lock files, one per device: a lease is a non-blocking `flock` on
`<lock_dir>/gpu<id>.lock`, held by the wrapper process while the engine runs. The kernel drops the
lock when the holder exits, however it exits (SIGKILL included), so a crashed job never leaks a
device. Under a scheduler that already assigned devices (SLURM sets CUDA_VISIBLE_DEVICES per job),
that assignment is used as it is and nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from k2vec.errors import K2VecError


class GpuError(K2VecError):
    pass


def scheduler_assigned(environ: dict[str, str] | None = None) -> list[str] | None:
    """Devices a batch scheduler gave this job, or None when no scheduler did."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and any(k in env for k in ("SLURM_JOB_ID", "SLURM_JOBID")):
        return [d for d in visible.split(",") if d]
    return None


def detect_devices(environ: dict[str, str] | None = None) -> list[str]:
    """The node's devices: CUDA_VISIBLE_DEVICES when set (a user restricting the pool), else nvidia-smi."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def device_pool(setting: str | Sequence[Any]) -> list[str]:
    """The slot pool of config `gpus.devices`: `auto` (detect_devices) or a list of ids."""
    return detect_devices() if setting == "auto" else [str(d) for d in setting]


def _lock_name(dev: str, slot: int) -> str:
    return f"gpu{dev}.lock" if slot == 0 else f"gpu{dev}.{slot}.lock"


@contextlib.contextmanager
def lease(count: int, devices: Sequence[str], lock_dir: str | os.PathLike,
          timeout_s: float = 3600.0, poll_s: float = 0.05, jobs_per_device: int = 1) -> Iterator[list[str]]:
    """Hold `count` distinct devices of `devices` for the duration of the `with` block, each shared with at most
    `jobs_per_device - 1` other holders (one lock file per device and slot).

    Waits (polling) while fewer than `count` are free, up to `timeout_s`."""
    if count == 0:
        yield []
        return
    assigned = scheduler_assigned()
    if assigned is not None:
        if len(assigned) < count:
            raise GpuError(f"the scheduler assigned {len(assigned)} device(s) ({','.join(assigned)}) "
                           f"but the engine needs {count}")
        yield assigned[:count]
        return
    if len(devices) < count:
        raise GpuError(f"the engine needs {count} GPU(s) but the pool has {len(devices)} "
                       f"({','.join(devices) or 'none'}); set `gpus:` in config.yaml or CUDA_VISIBLE_DEVICES")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    # Start the scan at a per-process offset so simultaneous starters rarely contend for device 0.
    start = os.getpid() % len(devices)
    order = list(devices[start:]) + list(devices[:start])
    while True:
        held: list[tuple[str, int]] = []
        # slot-major: every device's first slot before any device's second, so that shared devices fill
        # evenly and a free GPU is never left idle beside a shared one
        for slot in range(jobs_per_device):
            for dev in order:
                if len(held) == count:
                    break
                if any(d == dev for d, _ in held):
                    continue
                fd = os.open(lock_dir / _lock_name(dev, slot), os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                held.append((dev, fd))
        if len(held) == count:
            try:
                yield sorted((d for d, _ in held), key=devices.index)
            finally:
                for _, fd in held:
                    os.close(fd)  # closing the descriptor releases its flock
            return
        for _, fd in held:
            os.close(fd)
        if time.monotonic() > deadline:
            raise GpuError(f"no {count} free device(s) among {','.join(devices)} after {timeout_s:.0f} s "
                           f"(locks in {lock_dir})")
        time.sleep(poll_s)


IDENTITY_QUERY = ("nvidia-smi", "--query-gpu=index,name,uuid", "--format=csv,noheader")
IDENTITY_TIMEOUT_S = 20.0


def identify(devices: Sequence[str], timeout_s: float = IDENTITY_TIMEOUT_S) -> tuple[list[dict[str, Any]], str | None]:
    """Index, name and UUID from the driver of each of `devices` (ids as in CUDA_VISIBLE_DEVICES:
    indices or UUIDs), so that a result names the physical GPU it ran on.

    Never raises: a faulty GPU can make nvidia-smi fail or hang, and the run must still be recorded.
    Devices the driver cannot name keep only their id; the second value then says why."""
    found = [{"id": str(d), "index": None, "name": None, "uuid": None} for d in devices]
    if not found:
        return found, None
    if shutil.which(IDENTITY_QUERY[0]) is None:
        return found, "nvidia-smi not found on PATH"
    try:
        out = subprocess.run(IDENTITY_QUERY, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return found, f"nvidia-smi did not answer within {timeout_s:g} s"
    except (OSError, subprocess.SubprocessError) as err:
        return found, f"nvidia-smi could not run: {err}"
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()[:1]
        return found, f"nvidia-smi exited with code {out.returncode}" + (f": {first[0]}" if first else "")
    listed: dict[str, dict[str, Any]] = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        # index first, UUID last; a name with a comma in it stays whole
        gpu = {"index": int(parts[0]), "name": ", ".join(parts[1:-1]), "uuid": parts[-1]}
        listed[parts[0]] = listed[gpu["uuid"]] = gpu
    for dev in found:
        dev.update(listed.get(dev["id"], {}))
    missing = [dev["id"] for dev in found if dev["uuid"] is None]
    if missing:
        known = sorted({g["index"] for g in listed.values()})
        return found, (f"device(s) {', '.join(missing)} not among the GPUs nvidia-smi lists "
                       f"({', '.join(map(str, known)) or 'none'})")
    return found, None


def short_uuid(uuid: str) -> str:
    """'GPU-1a2b3c4d-...' -> 'GPU-1a2b3c4d' (likewise 'MIG-...'): enough to tell a node's GPUs apart."""
    prefix, dash, rest = uuid.partition("-")
    return prefix + dash + rest[:8] if dash else uuid[:12]
