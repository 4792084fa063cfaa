"""Engine isolation: its own scratch directory, no process outliving its run, and the opt-in sandbox."""
import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from test_runner import EXPECT, fake_engine, good_result

from k2vec.engines.isolation import sandbox_problem
from k2vec.engines.runner import run_engine
from k2vec.digests import write_record
from k2vec.kdtr.writer import write_bundle

GOOD = f"json.dump({good_result()!r}, open(out, 'w'))\n"


def run(tmp_path, body, timeout_s=20.0, sandbox=False, bundle=None, required=True):
    """Run a fake engine the way the pipeline lays out results/ (bundle, runs, scratch)."""
    results = tmp_path / "results"
    if bundle is None:
        bundle = results / "bundles" / "b.kdtr"
        bundle.parent.mkdir(parents=True, exist_ok=True)
        if not bundle.exists():
            write_bundle(bundle, [("w", np.arange(8, dtype=np.float32))], {"x": 1})
            write_record(bundle)
    out = results / "runs" / "fake" / "r.json"
    r = run_engine(engine="fake", command=fake_engine(tmp_path, body) + " {bundle}", bundle=str(bundle),
                   mode="greedy", output=str(out), expect=EXPECT, gpus=0, devices=[],
                   lock_dir=str(tmp_path / "locks"), timeout_s=timeout_s, stderr_path=str(tmp_path / "stderr.log"),
                   max_result_mb=1.0, scratch_dir=str(results / "scratch" / "fake" / "r"), sandbox=sandbox,
                   results_dir=str(results), **({} if required else {"sandbox_required": False}))
    assert json.loads(out.read_text()) == r
    return r


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (zombies have an empty command line)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


# ------------------------------------------------------------------------------------------- scratch


def test_engine_runs_in_its_scratch_directory_removed_after_an_ok_run(tmp_path):
    seen = tmp_path / "seen.json"
    body = (f"json.dump({{'cwd': os.getcwd(), 'tmp': os.environ['TMPDIR'], 'out': out, 'bundle': sys.argv[2], "
            f"'workdir': os.environ['K2VEC_WORKDIR']}}, open({str(seen)!r}, 'w'))\n"
            "open('junk.bin', 'wb').write(b'x' * 1000)\n" + GOOD)
    r = run(tmp_path, body)
    s = json.loads(seen.read_text())
    scratch = tmp_path / "results" / "scratch" / "fake" / "r"
    assert r["status"] == "ok", r["reason"]
    assert s["cwd"] == str(scratch / "work") and s["tmp"] == str(scratch / "tmp")
    assert s["out"] == str(scratch / "out" / "result.json")
    assert s["bundle"] == str(tmp_path / "results" / "bundles" / "b.kdtr")   # absolute: cwd is not the repo
    assert s["workdir"] == os.getcwd()
    assert not scratch.exists()
    # the bundle is left read-only (this stops a non-root engine; root ignores the bits)
    assert stat.S_IMODE((tmp_path / "results" / "bundles" / "b.kdtr").stat().st_mode) & 0o222 == 0


def test_failed_run_keeps_its_scratch_until_the_next_run(tmp_path):
    r = run(tmp_path, "open(out, 'w').write('{\"runs\": [')\nopen('core', 'w').write('dump')\nsys.exit(0)")
    scratch = Path(r["scratch_kept"])
    assert r["status"] == "failed" and "not valid JSON" in r["reason"]
    assert (scratch / "out" / "result.json").read_text() == '{"runs": [' and (scratch / "work" / "core").exists()
    # the engine made part of it unwritable: the next run still starts from an empty scratch directory
    os.chmod(scratch / "work", 0o500)
    r = run(tmp_path, "assert os.listdir('.') == [] and os.listdir(os.path.dirname(out)) == []\n" + GOOD)
    assert r["status"] == "ok", r["stderr_tail"]
    assert not scratch.exists()


# --------------------------------------------------------------------------------- leftover processes


DETACH = {
    "setsid sleep": "os.system('setsid sleep {m} > /dev/null 2>&1 &')\n",
    "python double fork + setsid": (
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execvp('sleep', ['sleep', '{m}'])\n"
        "    os._exit(0)\n"
        "os.wait()\n"),
    "forking loop in a new session": "os.system('setsid bash -c \"while true; do sleep {m} & sleep 0.01; done\" "
                                     "> /dev/null 2>&1 &')\n",
}


