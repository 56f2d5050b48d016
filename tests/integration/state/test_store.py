"""The state store's own guarantees, on SQLite and PostgreSQL: which run is the latest, how an accepted
data loss moves the stored offsets, and that a run found dead says so in the history."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from airflow_stream_provider.diagnosis import Health, Thresholds
from airflow_stream_provider.kafka_offsets import LostRange
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.state import schema


def test_latest_run_is_the_newest_epoch_whatever_the_hosts_clocks(state_store):
    """Drivers on hosts whose clocks disagree: the epoch the database hands out decides, not started_at."""
    older = state_store.begin_run("job", 1, "1.0")
    newer = state_store.begin_run("job", 1, "1.0")
    state_store._update_run(newer.run_id, started_at=1000.0)  # its host's clock is far behind
    assert newer.epoch > older.epoch
    assert state_store.latest_run("job").run_id == newer.run_id
    [watched] = state_store.watched_jobs()
    assert watched.run.run_id == newer.run_id


def test_an_accepted_loss_moves_the_offsets_with_its_record_in_one_transaction(state_store):
    state_store.begin_run("job", 1, "1.0")
    with state_store.engine.begin() as conn:
        conn.execute(schema.offsets.insert(), [
            {"job_id": "job", "topic": "t", "partition": p, "next_offset": 300, "generation": 1, "batch_id": 4}
            for p in (0, 1, 2)])
    lost = [LostRange("t", 0, 300, 350, "fell out of retention (earliest available offset is 350)"),
            LostRange("t", 1, 12, 300, "offsets went backwards"),
            LostRange("t", 2, 300, None, "partition no longer exists in Kafka")]
    state_store.accept_loss("job", 2, lost, {("t", 0): 350, ("t", 1): 12}, "upgrade to 2.0")

    assert state_store.stored_offsets("job") == {("t", 0): 350, ("t", 1): 12}
    rows = state_store.accepted_losses("job")
    assert [(r["partition"], r["start_offset"], r["end_offset"], r["resume_offset"], r["generation"])
            for r in rows] == [(0, 300, 350, 350, 2), (1, 12, 300, 12, 2), (2, 300, None, None, 2)]
    assert all("accepted: upgrade to 2.0" in r["reason"] for r in rows)


def _dead_letter(partition: int, offset: int, value: bytes) -> dict:
    return {"job_id": "job", "topic": "t", "partition": partition, "offset": offset, "key": None, "value": value,
            "error": "malformed", "generation": 1, "batch_id": 3, "recorded_at": 1.0}


def test_an_accepted_loss_archives_the_dead_letters_of_a_log_that_is_gone(state_store):
    """A recreated topic numbers its records from the old log's positions again: the old log's dead letters
    there move to the archive, byte for byte, so the new log's own can be recorded at the same positions.
    A log that only fell out of retention keeps its dead letters: no new record will take their positions."""
    state_store.begin_run("job", 1, "1.0")
    with state_store.engine.begin() as conn:
        conn.execute(schema.offsets.insert(), [
            {"job_id": "job", "topic": "t", "partition": p, "next_offset": 300, "generation": 1, "batch_id": 4}
            for p in (0, 1, 2)])
        conn.execute(schema.dead_letters.insert(), [_dead_letter(p, o, b"old \xff") for p in (0, 1, 2) for o in (5, 20)])
    lost = [LostRange("t", 0, 300, 350, "fell out of retention (earliest available offset is 350)"),
            LostRange("t", 1, 15, 300, "offsets went backwards"),
            LostRange("t", 2, 300, None, "partition no longer exists in Kafka")]
    state_store.accept_loss("job", 2, lost, {("t", 0): 350, ("t", 1): 10}, "topic recreated")

    with state_store.engine.connect() as conn:
        live = {(r.partition, r.offset) for r in conn.execute(schema.dead_letters.select())}
        archived = conn.execute(schema.dead_letters_archive.select().order_by("partition", "offset")).all()
    assert live == {(0, 5), (0, 20), (1, 5)}  # below the recreated log's start, a position it will not reuse
    assert [(r.partition, r.offset, r.value, r.batch_id) for r in archived] == [
        (1, 20, b"old \xff", 3), (2, 5, b"old \xff", 3), (2, 20, b"old \xff", 3)]
    assert all(r.archived_at > 1.0 for r in archived)


def _a_run_whose_driver_is_gone(state_store):
    """A run of ``job`` whose query ran, on this host, whose driver's process has exited."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ticket = state_store.begin_run("job", 1, "1.0", host=socket.gethostname(), pid=gone.pid)
    state_store.mark_query_started(ticket.run_id)
    return ticket, gone


