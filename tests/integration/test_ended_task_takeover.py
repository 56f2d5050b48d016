"""A task that ended without letting go of the job's lease: its worker lost, or killed while deferred where
no trigger undid it (Airflow 3.1 and 3.2; marked failed before a triggerer took its trigger up).  The next
task to want the lease undoes what it left, as the trigger would have: the driver it launched and was
waiting on is killed while it has not started its query, and an upgrade that had stopped the job ends
with a restart of the old run owed.  Before, the lease was taken over (or, run out, taken) and nothing
else: the job stayed down behind an upgrade record that stood for half an hour.

Airflow's answer about the holder stands in (``get_task_states``): this tier runs no Airflow; the real path
of a lost task taken over is ``real_airflow/test_interrupted_restart.py``.  The driver the task left starting
is a real process in its own group, as the launcher starts drivers."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import Health, Thresholds
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.recovery import RecoveryAction, decide_recovery
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

OWNER = "stream_upgrade/manual__1/upgrade/-1"


class _TaskInstance:
    """Airflow's task instance of a stop (``stream_stop``), as the operator asks it about another task."""

    dag_id, run_id, task_id, map_index = "stream_stop", "manual__2", "stop", -1

    def __init__(self, state: str):
        self.state = state

    def get_task_states(self, *, dag_id, task_ids, run_ids, map_index):
        return {run_id: {task_id: self.state for task_id in task_ids} for run_id in run_ids}


@pytest.fixture
def starting_driver():
    """A driver launched and not registered yet (a start that hangs)."""
    process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize(("holder", "ran_out", "undone"), [
    ("failed", False, True),  # within its lease
    ("failed", True, True),  # its lease run out: taken, before, as if nothing had been left
    ("running", True, False),  # still running for Airflow: late, not gone, and left to stop itself
])
def test_what_an_ended_upgrade_task_left_is_undone_by_the_next_task(state_store, tmp_path, starting_driver,
                                                                    holder, ran_out, undone):
    old = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(old)
    state_store.request_stop(old)
    state_store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    upgrades = UpgradeLog(state_store)
    upgrade_id = upgrades.begin("job", "1.0", "2.0", {"live_run_id": old, "generation": 1})
    upgrades.move(upgrade_id, UpgradePhase.STARTING, {"live_run_id": old, "generation": 1})
    launch = {"run_id": "new-version-run", "pid": starting_driver.pid, "host": socket.gethostname(),
              "submitted_at": time.time()}
    leases = LeaseLog(state_store)
    assert leases.take("job", OWNER, "upgrade", time.time() + (-1 if ran_out else 300), launch) is None
    assert leases.get("job").launch == launch
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}

    stopped = StopStreamingJobOperator(task_id="stop", spec=spec).execute({"ti": _TaskInstance(holder)})

    assert stopped["outcome"] == "not running" and leases.get("job") is None
    record = upgrades.get(upgrade_id)
    restarts = state_store.restarts_since("job", 0)
    if undone:
        assert starting_driver.wait(timeout=10) == -9, "the driver left starting was not killed"
        assert (record.phase, record.result) == (UpgradePhase.DONE, "killed"), record
        # the restart of the old run it left owed, which the person's stop then closes
        assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts] == [(old, None)], restarts
        assert restarts[0]["cancelled_at"] is not None
    else:
        # its driver left alone; its record ended by the person's stop, which supersedes it (no restart owed)
        assert starting_driver.poll() is None and restarts == []
        assert (record.phase, record.result) == (UpgradePhase.DONE, "stopped"), record


def test_a_launch_whose_query_runs_is_the_jobs_run_and_is_left_alone(state_store, tmp_path, starting_driver):
    """The lease names the launch from its holder's last take, which may be older than the run's ready."""
    run = state_store.begin_run("job", 1, "1.0", host=socket.gethostname(), pid=starting_driver.pid).run_id
    state_store.mark_query_started(run)
    launch = {"run_id": run, "pid": starting_driver.pid, "host": socket.gethostname(), "submitted_at": time.time()}
    LeaseLog(state_store).take("job", "stream_deploy/manual__1/submit/-1", "submit", time.time() + 300, launch)
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = StopStreamingJobOperator(task_id="stop", spec=spec)

    operator._lease_owner = "stream_stop/manual__2/stop/-1"  # as execute sets it
    operator._take_over_from_ended_task({"ti": _TaskInstance("failed")})

    assert starting_driver.poll() is None and state_store.get_run(run).status == "RUNNING"
    assert LeaseLog(state_store).get("job") is None  # let go of: its holder has ended


def test_a_launch_registered_on_another_host_is_stopped_and_its_restart_owed(state_store, tmp_path):
    """A driver on another host cannot be killed from here: it is asked to stop through its row.  Before, it
    then ended as a stop someone had asked for, which a recovery leaves down; the job stayed down behind a
    lost submit.  Now the next recovery finishes a restart of it, as it restarts a local one killed here."""
    run = state_store.begin_run("job", 1, "1.0", host="another-host", pid=4242).run_id  # registered, starting
    launch = {"run_id": run, "pid": 4242, "host": "another-host", "submitted_at": time.time()}
    LeaseLog(state_store).take("job", "stream_deploy/manual__1/submit/-1", "submit", time.time() + 300, launch)
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["job"]}}
    operator = StopStreamingJobOperator(task_id="stop", spec=spec)  # any operator wanting the lease does this

    operator._lease_owner = "stream_health/scheduled__1/recover/-1"  # as execute sets it
    operator._take_over_from_ended_task({"ti": _TaskInstance("failed")})

    assert state_store.get_run(run).stop_requested_at is not None, "the run on the other host was not asked to stop"
    state_store.finish_run(run, status="STOPPED", exit_code=0, message="stopped")  # its driver reads the row
    found = HealthProbe.connect("job", ["job"], "stream_state_default", "stream_kafka_default", Thresholds()).check()
    decision = decide_recovery(found, on_incompatible="fail", budget=RestartBudget(), now=time.time(),
                               history=state_store.restarts_since("job", 0))
    assert (found.health, decision.action, decision.restart_run_id) == (Health.STOPPED, RecoveryAction.RESTART, run), \
        (found.evidence, decision.why)
