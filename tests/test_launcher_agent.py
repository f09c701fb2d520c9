"""The launcher's restart and preemption policy (`keras_dist.launchers.agent.Job`), with
real short-lived processes: each task is a Python one-liner whose exit depends on the
attempt. The end-to-end runs of the same policy are in test_api.py and test_resume.py."""

import dataclasses
import io
import os
import signal
import sys
import threading
import time

import pytest

from keras_dist.launchers.agent import Job, JobState
from keras_dist.launchers.base import Task
from runner import JOB_SECRET

pytestmark = pytest.mark.timeout(60)


def tasks_exiting(codes_by_attempt):
    """`tasks_for` of a job of two tasks: at attempt A, task rank:R exits with codes_by_attempt[A][R]."""
    def tasks_for(attempt):
        codes = codes_by_attempt[min(attempt, len(codes_by_attempt) - 1)]
        return [Task(f"rank:{rank}", [sys.executable, "-c", f"import sys, time; time.sleep(0.2); sys.exit({code})"])
                for rank, code in enumerate(codes)]
    return tasks_for


def test_a_job_whose_tasks_succeed_ends_at_once():
    job = Job(tasks_exiting([[0, 0]]), max_restarts=2, out=io.StringIO())
    result = job.run()
    assert (result.state, result.exit_code, result.attempts, result.failed_task) == (JobState.SUCCEEDED, 0, 1, None)
    assert job.history == [JobState.RUNNING, JobState.SUCCEEDED]


def test_a_failed_task_restarts_the_job_until_it_succeeds():
    out = io.StringIO()
    job = Job(tasks_exiting([[0, 3], [0, 0]]), max_restarts=2, out=out)
    result = job.run()
    assert (result.state, result.exit_code, result.attempts) == (JobState.SUCCEEDED, 0, 2)
    assert job.history == [JobState.RUNNING, JobState.RESTARTING, JobState.RUNNING, JobState.SUCCEEDED]
    assert "the job failed (task rank:1 exited with 3); restart 1 of 2" in out.getvalue()


def test_restarts_spent_end_the_job_naming_the_failed_task():
    job = Job(tasks_exiting([[0, 3], [5, 0]]), max_restarts=1, out=io.StringIO())
    result = job.run()
    assert (result.state, result.exit_code, result.attempts, result.failed_task) == (JobState.FAILED, 5, 2, "rank:0")
    assert result.describe() == "the job failed after 2 attempts: task rank:0 exited with 5"


def test_a_task_that_saved_at_a_notice_is_not_restarted():
    # 143: a task that got SIGTERM itself (one pod signalled) saved and exited.
    job = Job(tasks_exiting([[143, 143], [0, 0]]), max_restarts=3, out=io.StringIO())
    result = job.run()
    assert (result.state, result.exit_code, result.attempts) == (JobState.PREEMPTED, 143, 1)


def test_a_notice_to_the_launcher_is_passed_on_and_ends_the_job_preempted(tmp_path):
    ready = tmp_path / "ready"
    # Each task exits 143 at the SIGTERM passed on to it, as a task that saved does.
    script = ("import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
              f"pathlib.Path({str(ready)!r} + sys.argv[1]).touch(); time.sleep(30)")

    def tasks_for(attempt):
        return [Task(f"rank:{rank}", [sys.executable, "-c", script, str(rank)]) for rank in range(2)]

    def notice():
        deadline = time.monotonic() + 20
        while not all(os.path.exists(f"{ready}{rank}") for rank in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=notice, daemon=True).start()
    started = time.monotonic()
    result = Job(tasks_for, max_restarts=3, grace_seconds=10, out=io.StringIO()).run()
    assert (result.state, result.exit_code, result.attempts) == (JobState.PREEMPTED, 143, 1)
    assert time.monotonic() - started < 15


def test_an_elastic_job_stops_its_tasks_at_a_notice_and_restarts_to_grow_without_spending_a_restart(tmp_path):
    """Where `grows` says a machine waits to join, the running tasks get SIGTERM (they save
    and exit 143) and the job starts its next attempt, even with no restart after failures
    left; asked again after that attempt's start, it says nothing and the job ends there."""
    def tasks_for(attempt):
        # Attempt 0 runs until its notice; attempt 1 succeeds.
        code = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
                "time.sleep(30)") if attempt == 0 else "pass"
        return [Task("rank:0", [sys.executable, "-c", code])]

    started = time.monotonic()
    asked = []

    def grows():
        asked.append(time.monotonic() - started)
        return "node rank 1 waits to join" if len(asked) in (2, 3) else None  # the question after the stop too

    out = io.StringIO()
    job = Job(tasks_for, max_restarts=0, out=out, grows=grows)
    result = job.run()
    assert (result.state, result.exit_code, result.attempts) == (JobState.SUCCEEDED, 0, 2), out.getvalue()
    assert job.history == [JobState.RUNNING, JobState.RESTARTING, JobState.RUNNING, JobState.SUCCEEDED]
    assert "SIGTERM (node rank 1 waits to join): passed on to every task" in out.getvalue()
    assert "the tasks saved and exited (node rank 1 waits to join); the job restarts with it" in out.getvalue()
    assert time.monotonic() - started < 20


def test_a_machine_back_after_an_elastic_job_went_on_without_it_joins_the_next_attempt(monkeypatch):
    """Machine 0's directory, real HTTP: the master starts attempt 0 alone; a machine started
    then (fresh, as after its loss) is announced for attempt 1, the master's `grows` says so
    to every machine, and attempt 1 has both, on the next engine port; once the job ended,
    a machine that comes ends in one line."""
    from keras_dist.launchers import nodes
    from keras_dist.launchers.processes import free_ports

    monkeypatch.setattr(nodes, "ELASTIC_WAIT_SECONDS", 0.5)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    master, returning = (_machine(nodes, rank, address) for rank in (0, 1))
    with nodes.directory(master):
        assert master.assemble(0).count == 1
        assert master.grows(0) is None
        joined = {}
        joiner = threading.Thread(target=lambda: joined.update(place=returning.assemble(0)), daemon=True)
        joiner.start()
        deadline = time.monotonic() + 10
        while master.grows(0) is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert master.grows(0) == returning.grows(0) == "node rank 1 waits to join"
        grown = master.assemble(1)
        joiner.join(10)
        assert (grown.attempt, grown.count, grown.rank) == (1, 2, 0)
        assert (joined["place"].attempt, joined["place"].count, joined["place"].rank) == (1, 2, 1)
        assert grown.port == joined["place"].port == master.port + 2
        assert master.grows(1) is None
        late = threading.Thread(target=lambda: joined.update(late=_ended_before_joining(nodes, address)), daemon=True)
        late.start()  # waits for attempt 2, which the job ends before
    late.join(10)
    assert joined["late"] == f"the job at {address} ended before this machine (node rank 1) could join it"


def _machine(nodes, rank, address):
    """Machine `rank` of an elastic job of 1 to 2 machines, with the job's secret."""
    return dataclasses.replace(nodes.Nodes.parse("1:2", rank, address), secret=JOB_SECRET.encode())


def _ended_before_joining(nodes, address):
    try:
        _machine(nodes, 1, address).assemble(0)
    except nodes.JobEnded as ended:
        return str(ended)