def _health_check():
    probe = HealthProbe.connect("job", ["events"], "stream_state_default", "stream_kafka_default", Thresholds())
    try:
        return probe.check()
    finally:
        probe.close()


def test_a_commit_recorded_without_progress_keeps_the_listeners_detail(state_store):
    """With write-behind the writer records a batch's commit after the listener recorded its progress: it
    wrote "{}" over the detail (sources, rates) the Streams page and the standby read."""
    import json

    run = state_store.begin_run("job", 1, "1.0").run_id
    state_store.record_progress(run, 3, {"batchId": 3, "sources": [{"numInputRows": 7}]}, committed=False)
    state_store.record_progress(run, 3, None, committed=True)
    found = state_store.get_run(run)
    assert found.last_batch_id == 3
    assert json.loads(found.last_progress)["sources"] == [{"numInputRows": 7}], found.last_progress


def test_a_run_found_dead_is_recorded_dead(state_store):
    """A driver killed -9 writes nothing: the health check that finds it gone records DEAD with the
    evidence, so the history never shows a dead run as RUNNING."""
    ticket, gone = _a_run_whose_driver_is_gone(state_store)
    found = _health_check()
    assert found.health == Health.DEAD
    run = state_store.get_run(ticket.run_id)
    assert run.status == "DEAD" and f"pid {gone.pid}" in run.termination_message, run


def test_a_run_that_died_while_it_was_being_stopped_is_recorded_dead_and_left_stopped(state_store, tmp_path):
    """The stop's task died with it (or could not record the end): the next health check records the run
    DEAD, saying it was being stopped, and the recover task leaves the job stopped, as asked."""
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator

    ticket, _ = _a_run_whose_driver_is_gone(state_store)
    state_store.request_stop(ticket.run_id)
    found = _health_check()
    assert found.health == Health.DEAD and found.stop_requested_at is not None, found
    run = state_store.get_run(ticket.run_id)
    assert run.status == "DEAD" and "before it stopped cleanly" in run.termination_message, run
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py")
    assert recover.live_run() is None
    outcome = recover.execute({})
    assert outcome["action"] == "none" and "a restart would undo the stop" in outcome["why"], outcome
    assert [r.run_id for r in state_store.runs("job")] == [ticket.run_id]


def test_a_stop_that_cannot_reach_its_driver_fails_instead_of_going_on(state_store, tmp_path):
    """A driver on another host that ignored the stop marker: nothing here can signal it, and its heartbeat
    is fresh.  The restart, reset or upgrade that asked for the stop must not start a second driver beside
    it; the stop fails and says where to kill it.  Once its heartbeat is stale it is taken for gone."""
    import pytest

    from airflow_stream_provider.lifecycle.controller import StreamJobError
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator

    ticket = state_store.begin_run("job", 1, "1.0", host="another-host", pid=4242)
    state_store.mark_query_started(ticket.run_id)
    state_store.request_stop(ticket.run_id)
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    controller = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py").controller

    with pytest.raises(StreamJobError, match=r"did not stop: its driver \(pid 4242 on another-host\) ignored the "
                                             r"stop marker, cannot be signalled from .*Kill it on another-host "
                                             r"\(kill -9 -- -4242\), then retry this task"):
        controller.finish_stop(ticket.run_id, "killed", 0.0)
    state_store._update_run(ticket.run_id, heartbeat_at=1000.0)  # silent since: gone, as far as anyone can tell
    assert controller.finish_stop(ticket.run_id, "killed", 0.0)["outcome"] == "killed"

    # what is judged is the stopped run, not the job's live one (an upgrade stopping its dry run)
    live = state_store.begin_run("job", 1, "1.0", host="another-host", pid=4343)
    state_store.mark_query_started(live.run_id)
    assert controller.live_run().run_id == live.run_id
    assert controller.finish_stop(ticket.run_id, "killed", 0.0)["outcome"] == "killed"