@pytest.mark.parametrize("how", DETACH)
@pytest.mark.parametrize("ending", ["exit 0", "timeout"])
def test_no_process_of_the_engine_outlives_its_run(tmp_path, how, ending):
    marker = f"1000.{time.time_ns() % 10**9:09d}"   # `sleep 1000.xxx`: a command line no one else has
    body = DETACH[how].format(m=marker) + "time.sleep(0.3)\n" + (GOOD if ending == "exit 0" else "time.sleep(60)\n")
    t = time.monotonic()
    r = run(tmp_path, body, timeout_s=2.0)
    assert time.monotonic() - t < 20
    assert processes_with(marker) == []
    assert r["leftover_processes_killed"] >= 1
    if ending == "exit 0":
        assert r["status"] == "ok", r["reason"]
    else:
        assert r["status"] == "failed" and "timed out after 2 s" in r["reason"]


# ------------------------------------------------------------------------------------------- sandbox


@pytest.fixture
def sandbox_ok():
    problem = sandbox_problem()
    if problem is not None and "namespaces" in problem:
        pytest.skip(f"bubblewrap cannot sandbox in this container: {problem}")
    assert problem is None, problem   # CI installs bubblewrap (.ci/run); missing it is an error, not a skip


def test_sandboxed_engine_cannot_write_outside_its_output_directory(tmp_path, sandbox_ok):
    results = tmp_path / "results"
    other = results / "runs" / "other" / "victim.json"
    other.parent.mkdir(parents=True)
    other.write_text('{"untouched": true}')
    outside = {"repository file": tmp_path / "src-file.py", "other engine's result": other,
               "new file in results": results / "new.json",
               "the bundle": results / "bundles" / "b.kdtr", "home": Path(os.path.expanduser("~")) / ".k2vec-probe"}
    (tmp_path / "src-file.py").write_text("original\n")
    body = (f"targets = {({k: str(v) for k, v in outside.items()})!r}\n"
            "res = {}\n"
            "for what, path in targets.items():\n"
            "    try:\n"
            "        with open(path, 'ab') as fh:\n"
            "            fh.write(b'tampered')\n"
            "        res[what] = 'written'\n"
            "    except OSError as e:\n"
            "        res[what] = e.strerror\n"
            "res['sees other results'] = os.path.exists(targets[\"other engine's result\"])\n"
            "res['reads bundle'] = len(open(sys.argv[2], 'rb').read())\n"
            "open('in-work-dir', 'w').write('fine')\n"
            f"print(json.dumps(res), file=sys.stderr)\n" + GOOD)
    r = run(tmp_path, body, sandbox=True)
    assert r["status"] == "ok" and r["sandbox"] is True, r.get("stderr_tail")
    assert not outside["home"].exists()
    assert (tmp_path / "src-file.py").read_text() == "original\n"
    assert other.read_text() == '{"untouched": true}'
    with open(results / "bundles" / "b.kdtr", "rb") as fh:
        assert b"tampered" not in fh.read()
    # what the engine saw, from its log
    seen = json.loads((tmp_path / "stderr.log").read_text().strip().splitlines()[-1])
    assert seen["repository file"] == "Read-only file system" and seen["home"] == "Read-only file system"
    # the bundle's write bits are cleared, and the engine is no longer root: refused before the mount is asked
    assert seen["the bundle"] in ("Read-only file system", "Permission denied")
    assert seen["new file in results"] == "Read-only file system"
    assert not (results / "new.json").exists()
    assert seen["other engine's result"] != "written" and seen["sees other results"] is False
    assert seen["reads bundle"] == (results / "bundles" / "b.kdtr").stat().st_size


PROBE = """
import subprocess
def pids():
    return sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
def cmdlines():
    out = []
    for p in pids():
        try:
            out.append(open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode())
        except OSError:
            pass
    return out
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines() if ':' in line)
res = {k: status[k].split()[0] for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'Uid', 'NoNewPrivs')}
res['cmdlines'] = cmdlines()
for name, cmd in {'umount results': ['umount', '-l', RESULTS], 'umount proc': ['umount', '-l', '/proc'],
                  'remount rw': ['mount', '-o', 'remount,bind,rw', '/'],
                  'new userns': ['unshare', '-Urm', 'true']}.items():
    res[name] = subprocess.run(cmd, capture_output=True).returncode
res['cmdlines after'] = cmdlines()
res['sees other results'] = os.path.exists(OTHER)
try:
    open(OTHER, 'a').write('forged')
    res['write other'] = 'written'
except OSError as e:
    res['write other'] = e.strerror
print(json.dumps(res), file=sys.stderr)
"""


