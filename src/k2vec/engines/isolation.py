"""Keep an engine run from touching anything but its own scratch directory, and from outliving its run.

- Scratch: each run gets `work/` (its working directory), `out/` (where it writes its result),
  `tmp/` (TMPDIR) and `home/` (HOME, in the sandbox only) under its own scratch directory, wiped
  before the run.
- Leftover processes: the runner is made a child subreaper (Linux prctl) for the run, so a process
  the engine detaches (double fork, `setsid`, daemon) is re-parented to the runner instead of init;
  when the engine exits or is killed at its time limit, every process below the runner that was not
  there before the run is killed and reaped.
- Sandbox (bubblewrap; on by default where it works): an unprivileged uid (65534) in a user
  namespace of its own, with no capabilities and no_new_privs, even when the pipeline runs as root,
  so the engine can neither undo the mounts below (they are locked) nor make new ones; the whole
  filesystem read-only (/tmp and HOME included), `results/` hidden behind an empty tmpfs except the
  run's bundle (read-only) and its scratch directory (writable), a fresh /dev with the GPU device
  nodes passed through, its own PID namespace with its own /proc (no other process of the host is
  visible), its own IPC and UTS namespaces, a new session (no TIOCSTI into the runner's terminal),
  and no further user namespaces.
- The runner itself is made non-dumpable (PR_SET_DUMPABLE 0): a process of the same user cannot
  ptrace it or read its /proc/<pid>/mem and environ (root still can).
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
REAP_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------------------- scratch


def remove_tree(path: Path) -> None:
    """Remove a directory tree the engine may have made unwritable (chmod 000 dirs, read-only files)."""
    def retry(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=retry)


def fresh_scratch(scratch: Path) -> dict[str, Path]:
    """Empty `work/`, `out/`, `tmp/` and `home/` (HOME in the sandbox) under `scratch`, anything older removed."""
    remove_tree(scratch)
    dirs = {name: scratch / name for name in ("work", "out", "tmp", "home")}
    for d in dirs.values():
        d.mkdir(parents=True)
    return dirs


def make_read_only(path: Path) -> None:
    """Clear the write bits of an input. This stops engines running as an ordinary user; root ignores
    permission bits, which is why the sandbox binds inputs read-only. Best effort: an input owned by
    another user stays as it is."""
    try:
        mode = path.stat().st_mode
        if mode & 0o222:
            path.chmod(stat.S_IMODE(mode) & ~0o222)
    except OSError:
        pass


# --------------------------------------------------------------------------------- leftover processes


def _set_subreaper(on: bool) -> bool:
    """Make this process (or stop it being) the reaper of orphaned descendants; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(int(on)), 0, 0, 0) == 0


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command name) of every process visible in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                head, tail = fh.read().rsplit(b")", 1)   # the command name may hold spaces and ')'
            fields = tail.split()
        except (OSError, ValueError):
            continue   # exited meanwhile
        table[int(name)] = (int(fields[1]), fields[0].decode(), head.split(b"(", 1)[-1].decode("utf-8", "replace"))
    return table


class Reaper:
    """Around one engine run: adopts what the engine detaches, and kills all of it afterwards."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.active = False
        self.before: set[int] = set()

    def __enter__(self) -> "Reaper":
        self.active = _set_subreaper(True) and os.path.isdir("/proc")
        # children the runner already had (none in the pipeline) are not the engine's
        self.before = {pid for pid, (ppid, *_) in _process_table().items() if ppid == self.me} if self.active else set()
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            _set_subreaper(False)

    def leftovers(self) -> dict[int, tuple[int, str, str]]:
        """Processes below the runner that were not there before the run (the engine's), zombies included."""
        table = _process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_) in table.items():
            children.setdefault(ppid, []).append(pid)
        found, stack = {}, [c for c in children.get(self.me, []) if c not in self.before]
        while stack:
            pid = stack.pop()
            found[pid] = table[pid]
            stack.extend(children.get(pid, []))
        return found

    def kill_leftovers(self, timeout_s: float = REAP_TIMEOUT_S) -> tuple[int | None, str | None]:
        """SIGKILL every leftover process and reap those re-parented to the runner, until none is left.
        Returns (how many were killed, None), (count, which survived), or (None, None) where leftovers
        cannot be tracked (not Linux): then only the engine's process group is killed. Never raises."""
        if not self.active:
            return None, None
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.leftovers()
            if not left:
                return len(killed), None
            for pid, (ppid, state, name) in left.items():
                if state != "Z":
                    try:
                        os.kill(pid, signal.SIGKILL)
                        # bubblewrap's own inner process, re-parented here when the outer one exits first,
                        # may still be exiting: killing it is no news of the engine, and counting it would make
                        # the count (a field of every result) differ from run to run
                        if name != "bwrap":
                            killed.add(pid)
                    except ProcessLookupError:
                        pass
                elif ppid == self.me:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
            if time.monotonic() > deadline:
                return len(killed), (f"{len(left)} process(es) of the engine still there after {timeout_s:g} s "
                                     f"of SIGKILL: {sorted(left)[:10]}")
            time.sleep(0.01)