def test_an_upgrade_failing_before_it_releases_its_successor_ends_it(state_store, tmp_path):
    """A prewarmed successor waits for its release without end.  The upgrade's preflight wait fails (the
    trigger's error event, past its deadline): the task fails, and the successor is asked to end, not left
    holding a driver's resources beside the job."""
    import pytest

    from airflow_stream_provider.lifecycle.controller import StreamJobError
    from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus
    from airflow_stream_provider.state.upgrades import UpgradeLog

    standbys = StandbyLog(state_store)
    standbys.register("successor-1", "job", "2.0", 1, host=socket.gethostname(), pid=4242, log_path=None,
                      role=SUCCESSOR)
    ctx = {"successor": {"standby_id": "successor-1"}, "preflight": {"run_id": "dry-1", "root": str(tmp_path)}}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="job.py", prewarm=True)
    event = {"outcome": "error", "run_id": "dry-1", "message": "waiting on run dry-1: the database is gone",
             "resume": {"method": "_dry_run_waited", "state": {"ctx": ctx}}}

    with pytest.raises(StreamJobError, match="the database is gone"):
        operator.execute_complete({}, event)

    ended = standbys.get("successor-1")
    assert ended.status == StandbyStatus.ENDED and "the upgrade failed before releasing it" in ended.message


def test_a_killed_upgrade_task_ends_its_unreleased_successor(state_store, tmp_path):
    """Airflow kills the upgrade's task (marked failed, timed out) while it runs in its worker: ``on_kill``
    ends the successor the upgrade holds.  One the upgrade released is the job's run by then: left alone."""
    from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus
    from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

    standbys, upgrades = StandbyLog(state_store), UpgradeLog(state_store)
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="job.py", prewarm=True)
    for standby_id in ("held", "released"):
        standbys.register(standby_id, "job", "2.0", 1, host=socket.gethostname(), pid=4242, log_path=None,
                          role=SUCCESSOR)
    upgrade_id = upgrades.begin("job", "1.0", "2.0", {"successor": {"standby_id": "released"}})
    assert standbys.release("released", 1, None, 1)
    upgrades.move(upgrade_id, UpgradePhase.STARTING, {})  # the release lets go of it in the record
    operator.on_kill()
    assert standbys.get("released").status != StandbyStatus.ENDED

    upgrades.begin("job", "1.0", "2.0", {"successor": {"standby_id": "held"}})
    operator.on_kill()
    ended = standbys.get("held")
    assert ended.status == StandbyStatus.ENDED and "its upgrade task was killed" in ended.message


