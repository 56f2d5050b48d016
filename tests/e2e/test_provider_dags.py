"""The Airflow side end to end: real DAGs run by real Airflow (``dag.test()``) against real drivers, a real
broker and a real state database.

The state database is SQLite here: the Airflow side reads it through the same SQLAlchemy code as
PostgreSQL, which the runtime tests cover with real drivers.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from airflow_stream_provider import failures
from airflow_stream_provider.__main__ import status as job_status
from airflow_stream_provider.diagnosis import Thresholds
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.lifecycle.controller import StreamJobController, StreamJobError
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.operators import recover
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.state.store import StateStore
from stack.events import EventProducer
from stack.jobs import check_exactly_once, freeze_between_transactions, wait_until
from tests.dags import provider_scenarios as dags
from tests.dagtest import observed
from tests.dagtest.dagruns import FIXTURE_JOBS, caught_up, run_dag


# -- scenarios -------------------------------------------------------------------------------------------
# In ``make soak``: ``real_airflow/test_lifecycle.py`` proves kill -9 detected by the watcher and repaired,
# four times, exactly once, on Airflow's own terms (one kill lands right after a recovery's first batch).
# The deferred sensor finds a kill on a real Airflow in ``real_airflow/test_deferral.py``, its trigger's
# conditions are in ``tests/integration/test_health_trigger.py``, no backoff after a
# restart whose run committed in ``tests/unit/test_recovery.py``, a stop of a job that is not running in
# ``tests/integration/test_stop_closes_restarts.py``.
@pytest.mark.soak
def test_kill9_is_detected_by_a_deferred_sensor_and_recovered(stream, broker, figures):
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(2000)

    status, tasks = run_dag(dags.deploy, params)
    assert status == "success", tasks
    first = tasks["submit"][1]
    assert first["action"] == "submitted" and first["generation"] == 1 and first["epoch"] == 1

    # The sensor defers (the job is healthy); once its trigger polls, the driver is killed with SIGKILL.
    killed_at: list[float] = []

    def kill_when_watched():
        if observed.TRIGGER_STARTED.wait(300):
            killed_at.append(time.time())
            StreamDriverHook._signal(state.store.get_run(first["run_id"]), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_watched, daemon=True)
    killer.start()
    status, tasks = run_dag(dags.health, params)
    killer.join(10)
    assert status == "success", tasks
    assert killed_at and observed.TRIGGER_FIRED_AT, "the sensor did not defer to its trigger"
    detection_s = observed.TRIGGER_FIRED_AT[0] - killed_at[0]
    diagnosis, recovered = tasks["health"][1], tasks["recover"][1]
    assert diagnosis["health"] == "DEAD" and diagnosis["run_id"] == first["run_id"], diagnosis
    assert recovered["action"] == "restart" and recovered["generation"] == 1, recovered
    recovered_at = state.store.get_run(recovered["run_id"]).query_started_at

    producer.send(800)
    caught_up(state, job_id, producer)

    # A second kill of the job, healthy again (its restarted run committed batches): no crash loop, so
    # neither backoff nor budget (Kubernetes' CrashLoopBackOff resets after a successful run, too).
    StreamDriverHook._signal(state.store.get_run(recovered["run_id"]), signal.SIGKILL)
    status, tasks = run_dag(dags.health, params, max_restarts=1)
    assert status == "success", tasks
    again = tasks["recover"][1]
    assert again["action"] == "restart" and (recovered["backoff_s"], again["backoff_s"]) == (0, 0), again
    assert state.store.get_run(recovered["run_id"]).status == "DEAD", "a killed run must not stay RUNNING"
    producer.send(400)
    caught_up(state, job_id, producer)

    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    assert tasks["stop"][1]["exit_code"] == failures.EXIT_STOPPED
    status, tasks = run_dag(dags.stop, params)  # a second stop is a no-op that says so
    assert status == "success" and tasks["stop"][1]["outcome"] == "not running", tasks

    counts = check_exactly_once(state.store, job_id, producer.produced)
    figures.record("airflow kill -9 -> DEAD", detection_seconds=round(detection_s, 2),
                   kill_to_recovered_query_seconds=round(recovered_at - killed_at[0], 1), **counts)


# In ``make soak``: ``real_airflow/test_lost_reset.py`` runs the same scenario (2.0 adds a stateful operator
# over 1.0's checkpoint, Spark refuses it, ``stream_health`` archives generation 1 and starts generation 2
# from the stored offsets, exactly once) on a real Airflow, with the reset's task lost once on top, and a
# deferred ``CheckpointIncompatibilitySensor`` that returns the refused run's verdict.
@pytest.mark.soak
def test_incompatible_checkpoint_is_reset_from_stored_offsets(stream, broker, figures):
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(1500)
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(state, job_id, producer)

    # Version 2 adds a stateful operator: Spark cannot run it on version 1's checkpoint.
    upgraded = {**params, "application": str(FIXTURE_JOBS / "dedup_by_position.py"),
                "spec": {**params["spec"], "version": "2.0"}}
    run_dag(dags.deploy, upgraded, if_running="replace")  # stops 1.0 gracefully, starts 2.0 on its checkpoint
    producer.send(500)  # Spark validates the state lazily: the error comes with the first batch of data

    status, tasks = run_dag(dags.incompatible, upgraded, reason="upgrade to 2.0")
    assert status == "success", tasks
    found, reset = tasks["checkpoint"][1], tasks["reset"][1]
    assert found["failure_kind"] == "CHECKPOINT_INCOMPATIBLE", found
    assert found["error_class"] == "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY", found
    assert reset["generation"] == 2 and reset["archived_generation"] == 1, reset
    archive = Path(reset["archive_path"])
    assert archive.is_dir() and (archive / "offsets").is_dir(), "generation 1 must be archived, not deleted"
    assert not (Path(params["spec"]["checkpoint_root"]) / job_id / "gen-1").exists()

    producer.send(700)
    caught_up(state, job_id, producer)
    assert run_dag(dags.stop, upgraded)[0] == "success"
    counts = check_exactly_once(state.store, job_id, producer.produced)
    figures.record("airflow incompatible checkpoint -> reset", archive=archive.name, **counts)


# In ``make soak``: the real-Airflow tier proves this crash loop on Airflow's own terms
# (``real_airflow/test_lifecycle.py``); the one before the query starts, below, has no twin there.
@pytest.mark.soak
def test_crash_loop_ends_at_the_restart_budget(stream, broker):
    state, job_id = stream["state"], stream["job_id"]
    EventProducer(broker, stream["topic"]).send(200)
    crashing = {**stream["params"], "application": str(FIXTURE_JOBS / "crash_on_batch.py")}
    run_dag(dags.deploy, crashing)  # its query starts, then its first batch fails
    outcomes = []
    for _ in range(3):
        status, tasks = run_dag(dags.health, crashing, max_restarts=2)
        outcomes.append(tasks["recover"][0])
        if tasks["recover"][0] == "failed":
            break
    assert outcomes == ["success", "success", "failed"], outcomes
    assert len(state.restarts_since(job_id, 0)) == 2
    last = state.latest_run(job_id)
    assert last.failure_kind == "USER_CODE" and "simulated bug" in last.termination_message


def test_a_crash_loop_before_the_query_starts_ends_at_the_restart_budget(stream, broker):
    """Every driver fails as its query is built, so no restart's launch ever gets to "ready": each restart
    counts from its submit, or the watcher and ``stream_health`` would restart the job without end."""
    state, job_id = stream["state"], stream["job_id"]
    crashing = {**stream["params"], "application": str(FIXTURE_JOBS / "crash_on_start.py")}
    status, tasks = run_dag(dags.deploy, crashing)
    assert tasks["submit"][0] == "failed", tasks
    for _ in range(3):  # two restarts that fail as they start, then the budget's refusal
        status, tasks = run_dag(dags.health, crashing, max_restarts=2)
        assert tasks["recover"][0] == "failed", tasks
    assert len(state.restarts_since(job_id, 0)) == 2
    runs = state.store.runs(job_id, include_dry_runs=False)
    assert len(runs) == 3, [(r.run_id, r.status) for r in runs]  # the deploy's run and two restarts: no more
    assert all(r.status == "FAILED" and r.query_started_at is None for r in runs), runs
    assert "simulated bug in the job's parse" in runs[-1].termination_message


def test_stuck_query_is_reported_stuck(stream, broker):
    state, job_id = stream["state"], stream["job_id"]
    EventProducer(broker, stream["topic"]).send(300)
    stuck = {**stream["params"], "application": str(FIXTURE_JOBS / "stuck_on_batch.py")}
    assert run_dag(dags.deploy, stuck)[0] == "success"
    status, tasks = run_dag(dags.watch, stuck, stuck_after=8)
    assert status == "success", tasks
    found = tasks["health"][1]
    assert found["health"] == "STUCK" and found["lag"] == 300, found
    run = state.latest_run(job_id)
    assert run.status == "RUNNING" and run.last_batch_id is None


def test_a_live_driver_gone_silent_is_looked_at_again_once_stuck_and_restarted(stream, broker, monkeypatch):
    """A driver frozen between two transactions (SIGSTOP: hung, a suspended VM) lives but stops
    heartbeating.  A watcher on another host reports it DEAD; here, beside its process, it is HEALTHY until
    its silence passes ``stuck_after``.  The recovery that watcher's event starts waits for that moment,
    holding no lease, then restarts it as STUCK, instead of returning "healthy" and leaving it hung."""
    state, job_id = stream["state"], stream["job_id"]
    params = {**stream["params"], "spec": {**stream["params"]["spec"], "heartbeat_timeout_seconds": 4.0}}
    producer = EventProducer(broker, stream["topic"])
    producer.send(600)
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(state, job_id, producer)
    frozen = state.latest_run(job_id)
    watched = {"heartbeat_timeout": 4, "stuck_after": 30, "stop_timeout": 3}
    # Each time the recovery defers to look again; it also looks every few seconds meanwhile (every 30 s as
    # shipped), as it must where the triggerer cannot see the driver's process.
    looks: list[float] = []
    real_watch = RecoverStreamingJobOperator._watch_silent

    def watch_silent(self, context, found):
        looks.append(time.time())
        return real_watch(self, context, found)

    monkeypatch.setattr(RecoverStreamingJobOperator, "_watch_silent", watch_silent)
    monkeypatch.setattr(recover, "SILENT_LOOK_EVERY_S", 8.0)
    freeze_between_transactions(state.store.engine.url.database, os.getpgid(frozen.pid))
    try:
        wait_until(lambda: time.time() - state.store.get_run(frozen.run_id).heartbeat_at > 5, 30,
                   "the frozen driver's heartbeat to go stale")
        probe = HealthProbe.connect(job_id, [stream["topic"]], "stream_state_default", "stream_kafka_default",
                                    Thresholds(heartbeat_timeout_s=4.0, stuck_after_s=30.0))
        try:  # what stream_health's diagnose sees, beside the driver: its branch leads to recover
            silent = probe.check()
        finally:
            probe.close()
        assert silent.health.value == "HEALTHY" and silent.stuck_at is not None, silent
        status, tasks = run_dag(dags.recover, params, **watched)
        looked_again_at = time.time()
    finally:
        StreamDriverHook._signal(frozen, signal.SIGCONT)  # a kill already took it, unless the test failed
    assert status == "success", tasks
    recovered = tasks["recover"][1]
    assert recovered["diagnosis"]["health"] == "STUCK" and recovered["action"] == "restart", recovered
    assert recovered["diagnosis"]["diagnosed_at"] >= silent.stuck_at and looked_again_at >= silent.stuck_at
    assert len(looks) >= 2 and looks[0] < silent.stuck_at - 8, (looks, silent.stuck_at)
    assert not state.store.get_run(frozen.run_id).active
    producer.send(300)
    caught_up(state, job_id, producer)
    check_exactly_once(state.store, job_id, producer.produced)


def test_a_restart_the_database_would_not_record_at_the_submit_is_recorded_once_its_launch_is_over(
        stream, broker, monkeypatch):
    """The state database stops answering just after a restart's driver was submitted: the write that
    records the new run and the lease's extension over the launch wait are refused.  The task used to fail
    there, leaving a driver nobody waited on and a restart the budget never counted; it now waits on the
    launch and records the restart once it is over, once."""
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(600)
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(state, job_id, producer)
    dead = state.latest_run(job_id)
    StreamDriverHook._signal(dead, signal.SIGKILL)
    # Two refused statements, in this process (the DAG runs here): a real database cannot be made to refuse
    # exactly the two writes after a submit.
    refusals = iter([OperationalError("UPDATE stream_restarts", {}, Exception("database is locked"))])
    lease_refusals: list[OperationalError] = []
    real_record, real_take = StateStore.record_restart, StreamJobController.take_lease

    def flaky_record(self, job_id, action, reason, failed_run_id, new_run_id, task=None):
        refusal = next(refusals, None) if new_run_id is not None else None
        if refusal is not None:
            lease_refusals.append(OperationalError("UPDATE stream_leases", {}, Exception("database is locked")))
            raise refusal
        return real_record(self, job_id, action, reason, failed_run_id, new_run_id, task)

    def flaky_take(self, owner, action, until, launch=None):
        if lease_refusals:  # the extension over the launch wait, right after the refused record
            raise lease_refusals.pop()
        return real_take(self, owner, action, until, launch)

    monkeypatch.setattr(StateStore, "record_restart", flaky_record)
    monkeypatch.setattr(StreamJobController, "take_lease", flaky_take)
    status, tasks = run_dag(dags.recover, params)
    assert status == "success", tasks
    recovered = tasks["recover"][1]
    assert recovered["diagnosis"]["health"] == "DEAD" and recovered["action"] == "restart", recovered
    assert next(refusals, None) is None and not lease_refusals, "a refusal was not met"
    assert [(r["failed_run_id"], r["new_run_id"]) for r in state.restarts_since(job_id, 0)] == [
        (dead.run_id, recovered["run_id"])]
    assert state.store.get_run(recovered["run_id"]).application, "the launch was recorded"
    producer.send(300)
    caught_up(state, job_id, producer)
    check_exactly_once(state.store, job_id, producer.produced)


def _refuse_the_next_launch(monkeypatch) -> None:
    """The next launch's check of the brokers fails once, in this process (the DAG runs here): the shared
    broker cannot be taken down for exactly one check."""
    checks = iter([StreamJobError("Kafka at the job's brokers is unreachable: NoBrokersAvailable")])
    real_check = StreamJobController.check_before_start

    def flaky_check(self, spec):
        failure = next(checks, None)
        if failure is not None:
            raise failure
        return real_check(self, spec)

    monkeypatch.setattr(StreamJobController, "check_before_start", flaky_check)


def test_a_stuck_run_stopped_by_a_restart_whose_launch_failed_is_restarted_next_time(stream, broker, monkeypatch):
    """The recovery stops the STUCK driver, then its launch fails (the brokers unreachable for a moment):
    the stopped run is no stop anyone asked for, so the next recovery starts the run the restart owed,
    where it used to read "it was being stopped" and leave the job down.  That recovery's driver then
    exits before it registers (its Python is missing): the stopped run is still the job's latest, so the
    restart stays owed, where that launch's record used to read as a restart done; the one after it
    restarts the job.  Each attempt is one record: a recovery finishing an owed restart completes its record
    rather than beginning another."""
    state, job_id = stream["state"], stream["job_id"]
    EventProducer(broker, stream["topic"]).send(300)
    stuck = {**stream["params"], "application": str(FIXTURE_JOBS / "stuck_on_batch.py")}
    assert run_dag(dags.deploy, stuck)[0] == "success"
    stuck_run = state.latest_run(job_id).run_id
    _refuse_the_next_launch(monkeypatch)
    status, tasks = run_dag(dags.health, stuck, stuck_after=8, stop_timeout=5)
    assert tasks["health"][1]["health"] == "STUCK" and tasks["recover"][0] == "failed", tasks
    stopped = state.store.get_run(stuck_run)
    assert not stopped.active and stopped.stop_requested_at is not None, stopped
    assert [r["new_run_id"] for r in state.restarts_since(job_id, 0)] == [None]

    no_python = {**stuck, "env_vars": {**stuck["env_vars"], "PYSPARK_DRIVER_PYTHON": str(stream["tmp"] / "gone")}}
    status, tasks = run_dag(dags.recover, no_python, stuck_after=8, stop_timeout=5)
    assert tasks["recover"][0] == "failed", tasks
    (unregistered, owed) = state.restarts_since(job_id, 0)
    assert unregistered["new_run_id"] and state.store.get_run(unregistered["new_run_id"]) is None, unregistered
    assert (owed["failed_run_id"], owed["new_run_id"]) == (stuck_run, None), "the restart is owed still"
    assert "the restart begun at" in job_status(state.store, job_id)

    status, tasks = run_dag(dags.health, stuck, stuck_after=8, stop_timeout=5)
    assert tasks["recover"][0] == "success" and tasks["recover"][1]["action"] == "restart", tasks
    restarted = state.latest_run(job_id)
    assert restarted.run_id != stuck_run and restarted.status == "RUNNING", restarted
    assert [r["new_run_id"] for r in state.restarts_since(job_id, 0)] == [unregistered["new_run_id"],
                                                                          restarted.run_id]



def test_a_reset_whose_launch_failed_after_its_stop_is_finished_by_stream_health(stream, broker, monkeypatch):
    """A person resets the running job; after its stop and its archive, the launch is refused (the brokers
    unreachable for a moment).  The job is down with its checkpoint archived, and nobody asked for a stop:
    the sensor reports the reset owed, and the recovery finishes it (a restart from the archived checkpoint
    could not), where the job used to stay STOPPED until a person came back.  The reset task's retry, later
    than that, finds its reset finished and does nothing: it used to reset the job once more."""
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(300)
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(state, job_id, producer)
    live = state.latest_run(job_id).run_id
    _refuse_the_next_launch(monkeypatch)
    reset_at = datetime.datetime.now(datetime.UTC).isoformat()  # its retry below is the same task instance
    status, tasks = run_dag(dags.reset, params, logical_date=reset_at, reason="manual reset")
    assert status == "failed" and tasks["reset"][0] == "failed", tasks
    assert state.store.get_run(live).status == "STOPPED" and state.store.get_generation(job_id, 1)["archived_at"]
    assert [(r["action"], r["failed_run_id"], r["new_run_id"]) for r in state.restarts_since(job_id, 0)] == [
        ("reset", live, None)]
    producer.send(200)  # while nothing runs

    status, tasks = run_dag(dags.health, params)
    found = tasks["health"][1]
    assert (found["health"], found["interrupted_restart"]["action"]) == ("STOPPED", "reset"), found
    done = tasks["recover"][1]
    assert tasks["recover"][0] == "success" and done["action"] == "reset", tasks
    assert (done["generation"], done["archived_generation"]) == (2, 1), done
    assert [(r["failed_run_id"], r["new_run_id"]) for r in state.restarts_since(job_id, 0)] == [
        (live, done["run_id"])], "the begun reset, completed: one attempt"

    status, tasks = run_dag(dags.reset, params, logical_date=reset_at, reason="manual reset")  # the late retry
    assert status == "success" and tasks["reset"][1]["action"] == "none", tasks
    assert "was carried on by task test_stream_health/" in tasks["reset"][1]["why"], tasks
    assert state.store.get_generation(job_id, 3) is None and state.latest_run(job_id).run_id == done["run_id"]
    assert len(state.restarts_since(job_id, 0)) == 1
    caught_up(state, job_id, producer)
    assert run_dag(dags.stop, params)[0] == "success"
    check_exactly_once(state.store, job_id, producer.produced)
