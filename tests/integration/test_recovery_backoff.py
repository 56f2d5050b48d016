"""A recovery that backs off (consecutive restarts that never committed a batch) begins its restart before it
waits, against a real state database: a task lost in that wait, which may last minutes, leaves a begun
restart that names it, so that once Airflow says it has ended the watcher reports the run owed its restart
(``recovery.interrupted_restart``; the real-Airflow path of a lost recovery is
``e2e/real_airflow/test_lost_recovery.py``).  Before, nothing was recorded until the wait was over, and the
run's one report was spent on the lost task.  A recovery that resumes from the wait completes that one
record: the attempt counts once."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowTaskTerminated, TaskDeferred

from airflow_stream_provider.diagnosis import diagnose
from airflow_stream_provider.operators.base import DEFER_MARGIN_S
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.recovery import with_interrupted_restart


def _dead_after_two_failed_restarts(store) -> tuple[str, list[str]]:
    """A job whose last two restarts launched runs that never committed a batch, the last one now dead."""
    runs = []
    for _ in range(3):
        runs.append(store.begin_run("job", 1, "1.0").run_id)
        store.finish_run(runs[-1], status="DEAD", exit_code=137)
        if len(runs) > 1:
            store.record_restart("job", "restart", "DEAD: driver gone", runs[-2], runs[-1])
    return runs[-1], runs


@pytest.fixture
def recover(tmp_path) -> RecoverStreamingJobOperator:
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    return RecoverStreamingJobOperator(task_id="recover", spec=spec, backoff_base=60.0, application="/jobs/job.py")


def test_a_recovery_that_backs_off_begins_its_restart_before_the_wait(state_store, recover):
    dead, _ = _dead_after_two_failed_restarts(state_store)

    with pytest.raises(TaskDeferred) as deferred:  # the backoff, waited in the triggerer
        recover.execute({})

    resume = deferred.value.trigger.resume
    assert (resume["method"], resume["state"]["action"]) == ("_act", "restart"), resume
    assert resume["state"]["outcome"]["backoff_s"] >= 60, resume["state"]["outcome"]
    # bounded past the wait's own end: a trigger whose poll hangs fails the task instead of keeping it for good
    backoff_s = resume["state"]["outcome"]["backoff_s"]
    assert deferred.value.timeout.total_seconds() == pytest.approx(backoff_s + DEFER_MARGIN_S, abs=1)
    begun = state_store.latest_restart("job")
    assert (begun["action"], begun["failed_run_id"], begun["new_run_id"]) == ("restart", dead, None), begun
    assert begun["task"] == recover._lease_owner, "it names the task that waits, for Airflow to be asked about"
    found = diagnose("job", state_store.get_run(dead), driver_alive=None, lag=None, now=begun["at"] + 1)
    owed = with_interrupted_restart(found, begun, lambda task: task == begun["task"]).interrupted_restart
    assert owed is not None and owed["failed_run_id"] == dead, "lost in the wait: the run is owed its restart"


def test_the_restart_begun_before_the_backoff_is_completed_by_its_launch(state_store, recover, monkeypatch):
    """The task resumes from its wait and launches: the one record begun before the wait names the new run.
    The driver itself is not started (``submit`` stands in): what is looked at is the record, written as
    soon as a driver is submitted, before the launch's own wait."""
    dead, _ = _dead_after_two_failed_restarts(state_store)
    with pytest.raises(TaskDeferred) as deferred:
        recover.execute({})
    submitted = []
    monkeypatch.setattr(type(recover.controller), "submit", lambda controller, application, spec, **kw: (
        submitted.append(application) or {"run_id": "r-new", "job_id": "job", "pid": None, "host": None, "submitted_at": 0.0}))

    with pytest.raises(TaskDeferred):  # the launch's wait for the new run's query
        recover._act({}, None, **deferred.value.trigger.resume["state"])

    assert submitted == [recover.application]
    restarts = state_store.restarts_since("job", 0)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts][-1] == (dead, "r-new"), restarts
    assert len(restarts) == 3, "the restart begun before the wait is the one the launch completed"


def test_a_budget_that_would_not_bound_restarts_is_refused_before_anything_is_looked_at(tmp_path, state_store):
    """A ``healthy_reset`` of 0 counted no restart as consecutive: no budget, no backoff, a storm."""
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    with pytest.raises(AirflowFailException, match=r"healthy_reset \(> 0 s, now 0\)"):  # at the DAG's parse
        RecoverStreamingJobOperator(task_id="recover", spec=spec, healthy_reset=0, application="/jobs/job.py")
    # a templated budget is checked when the task runs, before the diagnosis
    templated = RecoverStreamingJobOperator(task_id="recover", spec=spec, max_restarts="{{ params.n }}",
                                            application="/jobs/job.py")
    templated.max_restarts = "0"  # as rendered
    dead, _ = _dead_after_two_failed_restarts(state_store)
    with pytest.raises(AirflowFailException, match=r"max_restarts \(>= 1, now '0'\)"):
        templated.execute({})
    assert state_store.latest_run("job").run_id == dead and len(state_store.restarts_since("job", 0)) == 2


def test_a_final_failure_stays_final_when_the_lease_cannot_be_released(tmp_path, state_store, monkeypatch):
    """The database away as the lease is let go: its error replaced the task's AirflowFailException, and a
    failure no retry can fix was retried."""
    from sqlalchemy.exc import OperationalError

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, max_restarts="{{ params.n }}",
                                          application="/jobs/job.py")
    recover.max_restarts = "0"

    def away(controller, owner):
        raise OperationalError("UPDATE leases", None, Exception("database is away"))

    monkeypatch.setattr(type(recover.controller), "release_lease", away)
    with pytest.raises(AirflowFailException, match="restart budget"):
        recover.execute({})


def test_a_recovery_killed_in_its_backoff_restarts_nothing_after_on_kill(tmp_path, state_store, monkeypatch):
    """Airflow 3's SIGTERM handler runs ``on_kill`` and returns to the task, whose process lives on until the
    supervisor's kill.  A non-deferrable recovery killed in its backoff went on, once the backoff was over,
    to launch the restart: after ``on_kill`` had let go of the job's lease, beside whatever took it."""
    from airflow_stream_provider.state.leases import LeaseLog

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, backoff_base=1.0, deferrable=False,
                                          application="/jobs/job.py")
    dead, _ = _dead_after_two_failed_restarts(state_store)

    def submit(controller, application, spec, **kw):
        raise AssertionError("the killed task launched a driver after on_kill")

    monkeypatch.setattr(type(recover.controller), "submit", submit)

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: recover.on_kill())  # the task runner's handler
    kill = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    kill.start()
    try:
        with pytest.raises(AirflowTaskTerminated, match="killed during its wait"):
            recover.execute({})
    finally:
        kill.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert LeaseLog(state_store).get("job") is None
    begun = state_store.latest_restart("job")
    assert (begun["failed_run_id"], begun["new_run_id"]) == (dead, None), "left owed, for the watcher to report"