def test_a_task_killed_while_deferred_is_undone_by_its_trigger(state_store, tmp_path):
    """A person marks a deferred upgrade failed: no worker runs the operator's ``on_kill``, Airflow calls its
    trigger's instead (a real triggerer does, in ``tests/e2e/real_airflow``).  The trigger, rebuilt from its
    serialized kwargs as a triggerer rebuilds it, kills the driver the task waited on (one on another host
    is asked to stop through its row), ends the unreleased successor and lets go of the lease."""
    import asyncio
    import time

    import pytest
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_stream_provider.lifecycle.waits import RunWait
    from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
    from airflow_stream_provider.state.leases import LeaseLog
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus
    from airflow_stream_provider.state.upgrades import UpgradeLog
    from airflow_stream_provider.triggers.run import StreamRunTrigger

    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="job.py", prewarm=True,
                                           deferrable=True)
    operator._lease_owner = "stream_upgrade/manual__1/upgrade/-1"
    leases, standbys = LeaseLog(state_store), StandbyLog(state_store)
    here = socket.gethostname()

    def killed_while_deferred(run_id: str, pid: int, host: str = here) -> None:
        operator._in_flight = {"run_id": run_id, "pid": pid, "host": host, "submitted_at": time.time()}
        with pytest.raises(TaskDeferred) as caught:
            operator.wait_then(None, RunWait(job_id="job", run_id=run_id, until="ended",
                                             deadline=time.time() + 600), "_dry_run_waited", ctx={})
        assert leases.get("job").owner == operator._lease_owner
        _, kwargs = caught.value.trigger.serialize()
        asyncio.run(StreamRunTrigger(**kwargs).on_kill())
        assert leases.get("job") is None

    def driver() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)

    standbys.register("held", "job", "2.0", 1, host=here, pid=4242, log_path=None, role=SUCCESSOR)
    UpgradeLog(state_store).begin("job", "1.0", "2.0", {"successor": {"standby_id": "held"}})
    drivers = [driver(), driver()]
    try:
        # the preflight's dry run, registered, on this host
        dry = state_store.begin_run("job", 1, "2.0", host=here, pid=drivers[0].pid, dry_run=True)
        killed_while_deferred(dry.run_id, drivers[0].pid)
        assert drivers[0].wait(10) == -9
        assert state_store.get_run(dry.run_id).status == "DEAD"
        ended = standbys.get("held")
        assert ended.status == StandbyStatus.ENDED and "killed while deferred" in ended.message

        # a driver still starting, not registered: killed where it runs
        killed_while_deferred("not-registered", drivers[1].pid)
        assert drivers[1].wait(10) == -9
    finally:
        for process in drivers:
            process.kill()

    # a driver on another host: asked to stop through its row
    elsewhere = state_store.begin_run("job", 1, "2.0", host="another-host", pid=4343, dry_run=True)
    killed_while_deferred(elsewhere.run_id, 4343, "another-host")
    assert state_store.get_run(elsewhere.run_id).stop_requested_at is not None


def test_an_upgrade_killed_while_deferred_on_its_released_successors_start_ends_that_run(state_store, tmp_path):
    """The upgrade released its warm successor and waits, deferred, for its query to start; a person marks the
    task failed.  The trigger's undo ends the launch the task waited on, as for a cold start.  The released
    successor was neither an unreleased one to end nor the task's launch: it ran on after the kill,
    unverified."""
    import asyncio

    import pytest
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog
    from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
    from airflow_stream_provider.triggers.run import StreamRunTrigger
    from tests.integration.task_state import TaskStateStore

    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="job.py", prewarm=True,
                                           deferrable=True)
    operator._lease_owner = "stream_upgrade/manual__1/upgrade/-1"
    here = socket.gethostname()
    old = state_store.begin_run("job", 1, "1.0")
    state_store.finish_run(old.run_id, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True) as driver:
        StandbyLog(state_store).register("succ", "job", "2.0", 1, host=here, pid=driver.pid, log_path=None,
                                         role=SUCCESSOR)
        successor = {"standby_id": "succ", "application": "job.py", "spec": operator.new_spec.to_json()}
        ctx = {"upgrade_id": UpgradeLog(state_store).begin("job", "1.0", "2.0", {"successor": successor}),
               "successor": successor, "decision": {"action": "reuse"}, "generation": 1, "outcome": {}}
        try:
            with pytest.raises(TaskDeferred) as caught:
                operator._release_successor({"task_state_store": TaskStateStore()}, ctx, "upgrade to version 2.0")
            # the successor takes the epoch the release names and starts its query
            state_store.begin_run("job", 1, "2.0", run_id="succ", host=here, pid=driver.pid,
                                  expected_epoch=old.epoch)
            _, kwargs = caught.value.trigger.serialize()
            asyncio.run(StreamRunTrigger(**kwargs).on_kill())
            assert driver.wait(10) == -9
        finally:
            driver.kill()
    assert state_store.get_run("succ").status == "DEAD"
    assert UpgradeLog(state_store).get(ctx["upgrade_id"]).phase == UpgradePhase.DONE