def test_sandboxed_engine_has_no_privilege_and_sees_no_other_process(tmp_path, sandbox_ok):
    """As root (the CI container) too: no capability, uid 65534, no_new_privs; the mounts cannot be
    undone (umount, remount read-write, a new user namespace all fail); its /proc holds its own
    processes only, before and after trying to unmount it."""
    results = tmp_path / "results"
    other = results / "runs" / "other" / "victim.json"
    other.parent.mkdir(parents=True)
    other.write_text('{"untouched": true}')
    marker = f"1000.{time.time_ns() % 10**9:09d}"
    host = subprocess.Popen(["sleep", marker])   # a process of the host, visible in the host's /proc
    try:
        body = f"RESULTS, OTHER = {str(results)!r}, {str(other)!r}\n" + PROBE + GOOD
        r = run(tmp_path, body, sandbox=True)
    finally:
        host.kill()
        host.wait()
    assert r["status"] == "ok" and r["sandbox"] is True, r.get("stderr_tail")
    seen = json.loads((tmp_path / "stderr.log").read_text().strip().splitlines()[-1])
    assert {k: int(seen[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")} == \
        {"CapEff": 0, "CapPrm": 0, "CapBnd": 0, "CapAmb": 0}, seen
    assert seen["Uid"] == "65534" and seen["NoNewPrivs"] == "1"
    for step in ("umount results", "umount proc", "remount rw", "new userns"):
        assert seen[step] != 0, (step, seen)
    for when in ("cmdlines", "cmdlines after"):
        # bwrap's init, bash, the engine: nothing of the host (pytest, Snakemake, the runner, `sleep`)
        assert len(seen[when]) <= 4 and not any(marker in c for c in seen[when]), seen[when]
    assert seen["sees other results"] is False and seen["write other"] != "written"
    assert other.read_text() == '{"untouched": true}'


def test_runner_is_not_dumpable(tmp_path):
    """PR_SET_DUMPABLE 0: a process of the pipeline's uid cannot ptrace the runner nor read its memory
    (root still can: the sandbox is what stops a root engine)."""
    import ctypes
    run(tmp_path, GOOD)
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0   # PR_GET_DUMPABLE


def test_sandboxed_engine_processes_die_with_the_run(tmp_path, sandbox_ok):
    marker = f"1000.{time.time_ns() % 10**9:09d}"
    r = run(tmp_path, DETACH["setsid sleep"].format(m=marker) + GOOD, sandbox=True)
    assert r["status"] == "ok", r["stderr_tail"]
    assert processes_with(marker) == []


def test_sandbox_where_bubblewrap_cannot_run_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.setattr("k2vec.engines.runner.sandbox_problem", lambda: "bubblewrap (bwrap) is not installed")
    r = run(tmp_path, GOOD, sandbox=True)
    assert r["status"] == "failed" and r["reason"] == "sandbox: true, but bubblewrap (bwrap) is not installed"


def test_sandbox_without_bubblewrap_is_a_config_error(monkeypatch, config):
    """An explicit sandbox: true is refused where bwrap cannot run; engines left at the default (true)
    fall back, named for the notice; sandbox: false never probes."""
    from k2vec.errors import ConfigError
    from k2vec.config.engines import check_sandboxes, resolve_engines
    from conftest import REPO

    def absent():
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"

    config["engines"] = {"numpy": config["engines"]["numpy"]}
    config["engines"]["numpy"].pop("sandbox", None)
    engines = resolve_engines(config, str(REPO))
    assert engines["numpy"]["sandbox"] is True and engines["numpy"]["sandbox_required"] is False
    assert check_sandboxes(engines, absent) == ["numpy"]
    assert check_sandboxes(engines, lambda: None) == []
    config["engines"]["numpy"]["sandbox"] = True
    with pytest.raises(ConfigError, match=r"engines\.numpy\.sandbox.*bwrap\) is not installed.*or set sandbox: false"):
        check_sandboxes(resolve_engines(config, str(REPO)), absent)
    config["engines"]["numpy"]["sandbox"] = False
    assert check_sandboxes(resolve_engines(config, str(REPO)),
                           lambda: pytest.fail("probed with no sandboxed engine")) == []


def test_default_sandbox_where_bubblewrap_cannot_run_falls_back_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr("k2vec.engines.runner.sandbox_problem", lambda: "bubblewrap (bwrap) is not installed")
    r = run(tmp_path, GOOD, sandbox=True, required=False)
    assert r["status"] == "ok" and r["sandbox"] is False
    assert r["sandbox_problem"] == "bubblewrap (bwrap) is not installed"


def test_an_engine_orphaned_by_a_killed_pipeline_is_killed_at_the_next_start(tmp_path):
    """kill -9 of the pipeline's process group leaves the engine (its own session) running, re-parented to
    init, beside the rerun's engine on the same scratch path. The next start of the pipeline
    (claim_working_directory, as the Snakefile calls it) kills it, found by the scratch directory it works in."""
    from k2vec.pipeline.setup import claim_working_directory, release

    started = tmp_path / "engine.pid"
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import sys\nsys.path[:0] = [sys.argv[1], sys.argv[2]]\nfrom pathlib import Path\n"
        "from test_isolation import run\n"
        f"run(Path(sys.argv[3]), \"open({str(started)!r}, 'w').write(str(os.getpid()))\\n"
        f"while True: time.sleep(1)\\n\", timeout_s=600)\n")
    proc = subprocess.Popen([sys.executable, str(runner), str(REPO / "src"), str(REPO / "tests"), str(tmp_path)],
                            cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the engine never started"
            time.sleep(0.1)
        engine = int(started.read_text())
        os.killpg(proc.pid, 9)   # the pipeline's process group: the runner; not the engine's own session
        proc.wait()
        assert alive(engine), "the engine should have outlived the killed runner"
        cleanup = claim_working_directory(tmp_path)
        release()
        assert tmp_path / "results/scratch/fake/r" in cleanup.temporaries
        deadline = time.monotonic() + 10
        while alive(engine):
            assert time.monotonic() < deadline, f"orphaned engine {engine} still running after the next start"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_full_disk_at_the_result_gives_a_failed_row(tmp_path, monkeypatch):
    """No space left for the result (an engine that filled the disk with its scratch): a failed row that
    says so, written after the scratch directory is removed to make room, never a runner crash."""
    from k2vec.engines import runner

    real, calls = runner.write_result, []

    def full_at_first(path, text, key):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text, key)

    monkeypatch.setattr(runner, "write_result", full_at_first)
    r = run(tmp_path, "open('filler', 'wb').write(b'0' * 4096)\n" + GOOD)
    assert r["status"] == "failed" and len(calls) == 2
    assert r["reason"].startswith("no space left on device for the result (No space left on device)"), r["reason"]
    assert r["scratch_kept"] is None and not (tmp_path / "results/scratch/fake/r").exists()


def test_an_engine_log_past_its_cap_keeps_its_tail(tmp_path, monkeypatch):
    from k2vec.engines import runner

    monkeypatch.setattr(runner, "LOG_LIMIT_BYTES", 10_000)
    monkeypatch.setattr(runner, "LOG_KEEP_BYTES", 1_000)
    r = run(tmp_path, "sys.stderr.write('x' * 50_000 + 'the last words\\n')\n" + GOOD)
    log = (tmp_path / "stderr.log").read_bytes()
    assert r["status"] == "ok"
    assert log.startswith(b"[k2vec: the first 49015 bytes of the engine's output were cut") and len(log) < 1_200
    assert log.endswith(b"the last words\n")


@pytest.mark.skipif(sandbox_problem() is not None, reason="bubblewrap cannot sandbox here")
def test_a_sandboxed_engine_keeps_its_own_cache_across_its_runs(tmp_path):
    """XDG_CACHE_HOME and TRITON_CACHE_DIR: a directory of the engine's own under results/cache/, writable
    and kept from one of its runs to the next (a GPU engine compiles its kernels once, not every run)."""
    body = ("cache = os.environ['XDG_CACHE_HOME']\n"
            "assert os.environ['TRITON_CACHE_DIR'] == os.path.join(cache, 'triton')\n"
            "seen = open(os.path.join(cache, 'runs')).read() if os.path.exists(os.path.join(cache, 'runs')) else ''\n"
            "open(os.path.join(cache, 'runs'), 'w').write(seen + 'x')\n" + GOOD)
    for _ in range(2):
        assert run(tmp_path, body, sandbox=True)["status"] == "ok"
    assert (tmp_path / "results/cache/fake/runs").read_text() == "xx"


def test_a_scratch_directory_that_cannot_be_cleared_gives_a_failed_row(tmp_path, monkeypatch):
    """What an earlier run left and nothing can remove (a file it made immutable with chattr +i, which
    unlink and rmtree cannot touch, simulated by a removal that leaves everything in place): a failed row
    naming the directory, never the runner's FileExistsError."""
    from k2vec.engines import isolation

    scratch = tmp_path / "results/scratch/fake/r"
    scratch.mkdir(parents=True)
    (scratch / "work").write_text("an immutable file where the run's working directory goes")
    monkeypatch.setattr(isolation, "remove_tree", lambda path: None)
    r = run(tmp_path, GOOD)
    assert r["status"] == "failed" and r["reason"].startswith(f"cannot clear the scratch directory {scratch}")
    assert "File exists" in r["reason"]
