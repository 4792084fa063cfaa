"""The GPU slot pool: exclusive leases, all slots used, crash-safe, scheduler assignments respected."""
import contextlib
import multiprocessing as mp
import os
import time

import pytest

from k2vec.engines.gpus import GpuError, detect_devices, lease, scheduler_assigned


def _job(lock_dir, devices, count, hold_s, queue):
    with lease(count, devices, lock_dir, timeout_s=30) as got:
        start = time.monotonic()
        time.sleep(hold_s)
        queue.put((tuple(got), start, time.monotonic()))


def test_twelve_jobs_four_slots_never_shared(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = ["0", "1", "2", "3"]
    queue = mp.Queue()
    procs = [mp.Process(target=_job, args=(tmp_path, devices, 1, 0.3, queue)) for _ in range(12)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    records = [queue.get(timeout=5) for _ in procs]
    assert {r[0][0] for r in records} == set(devices)
    for i, (dev_a, s_a, e_a) in enumerate(records):
        for dev_b, s_b, e_b in records[i + 1:]:
            if dev_a == dev_b:
                assert e_a <= s_b or e_b <= s_a, f"device {dev_a} leased twice at once"


def test_multi_gpu_lease_is_disjoint(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with lease(2, ["0", "1", "2", "3"], tmp_path) as a, lease(2, ["0", "1", "2", "3"], tmp_path) as b:
        assert len(a) == len(b) == 2 and not set(a) & set(b)
        with pytest.raises(GpuError, match="no 1 free device"):
            with lease(1, ["0", "1", "2", "3"], tmp_path, timeout_s=0.2):
                pass


def test_jobs_per_device_shares_a_device_up_to_its_count(tmp_path, monkeypatch):
    """gpus.jobs_per_device: 3 leases of one device at once, a fourth waits; a 2-GPU lease still gets two
    distinct devices."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with lease(1, ["0"], tmp_path, jobs_per_device=3) as a, lease(1, ["0"], tmp_path, jobs_per_device=3) as b, \
            lease(1, ["0"], tmp_path, jobs_per_device=3) as c:
        assert a == b == c == ["0"]
        with pytest.raises(GpuError, match="no 1 free device"):
            with lease(1, ["0"], tmp_path, timeout_s=0.2, jobs_per_device=3):
                pass
    with lease(2, ["0", "1"], tmp_path / "two", jobs_per_device=4) as both:
        assert sorted(both) == ["0", "1"]
        with lease(2, ["0", "1"], tmp_path / "two", jobs_per_device=4) as again:
            assert sorted(again) == ["0", "1"]


def test_shared_devices_fill_evenly(tmp_path, monkeypatch):
    """With jobs_per_device 4 on 3 devices, every device holds one job before any holds a second: six leases
    taken in turn (in one process, so every scan starts at the same device) land two on each."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with contextlib.ExitStack() as stack:
        got = [stack.enter_context(lease(1, ["0", "1", "2"], tmp_path, jobs_per_device=4))[0] for _ in range(6)]
        assert sorted(got[:3]) == ["0", "1", "2"] and sorted(got) == ["0", "0", "1", "1", "2", "2"], got


def _hold_then_die(lock_dir):
    with lease(1, ["0"], lock_dir):
        os.kill(os.getpid(), 9)


def test_lock_released_when_holder_is_killed(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = mp.Process(target=_hold_then_die, args=(tmp_path,))
    p.start()
    p.join(10)
    assert p.exitcode == -9
    with lease(1, ["0"], tmp_path, timeout_s=1) as got:
        assert got == ["0"]


def test_scheduler_assignment_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    assert scheduler_assigned() == ["5", "6"]
    with lease(1, ["0"], tmp_path) as got:
        assert got == ["5"]
    assert not any(tmp_path.iterdir())  # nothing locked
    with pytest.raises(GpuError, match="assigned 2"):
        with lease(3, [], tmp_path):
            pass


def test_pool_too_small_and_detection(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert detect_devices() == ["2", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(GpuError, match="pool has 0"):
        with lease(1, [], tmp_path):
            pass
    with lease(0, [], tmp_path) as got:
        assert got == []