def test_an_upgrade_refused_by_another_tasks_lease_leaves_that_upgrades_successor_alone(state_store, tmp_path):
    """A second upgrade triggered while the first one runs fails on the job's lease, before anything: the
    first upgrade's successor is the first upgrade's to release or end."""
    import time

    import pytest
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
    from airflow_stream_provider.state.leases import LeaseLog
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus
    from airflow_stream_provider.state.upgrades import UpgradeLog

    standbys = StandbyLog(state_store)
    standbys.register("first", "job", "2.0", 1, host=socket.gethostname(), pid=4242, log_path=None, role=SUCCESSOR)
    UpgradeLog(state_store).begin("job", "1.0", "2.0", {"successor": {"standby_id": "first"}})
    assert LeaseLog(state_store).take("job", "stream_upgrade/first/upgrade/-1", "upgrade", time.time() + 300) is None
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    second = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="job.py", prewarm=True)
    with pytest.raises(AirflowFailException, match="stream_upgrade/first/upgrade/-1 \\(upgrade"):
        second.execute({})
    assert standbys.get("first").status == StandbyStatus.WARMING


def test_a_lost_checkpoint_is_named_in_the_recovery_diagnosis(state_store, tmp_path):
    """A run that committed batches, then failed, on a generation whose checkpoint holds no batch any
    more: the recover task's diagnosis says the checkpoint was lost before it restarts."""
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "kafka": {"topics": ["events"]}}
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.mark_query_started(ticket.run_id)
    state_store.record_progress(ticket.run_id, 7, None, committed=True)
    state_store.finish_run(ticket.run_id, status="FAILED", exit_code=6, failure_kind="TRANSIENT",
                           message="broker gone")
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py")

    found = recover.diagnose()
    assert found.health == Health.FAILED
    assert any("holds no batch although run" in line and "it was lost" in line for line in found.evidence), found

    offsets = tmp_path / "checkpoints" / "job" / "gen-1" / "offsets"
    offsets.mkdir(parents=True)
    (offsets / "7").write_text("v1\n{}\n{}\n")
    assert not any("it was lost" in line for line in recover.diagnose().evidence)


def test_a_recovery_a_restart_or_a_reset_leaves_a_job_to_the_upgrade_that_is_starting_it(state_store, tmp_path):
    """The new version failed as it started: the watcher fires, and ``stream_health``'s recover would restart
    the old version from its recorded launch while the upgrade's task rolls back to it.  It does nothing
    while the upgrade's record says it acts on the job, and says why."""
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
    from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "kafka": {"topics": ["events"]}}
    ticket = state_store.begin_run("job", 1, "2.0")
    state_store.finish_run(ticket.run_id, status="FAILED", exit_code=1, failure_kind="USER_CODE",
                           message="a bug in version 2.0")
    upgrades = UpgradeLog(state_store)
    upgrade_id = upgrades.begin("job", "1.0", "2.0", {})
    upgrades.move(upgrade_id, UpgradePhase.STARTING, {})
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py")

    outcome = recover.execute({})

    assert outcome["action"] == "none" and "is in phase STARTING" in outcome["why"], outcome
    assert [r.run_id for r in state_store.runs("job")] == [ticket.run_id]  # nothing started
    assert state_store.restarts_since("job", 0) == []

    # stream_health's reset branch (stream_reset_policy=auto), or a person's restart or reset, likewise
    import pytest
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_stream_provider.operators.reset import ResetStreamingJobOperator
    from airflow_stream_provider.operators.restart import RestartStreamingJobOperator

    for operator, action in ((ResetStreamingJobOperator, "reset"), (RestartStreamingJobOperator, "restart")):
        with pytest.raises(AirflowFailException, match=rf"upgrade {upgrade_id} to version 2.0 is in phase STARTING, "
                                                       rf"and acts on the job itself; a {action} beside it"):
            operator(task_id=action, spec=spec, application="job.py").execute({})
    assert [r.run_id for r in state_store.runs("job")] == [ticket.run_id]
    assert state_store.current_generation("job") == 1