# ------------------------------------------------------------------------------------------- sandbox


def gpu_device_nodes() -> list[str]:
    """The NVIDIA device nodes an engine needs to reach its GPUs (none on a machine without them)."""
    return sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri/*"))


# The uid and gid an engine runs as inside the sandbox ("nobody"). Mapped, in the user namespace that
# bwrap creates, onto the pipeline's own uid (the only one an unprivileged process may map): files the
# engine writes in its scratch directory belong to the pipeline's user on the host, while the engine
# holds no capability in the host's namespaces, whatever uid the pipeline runs as.
SANDBOX_UID = 65534
# Namespaces and privileges, shared by the probe and the real command: a host that cannot give one
# of them (no user namespaces, say) cannot sandbox.
_SANDBOX_BASE = ("bwrap", "--die-with-parent", "--new-session", "--unshare-user", "--uid", str(SANDBOX_UID),
                 "--gid", str(SANDBOX_UID), "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                 "--unshare-cgroup-try", "--cap-drop", "ALL", "--ro-bind", "/", "/", "--dev", "/dev",
                 "--proc", "/proc", "--tmpfs", "/dev/shm")


def sandbox_command(command: str, *, bundle: Path, scratch: Path, hidden: Path, home: Path,
                    build: Path | None = None, cache: Path | None = None) -> list[str]:
    """bubblewrap around `bash -c command` (_SANDBOX_BASE: uid 65534 without capabilities, own PID, IPC,
    UTS and user namespaces): read-only root, `hidden` (the results directory) replaced by an empty
    tmpfs except `bundle` (read-only), `build` (the engine's own build directory under it, read-only,
    where it has one), `cache` (the engine's own cache directory, writable and kept across its runs:
    XDG_CACHE_HOME and TRITON_CACHE_DIR point there, so compiled kernels are compiled once) and `scratch`
    (writable), fresh /dev and /proc, a private /dev/shm. /tmp stays read-only like the rest: TMPDIR
    points into the scratch directory."""
    args = list(_SANDBOX_BASE)
    for node in gpu_device_nodes():
        args += ["--dev-bind", node, node]
    # the tmpfs over `hidden` is made read-only once the binds are on it: writes there fail too,
    # instead of landing in a throw-away tmpfs
    args += ["--tmpfs", str(hidden), "--ro-bind", str(bundle), str(bundle)]
    if build is not None:
        args += ["--ro-bind", str(build), str(build)]
    if cache is not None:
        args += ["--bind", str(cache), str(cache), "--setenv", "XDG_CACHE_HOME", str(cache),
                 "--setenv", "TRITON_CACHE_DIR", str(cache / "triton")]
    args += ["--bind", str(scratch), str(scratch), "--remount-ro", str(hidden), "--setenv", "HOME", str(home),
             "--setenv", "USER", "nobody", "--setenv", "LOGNAME", "nobody", "--chdir", str(scratch / "work"),
             "bash", "-c", command]
    return args


@lru_cache(maxsize=None)
def sandbox_problem() -> str | None:
    """Why the sandbox cannot run here (bwrap missing, or unable to create its namespaces), else None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    try:
        probe = subprocess.run([*_SANDBOX_BASE, "true"], capture_output=True, text=True, timeout=30,
                               stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as err:
        return f"bwrap could not run: {err}"
    if probe.returncode != 0:
        return f"bwrap cannot create its namespaces here: {probe.stderr.strip() or f'exit code {probe.returncode}'}"
    return None


def make_undumpable() -> bool:
    """PR_SET_DUMPABLE 0 for this process (the runner): processes of the same uid can no longer
    ptrace it or read its /proc/<pid>/mem, environ or fds, where the integrity key sits while an
    engine runs. Root (CAP_SYS_PTRACE) still can. The engine, once exec'd, is dumpable again.
    False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_DUMPABLE, ctypes.c_ulong(0), 0, 0, 0) == 0
