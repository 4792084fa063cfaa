"""bench/loop.py's phases: where a `snakemake` call's wall time went, read from its output timed line by line."""
import pytest

from conftest import bench_module


@pytest.fixture(scope="module")
def loop():
    return bench_module("loop")


def test_phases_of_a_run_and_of_a_dry_run(loop):
    run = loop.Call(wall_s=9.0, cpu_s=12.0, returncode=0, lines=[
        (0.7, "Building DAG of jobs..."), (0.9, "localrule engine_batch_numpy:"), (0.9, "    jobid: 31"),
        (1.0, "rule report:"), (1.0, "    jobid: 76"), (2.9, "Finished jobid: 31 (Rule: engine_batch_numpy)"),
        (7.5, "Finished jobid: 76 (Rule: report)"), (7.6, "6 of 6 steps (100%) done"),
        (7.9, "Elapsed time: 0:00:07.3")])
    assert loop.phases(run) == {"first_job_s": 0.9, "jobs_done_s": 7.5, "report_s": pytest.approx(6.5),
                                "exit_s": pytest.approx(1.1)}
    assert loop.jobs_run(run.text) == 6
    dry = loop.Call(wall_s=1.0, cpu_s=1.1, returncode=0, lines=[(0.9, "Nothing to be done.")])
    assert loop.phases(dry) == {"first_job_s": None, "jobs_done_s": None, "report_s": None,
                                "exit_s": pytest.approx(0.1)}


def test_the_report_jobs_span_is_its_own_not_another_jobs(loop):
    """The report's span runs from its announcement to its own "Finished" line, past other jobs' lines; a report
    that never finished has none."""
    lines = [(1.0, "localrule report:"), (1.0, "    input: results/runs/numpy/tiny-fp32-greedy.json"),
             (1.0, "    jobid: 7"), (2.0, "Finished jobid: 70 (Rule: engine_batch_numpy)"),
             (3.5, "Finished jobid: 7 (Rule: report)")]
    assert loop.job_span(loop.Call(4.0, 4.0, 0, lines), "report") == pytest.approx(2.5)
    assert loop.job_span(loop.Call(4.0, 4.0, 1, lines[:-1]), "report") is None
    assert loop.job_span(loop.Call(4.0, 4.0, 0, lines), "all") is None