def test_one_task_at_a_time_acts_on_a_job(state_store, tmp_path):
    """A submit from the deploy DAG holds the job's lease through its launch: the health DAG's recover
    beside it waits for it to let go (``test_a_recovery_that_found_the_job_leased_...``), and a person's
    restart fails before doing anything.  A task that ends lets go of it, failing or not; a task resumed
    after its lease was taken stops."""
    import time

    import pytest
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

    from airflow_stream_provider.operators.base import LeaseLost
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
    from airflow_stream_provider.operators.restart import RestartStreamingJobOperator
    from airflow_stream_provider.state.leases import LeaseLog

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "kafka": {"topics": ["events"]}}
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.finish_run(ticket.run_id, status="FAILED", exit_code=1, failure_kind="TRANSIENT", message="gone")
    leases = LeaseLog(state_store)
    submit_owner = "stream_deploy/manual__1/submit/-1"
    assert leases.take("job", submit_owner, "submit", time.time() + 300) is None  # its driver is starting

    with pytest.raises(TaskDeferred):
        RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py").execute({})
    with pytest.raises(AirflowFailException, match=rf"task {submit_owner} \(submit.* acts on the job now, and a "
                                                   "restart beside it could start or stop a driver"):
        RestartStreamingJobOperator(task_id="restart", spec=spec, application="job.py").execute({})
    assert [r.run_id for r in state_store.runs("job")] == [ticket.run_id]  # nothing started
    assert state_store.restarts_since("job", 0) == []
    assert leases.get("job").owner == submit_owner

    # a task resumed from its trigger after its lease ran out and another task took it stops there
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py")
    event = {"outcome": "paused", "resume": {"method": "_act", "state": {"action": "restart", "reason": "x",
                                                                        "outcome": {}}}}
    with pytest.raises(LeaseLost, match="while this task waited, its lease on the job ran out"):
        recover.execute_complete({}, event)
    assert [r.run_id for r in state_store.runs("job")] == [ticket.run_id]

    leases.release("job", submit_owner)  # the submit ended
    from airflow_stream_provider.operators.stop import StopStreamingJobOperator
    from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

    StopStreamingJobOperator(task_id="stop", spec=spec).execute({})  # nothing runs: a no-op that succeeds
    assert leases.get("job") is None
    upgrades = UpgradeLog(state_store)
    upgrades.move(upgrades.begin("job", "1.0", "2.0", {}), UpgradePhase.STARTING, {})
    with pytest.raises(AirflowFailException, match="is in phase STARTING"):  # a task failing lets go too
        RestartStreamingJobOperator(task_id="restart", spec=spec, application="job.py").execute({})
    assert leases.get("job") is None


def test_a_task_resumed_after_another_held_its_lease_in_between_stops(state_store, tmp_path):
    """A stop defers while its run finishes its batch.  Its lease runs out meanwhile (the extension over the
    wait refused by a state database away for a moment, a triggerer or worker slot late), and a restart
    takes the lease, acts and lets go.  Resumed, the stop takes a free lease: it must not go on from what it
    saw before its wait, as if the restart had not happened.  A lease that ran out with nobody taking it
    in between is the same hold, and the task goes on."""
    import time

    import pytest
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_stream_provider.operators.base import LeaseLost
    from airflow_stream_provider.operators.stop import StopStreamingJobOperator
    from airflow_stream_provider.state.leases import LeaseLog

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "kafka": {"topics": ["events"]}}
    live = state_store.begin_run("job", 1, "1.0", host="another-host", pid=4242).run_id
    state_store.mark_query_started(live)
    leases = LeaseLog(state_store)

    def deferred_stop() -> tuple[StopStreamingJobOperator, dict]:
        stop = StopStreamingJobOperator(task_id="stop", spec=spec)
        stop._stop_waited = lambda context, event, **state: "went on"  # what follows the wait: not under test
        with pytest.raises(TaskDeferred) as deferred:
            stop.execute({})
        resume = deferred.value.trigger.resume
        held = leases.get("job")
        assert (held.owner, held.taken_at) == (stop._lease_owner, resume["held_since"])
        leases.take("job", held.owner, "stop", time.time() - 1)  # it runs out
        return stop, {"outcome": "ended", "run_id": live, "resume": resume}

    stop, event = deferred_stop()
    restart_owner = "stream_restart/manual__1/restart/-1"
    assert leases.take("job", restart_owner, "restart", time.time() + 300) is None
    leases.release("job", restart_owner)
    with pytest.raises(LeaseLost, match="another task took it and let go of it since"):
        stop.execute_complete({}, event)
    assert leases.get("job") is None, "the stopped task kept the lease it took back"

    stop, event = deferred_stop()
    assert stop.execute_complete({}, event) == "went on"


def test_a_state_database_of_an_older_release_gains_the_new_columns_in_place(store):
    """An older release created ``stream_runs`` without ``ui_url``: the next start adds the column, and
    the runs recorded before read it as None.  A second start (or a racing one) changes nothing."""
    from sqlalchemy import inspect, text

    before = store.begin_run("job", 1, "1.0")
    with store.engine.begin() as conn:  # the table as an older release left it
        conn.execute(text("ALTER TABLE stream_runs DROP COLUMN ui_url"))
    assert "ui_url" not in {c["name"] for c in inspect(store.engine).get_columns("stream_runs")}

    store.ensure_schema()

    assert store.get_run(before.run_id).ui_url is None
    after = store.begin_run("job", 1, "1.0")
    store.record_ui_url(after.run_id, "http://driver-host:4040")
    assert store.get_run(after.run_id).ui_url == "http://driver-host:4040"
    assert schema.add_missing_columns(store.engine) == []


def test_a_recovery_that_found_the_job_leased_waits_for_it_and_diagnoses_afresh(state_store, tmp_path):
    """The watcher reports a condition once.  A recover that found another task acting on the job (an
    upgrade's preflight, when the old driver died) and simply left it, would leave the job down when that
    task ends without repairing it (the upgrade aborts): nothing would fire again before the sweep.  It
    waits in the triggerer instead, holding no lease, and acts on what it finds once the other task let go."""
    import time

    import pytest
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_stream_provider.operators import recover as recover_module
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
    from airflow_stream_provider.state.leases import LeaseLog

    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "kafka": {"topics": ["events"]}}
    dead = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(dead)
    state_store.mark_dead(dead, "found dead: its driver process is gone")
    leases = LeaseLog(state_store)
    upgrade_owner = "stream_upgrade/manual__1/upgrade/-1"
    assert leases.take("job", upgrade_owner, "upgrade", time.time() + 300) is None  # its preflight runs

    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py")
    with pytest.raises(TaskDeferred) as deferred:
        recover.execute({})
    trigger = deferred.value.trigger
    assert (trigger.wait, trigger.pause_s, trigger.resume["method"]) == (None, recover_module.LEASE_RETRY_S,
                                                                         recover_module.LOOK_AGAIN)
    assert leases.get("job").owner == upgrade_owner, "the waiting recovery holds nothing"
    looked_again = {"outcome": "paused", "run_id": None, "resume": trigger.resume}
    with pytest.raises(TaskDeferred):  # still held: it waits again
        recover.execute_complete({}, looked_again)

    # The upgrade aborts after its preflight; meanwhile a person started the job again by hand.
    live = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(live)
    leases.release("job", upgrade_owner)
    outcome = recover.execute_complete({}, looked_again)
    assert outcome["action"] == "none" and outcome["diagnosis"]["run_id"] == live, outcome
    assert outcome["diagnosis"]["health"] == "HEALTHY" and leases.get("job") is None

    # Not deferrable: the same wait, in the worker
    monkey = pytest.MonkeyPatch()
    monkey.setattr(recover_module, "LEASE_RETRY_S", 0.1)
    leases.take("job", upgrade_owner, "upgrade", time.time() + 0.5)
    blocking = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="job.py", deferrable=False)
    assert blocking.execute({})["diagnosis"]["run_id"] == live  # once the lease ran out
    # Many looks (a lease held for half an hour, every 10 s): one after another, not nested
    monkey.setattr(recover_module, "LEASE_RETRY_S", 0.0)
    leases.take("job", upgrade_owner, "upgrade", time.time() + 3)
    assert blocking.execute({})["diagnosis"]["run_id"] == live
    monkey.undo()


def _result_table(name: str):
    from sqlalchemy import BigInteger, Column, MetaData, Table, Text

    return Table(name, MetaData(), Column("k", Text, primary_key=True), Column("minute", BigInteger, primary_key=True),
                 Column("n", BigInteger))


@pytest.mark.parametrize(("made_with", "takes_it"), [
    ("", True),  # the sink creates it, keyed
    ("CREATE TABLE {t} (k TEXT, minute BIGINT, n BIGINT, PRIMARY KEY (minute, k))", True),
    ("CREATE TABLE {t} (k TEXT NOT NULL, minute BIGINT NOT NULL, n BIGINT, UNIQUE (k, minute))", True),
    ("CREATE TABLE {t} (k TEXT, minute BIGINT, n BIGINT); CREATE UNIQUE INDEX {t}_key ON {t} (minute, k)", True),
    ("CREATE TABLE {t} (k TEXT, minute BIGINT, n BIGINT)", False),
    ("CREATE TABLE {t} (k TEXT, minute BIGINT, n BIGINT); CREATE INDEX {t}_key ON {t} (k, minute)", False),
    ("CREATE TABLE {t} (k TEXT PRIMARY KEY, minute BIGINT, n BIGINT)", False),  # a subset: not the upsert's key
    ("CREATE TABLE {t} (k TEXT, minute BIGINT, n BIGINT, UNIQUE (k, minute, n))", False),  # a superset
], ids=["created", "pk", "unique", "unique_index", "no_key", "plain_index", "subset", "superset"])
def test_a_result_table_that_exists_must_hold_the_results_key_unique(state_store, made_with, takes_it):
    """A table made by hand without the result's key unique: a small batch's upsert would fail in the
    database (ON CONFLICT needs it) and a large one's direct COPY would store a key twice.  The sink's first
    batch refuses it instead, saying what to do."""
    from sqlalchemy import text

    from airflow_stream_provider.state.store import ResultTableError

    name = f"hand_made_{len(made_with)}"
    with state_store.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
        for statement in filter(None, made_with.format(t=name).split("; ")):
            conn.execute(text(statement))
    if takes_it:
        state_store.ensure_table(_result_table(name))
        return
    with pytest.raises(ResultTableError, match=rf"result table '{name}' exists without a primary key or unique "
                       rf"constraint on its key \(k, minute\).*ALTER TABLE {name} ADD PRIMARY KEY \(k, minute\)") \
            as refused:
        state_store.ensure_table(_result_table(name))
    from airflow_stream_provider.runtime.poison import may_be_record_error

    assert not may_be_record_error(refused.value), "the batch's records would be isolated one by one for it"
