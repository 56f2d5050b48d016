"""The always-on watcher under asyncio, against a real state database (SQLite and PostgreSQL) and the
triggerer's own shared-stream manager: one event per transition, never again while the condition
persists, nothing lost across a triggerer restart, one poll for every watched job, and clear events for
an unknown job or an unreachable database while the watcher keeps running."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_stream_provider import local_driver
from airflow_stream_provider.state.store import HealthReportKey, StateStore
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from airflow_stream_provider.triggers import watch
from airflow_stream_provider.triggers.watch import StreamJobWatchTrigger
from tests.dagtest import airflow as airflow_stack

POLL = 0.2


class _AirflowStates(dict):
    """Task instance states Airflow would give, by lease owner, and the owners it was asked about."""

    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def ended(self, owner: str, log) -> bool:
        self.asked.append(owner)
        return self.get(owner) == "failed"


@pytest.fixture
def airflow_states(monkeypatch) -> _AirflowStates:
    """Airflow's answer about a task comes through the triggerer's supervisor, which does not run here: a
    stand-in gives it (``watch.task_ended``); the real ask is in ``real_airflow``."""
    states = _AirflowStates()
    monkeypatch.setattr(watch, "task_ended", states.ended)
    return states


def _trigger(job_id: str = "job", **kwargs) -> StreamJobWatchTrigger:
    return StreamJobWatchTrigger(job_id=job_id, heartbeat_timeout=5, poll_interval=POLL, **kwargs)


def _running(store: StateStore, job_id: str = "job") -> str:
    ticket = store.begin_run(job_id, 1, "1.0")
    store.mark_query_started(ticket.run_id)
    return ticket.run_id


def _kill(store: StateStore, run_id: str) -> None:
    """What a SIGKILL leaves behind where the process cannot be checked: a run whose heartbeat stops."""
    store._update_run(run_id, heartbeat_at=time.time() - 60)


async def _events(trigger: StreamJobWatchTrigger, polls: int) -> list[dict]:
    """Every event ``trigger`` yields over ``polls`` real polls of the state database, as the triggerer
    would collect them.  Counted in polls, not seconds: a slow machine watches exactly as long."""
    async def limited():
        stream = trigger.open_shared_stream(trigger.serialize()[1])
        try:
            for _ in range(polls):
                yield await anext(stream)
        finally:
            await stream.aclose()

    return [event.payload async for event in trigger.filter_shared_stream(limited())]


@contextlib.asynccontextmanager
async def _watching(trigger: StreamJobWatchTrigger):
    """``trigger.run()`` collecting its events, as the triggerer runs it, for as long as the block lasts:
    a scenario changes the database under it and waits polls (``_Polls``) for what follows."""
    found: list[dict] = []

    async def collect():
        async for event in trigger.run():
            found.append(event.payload)

    task = asyncio.ensure_future(collect())
    try:
        yield found
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class _Polls:
    """The watcher's polls as they complete, so a scenario that changes the database under a running
    trigger waits a number of polls rather than a time."""

    def __init__(self, monkeypatch):
        self.times: list[float] = []
        poll = watch.JobsWatch.poll
        monkeypatch.setattr(watch.JobsWatch, "poll", lambda w: self._done(poll(w)))

    def _done(self, snapshot):
        self.times.append(time.time())
        return snapshot

    async def wait(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` more polls completed; the events of all but the last are collected by then
        (the next poll starts only when the subscribers asked for it)."""
        target = len(self.times) + count
        deadline = time.monotonic() + timeout
        while len(self.times) < target:
            assert time.monotonic() < deadline, f"{len(self.times)} of {target} polls in {timeout:.0f}s"
            await asyncio.sleep(0.02)


def test_serialises_and_shares_one_poll_per_database_and_thresholds():
    classpath, kwargs = _trigger().serialize()
    assert classpath == "airflow_stream_provider.triggers.watch.StreamJobWatchTrigger"
    assert StreamJobWatchTrigger(**json.loads(json.dumps(kwargs))).serialize() == (classpath, kwargs)
    assert _trigger("a").shared_stream_key() == _trigger("b").shared_stream_key()
    assert _trigger("a").shared_stream_key() != _trigger("a", stuck_after=60).shared_stream_key()
    with pytest.raises(ValueError, match=r"fire_on \['HEALTHY'\].*choose from"):
        _trigger(fire_on=["DEAD", "HEALTHY"])


def test_one_event_per_transition_and_none_while_it_persists(state_store):
    run_id = _running(state_store)

    async def scenario():
        events = await _events(_trigger(), 5)
        assert events == [], "a healthy job makes no event"
        _kill(state_store, run_id)
        return await _events(_trigger(), 10)  # ten polls of a dead run

    events = asyncio.run(scenario())
    assert [(e["status"], e["diagnosis"]["health"], e["diagnosis"]["run_id"]) for e in events] == [
        ("fired", "DEAD", run_id)], events
    assert "is recorded as RUNNING but its last heartbeat is" in events[0]["message"]
    reported = {w.job_id: w.reported for w in state_store.watched_jobs()}["job"]
    assert reported == {HealthReportKey(run_id, "DEAD", "")}, "the report is persisted"

    # A triggerer restart: a new trigger instance, nothing in memory.  The condition persists: no event.
    assert asyncio.run(_events(_trigger(), 5)) == []
    # The run is then recorded DEAD by recovery: same run, same health, still no event.
    state_store.mark_dead(run_id, "driver gone")
    assert asyncio.run(_events(_trigger(), 5)) == []


def test_a_new_failure_of_a_new_run_fires_again_with_its_kind(state_store):
    first = _running(state_store)
    _kill(state_store, first)
    assert [e["diagnosis"]["run_id"] for e in asyncio.run(_events(_trigger(), 5))] == [first]
    second = state_store.begin_run("job", 1, "1.0").run_id
    state_store.finish_run(second, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                     error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
                     message="[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match")
    events = asyncio.run(_events(_trigger(), 5))
    assert [(e["diagnosis"]["run_id"], e["diagnosis"]["failure_kind"], e["diagnosis"]["error_class"])
            for e in events] == [(second, "CHECKPOINT_INCOMPATIBLE", "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE")]


def test_a_run_a_restart_stopped_and_left_down_is_reported_once(state_store):
    """A STUCK run's restart stopped it cleanly, then its launch failed (or its task was lost): STOPPED is
    no condition to report, yet nobody asked for this stop.  The watcher reports the restart owed, once,
    so that the health DAG finishes it; a restart that launched its run leaves nothing to report."""
    stuck = _running(state_store)
    state_store.record_restart("job", "restart", "STUCK: no batch for 600s", stuck, None)  # begun
    assert asyncio.run(_events(_trigger(), 3)) == [], "a running query is owed nothing"
    state_store.request_stop(stuck)
    state_store.finish_run(stuck, status="STOPPED", exit_code=0, message="stopped")
    # Just stopped: the restart's task is resuming from the stop's wait to launch (seconds on a busy
    # Airflow).  Taken for a restart under way for a heartbeat timeout, it is not reported yet.
    assert asyncio.run(_events(_trigger(), 3)) == [], "a restart under way is not an interrupted one"
    state_store._update_run(stuck, ended_at=time.time() - 6)  # the heartbeat timeout (5 s) has passed

    (watched,) = state_store.watched_jobs()
    assert (watched.last_restart["failed_run_id"], watched.last_restart["new_run_id"]) == (stuck, None)
    events = asyncio.run(_events(_trigger(), 5))
    assert [(e["diagnosis"]["health"], e["diagnosis"]["run_id"]) for e in events] == [("STOPPED", stuck)], events
    owed = events[0]["diagnosis"]["interrupted_restart"]
    assert owed["reason"] == "STUCK: no batch for 600s", owed
    assert "started no new one: nobody asked for this stop" in events[0]["message"]
    assert asyncio.run(_events(_trigger(), 3)) == [], "reported once, also across a triggerer restart"

    state_store.record_restart("job", "restart", "STUCK: no batch for 600s", stuck, "r-new")  # it launched
    assert state_store.watched_jobs()[0].last_restart["new_run_id"] == "r-new"
    assert asyncio.run(_events(_trigger(), 3)) == []


def test_a_dead_run_whose_recovery_ended_without_restarting_it_is_reported_again(state_store, airflow_states):
    """A dead run is reported once, and that report's recovery began the restart, then its task was lost (or
    failed on its last try) before it launched: nothing would bring the job back before the sweep.  Once
    Airflow says that task has ended, the run is reported again, once, as owed its restart; while the task
    is at work (backing off, launching, a retry to come), nothing.  Airflow's answer comes through the
    triggerer's supervisor, which does not run here: a stand-in gives it (the real ask is
    ``real_airflow/test_lost_recovery.py``)."""
    task = "stream_health/asset_triggered__1/recover/-1"
    states, asked = airflow_states, airflow_states.asked
    states[task] = "running"
    run_id = _running(state_store)
    _kill(state_store, run_id)
    events = asyncio.run(_events(_trigger(), 3))
    assert [e["diagnosis"]["health"] for e in events] == ["DEAD"] and asked == [], "no restart begun: not asked"

    state_store.record_restart("job", "restart", "DEAD: driver gone", run_id, None, task)  # the recovery's
    for state in ("running", "up_for_retry"):
        states[task] = state
        assert asyncio.run(_events(_trigger(), 3)) == [], f"its task {state}: it restarts the run itself"
    assert asked == [task] * 2, asked

    states[task] = "failed"
    events = asyncio.run(_events(_trigger(), 4))
    assert [e["diagnosis"]["health"] for e in events] == ["DEAD"], events
    owed = events[0]["diagnosis"]["interrupted_restart"]
    assert (owed["failed_run_id"], owed["reason"]) == (run_id, "DEAD: driver gone"), owed
    assert f"its task {task} has ended in Airflow: nobody finishes it" in events[0]["message"]
    assert asyncio.run(_events(_trigger(), 3)) == [], "reported once, also across a triggerer restart"
    states[task] = "unanswered"  # Airflow cannot be asked for a while: the run reads plainly DEAD again
    assert asyncio.run(_events(_trigger(), 3)) == [], "a run down is reported once per condition, not per flip"
    states[task] = "failed"
    assert asyncio.run(_events(_trigger(), 3)) == []

    restarted = _running(state_store)  # the next recovery launched it
    state_store.record_restart("job", "restart", "DEAD: driver gone", run_id, restarted)
    assert asyncio.run(_events(_trigger(), 3)) == []


def test_a_stuck_run_whose_recovery_ended_before_its_stop_is_reported_again(state_store, airflow_states):
    """A STUCK run is reported once, and that report's recovery began the restart, then its task was lost
    before its stop ended the run (in the stop's wait, or killed while deferred there): the driver still runs,
    stuck, and its one report is spent.  Once Airflow says that task has ended, the run is reported again,
    once, as owed its restart; a flip of Airflow's answer reports it STUCK no second time."""
    task = "stream_health/asset_triggered__1/recover/-1"
    states = airflow_states
    # Its driver: this process, alive on this host, and silent past stuck_after (the watcher checks the pid)
    ticket = state_store.begin_run("job", 1, "1.0", host=local_driver.this_host(), pid=os.getpid())
    state_store.mark_query_started(ticket.run_id)
    _kill(state_store, ticket.run_id)

    def stuck_watch() -> StreamJobWatchTrigger:
        return _trigger(stuck_after=10)

    events = asyncio.run(_events(stuck_watch(), 3))
    assert [e["diagnosis"]["health"] for e in events] == ["STUCK"], events
    state_store.record_restart("job", "restart", "STUCK: silent for 60s", ticket.run_id, None, task)
    states[task] = "deferred"  # waiting for the stuck driver to stop
    assert asyncio.run(_events(stuck_watch(), 3)) == [], "its task is at work: it stops and restarts the run"

    states[task] = "failed"
    events = asyncio.run(_events(stuck_watch(), 3))
    assert [(e["diagnosis"]["health"], e["diagnosis"]["interrupted_restart"]["failed_run_id"]) for e in events] \
        == [("STUCK", ticket.run_id)], events
    assert f"its task {task} has ended in Airflow: nobody finishes it" in events[0]["message"]
    states[task] = "unanswered"  # Airflow cannot be asked for a while: the run reads plainly STUCK again
    assert asyncio.run(_events(stuck_watch(), 3)) == [], "a run is reported once per condition, not per flip"
    states[task] = "failed"
    assert asyncio.run(_events(stuck_watch(), 3)) == []


def test_a_death_while_the_triggerer_was_down_is_reported_when_it_returns(state_store):
    run_id = _running(state_store)
    assert asyncio.run(_events(_trigger(), 3)) == []  # the triggerer watched, then went away
    _kill(state_store, run_id)  # ... and the driver died meanwhile
    events = asyncio.run(_events(_trigger(), 5))  # the triggerer is back
    assert [(e["diagnosis"]["health"], e["diagnosis"]["run_id"]) for e in events] == [("DEAD", run_id)]


def test_fire_on_limits_what_is_reported(state_store):
    run_id = state_store.begin_run("job", 1, "1.0").run_id
    state_store.finish_run(run_id, status="FAILED", exit_code=1, failure_kind="USER_CODE", message="bug")
    assert asyncio.run(_events(_trigger(fire_on=["DEAD"]), 4)) == []
    assert len(asyncio.run(_events(_trigger(fire_on=["FAILED"]), 4))) == 1


def test_watchers_of_many_jobs_share_one_poll_in_the_triggerer(state_store, monkeypatch):
    """Through the triggerer's own SharedStreamManager: one state-database poll per interval feeds every
    watcher, and each fires for its own job only."""
    runs = {job: _running(state_store, job) for job in ("a", "b", "c")}
    polls = _Polls(monkeypatch)

    async def scenario():
        manager = SharedStreamManager()
        found: dict[str, list[dict]] = {job: [] for job in runs}

        async def subscriber(trigger_id: int, job: str):
            trigger = _trigger(job)
            stream = manager.subscribe(trigger_id=trigger_id, trigger=trigger, key=trigger.shared_stream_key())
            async for event in trigger.filter_shared_stream(stream):
                found[job].append(event.payload)

        tasks = [asyncio.ensure_future(subscriber(i, job)) for i, job in enumerate(runs)]
        await polls.wait(3)
        _kill(state_store, runs["b"])
        await polls.wait(5)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await manager.stop_all()
        return found

    found = asyncio.run(scenario())
    assert found["a"] == [] and found["c"] == []
    assert [(e["job_id"], e["diagnosis"]["run_id"]) for e in found["b"]] == [("b", runs["b"])]
    seconds = polls.times[-1] - polls.times[0]
    assert len(polls.times) <= seconds / POLL + 2, f"{len(polls.times)} polls in {seconds:.1f}s for three watchers"


def test_an_unknown_job_is_reported_once_and_the_watcher_keeps_watching(state_store, monkeypatch):
    polls = _Polls(monkeypatch)

    async def scenario():
        async with _watching(_trigger("not-deployed-yet")) as found:
            await polls.wait(5)
            run_id = _running(state_store, "not-deployed-yet")  # then it is deployed, and dies
            _kill(state_store, run_id)
            await polls.wait(5)
        return found, run_id

    found, run_id = asyncio.run(scenario())
    assert [e["status"] for e in found] == ["error", "fired"], found
    assert "job 'not-deployed-yet' is unknown to the state database" in found[0]["message"]
    assert "Check the job id" in found[0]["message"]
    assert found[1]["diagnosis"]["run_id"] == run_id


def test_an_unreachable_database_is_reported_once_and_the_watcher_keeps_running(tmp_path, monkeypatch,
                                                                                broker):
    missing = tmp_path / "not-yet" / "state.db"  # SQLite cannot open a file in a missing directory
    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_default", conn_type="stream_state",
                                                     extra={"url": f"sqlite:///{missing}"}))
    monkeypatch.setenv(*airflow_stack.connection_env("stream_kafka_default", conn_type="stream_kafka",
                                                     host="127.0.0.1", port=broker.port))

    polls = _Polls(monkeypatch)

    async def scenario():
        async with _watching(_trigger()) as found:
            await polls.wait(5)
            missing.parent.mkdir()  # the database comes back, holding a dead run
            store = StateStore.from_url(f"sqlite:///{missing}")
            store.ensure_schema()
            _kill(store, _running(store))
            await polls.wait(35)  # silent for a heartbeat timeout (5 s) since the database answered
        store.dispose()
        return found

    found = asyncio.run(scenario())
    assert [e["status"] for e in found] == ["error", "fired"], found
    assert "cannot read the state database of connection 'stream_state_default'" in found[0]["message"]
    assert "the watcher keeps polling" in found[0]["message"]


def test_drivers_silent_through_a_database_outage_are_not_dead_when_it_returns(state_store, monkeypatch):
    """While the state database is away no driver can heartbeat.  Judged by heartbeats (its process is not
    on this host), a driver's silence counts from when the database answers again: a live driver has a
    heartbeat timeout to write its next one, and one that died meanwhile is reported after it."""
    run_id = _running(state_store)
    polls = _Polls(monkeypatch)
    working = StateStore.watched_jobs
    away = {"now": False}

    def watched_jobs(store):
        if away["now"]:
            raise ConnectionError("could not connect to server")
        return working(store)

    monkeypatch.setattr(StateStore, "watched_jobs", watched_jobs)

    async def scenario():
        async with _watching(_trigger()) as found:
            await polls.wait(3)
            away["now"] = True  # the database goes away for a minute...
            await polls.wait(3)
            state_store._update_run(run_id, heartbeat_at=time.time() - 60)  # ...through which none heartbeats
            away["now"] = False
            await polls.wait(10)  # two seconds: within the heartbeat timeout (5 s)
            quiet = list(found)
            await polls.wait(30)  # the driver never heartbeats again: dead after all
        return quiet, found

    quiet, found = asyncio.run(scenario())
    assert [e["status"] for e in quiet] == ["error"], quiet
    assert [(e["status"], e.get("diagnosis", {}).get("health")) for e in found] == [("error", None),
                                                                                    ("fired", "DEAD")], found


def test_a_job_that_cannot_be_diagnosed_does_not_blind_the_watchers_of_the_others(state_store, monkeypatch):
    """One job's run recorded with a failure kind this release does not know (a newer driver wrote it) is
    FAILED/UNKNOWN, not an error; and where one job's diagnosis does fail, the others are watched still."""
    dead = _running(state_store, "a")
    _kill(state_store, dead)
    newer = state_store.begin_run("b", 1, "1.0").run_id
    state_store.finish_run(newer, status="FAILED", exit_code=9, failure_kind="A_KIND_FROM_A_NEWER_RELEASE",
                           message="something new")

    events = asyncio.run(_events(_trigger("b"), 3))
    assert [(e["diagnosis"]["health"], e["diagnosis"]["failure_kind"]) for e in events] == [("FAILED", "UNKNOWN")]
    assert "A_KIND_FROM_A_NEWER_RELEASE, a failure kind this release does not know" in events[0]["message"]

    # A failure to diagnose one job: a stand-in, as a database error in one job's lookups alone cannot be
    # produced against a real database that answers the others.
    diagnose = watch.JobsWatch.diagnose

    def failing_for_b(self, job, now):
        if job.job_id == "b":
            raise RuntimeError("the standby table is locked")
        return diagnose(self, job, now)

    monkeypatch.setattr(watch.JobsWatch, "diagnose", failing_for_b)
    state_store.forget_health_report("b", HealthReportKey(newer, "FAILED", "UNKNOWN"))

    async def both():
        return await asyncio.gather(_events(_trigger("a"), 4), _events(_trigger("b"), 4))

    for_a, for_b = asyncio.run(both())
    assert [(e["status"], e["diagnosis"]["run_id"]) for e in for_a] == [("fired", dead)], for_a
    assert [e["status"] for e in for_b] == ["error"], for_b
    assert for_b[0]["message"].startswith("cannot diagnose job 'b': "), for_b
    assert "watches the other jobs all the same" in for_b[0]["message"]


def test_a_malformed_asset_uri_fails_at_parse_time_naming_the_form(tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "bad_asset.py").write_text(
        "import datetime as dt\n"
        "from airflow.sdk import DAG, Asset\n"
        "with DAG('bad_asset', schedule=Asset(uri='stream://events/extra', name='x'),\n"
        "         start_date=dt.datetime(2026, 1, 1)):\n"
        "    pass\n")
    bag = DagBag(str(tmp_path))
    (error,) = bag.import_errors.values()
    assert "is not a stream job asset URI; expected stream://<job_id>" in error, error


def test_a_run_that_leaves_the_condition_fires_again_when_it_reenters(state_store, monkeypatch):
    """A heartbeat that stalls and comes back (a long GC pause, a database lock) is two transitions."""
    polls = _Polls(monkeypatch)
    run_id = _running(state_store)
    _kill(state_store, run_id)
    assert len(asyncio.run(_events(_trigger(), 4))) == 1

    async def back_then_gone_again():
        async with _watching(_trigger()) as found:
            state_store.heartbeat(run_id)  # it was alive after all
            await polls.wait(5)
            assert {w.job_id: w.reported for w in state_store.watched_jobs()}["job"] == set(), \
                "the report is forgotten"
            _kill(state_store, run_id)
            await polls.wait(5)
        return found

    events = asyncio.run(back_then_gone_again())
    assert [(e["diagnosis"]["health"], e["diagnosis"]["run_id"]) for e in events] == [("DEAD", run_id)]


def test_a_healthy_run_that_wants_a_standby_and_has_none_is_reported_once_per_loss(state_store):
    """After a takeover, or when its standby died, a run launched with ``standby`` on has none: one
    NO_STANDBY event, so the health DAG starts one at once; again each time a standby is lost anew.  The
    standby is a real process here (its liveness is a process check on this host)."""
    import socket
    import subprocess

    from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus

    standbys = StandbyLog(state_store)
    run_id = _running(state_store)
    state_store.record_launch(run_id, "/jobs/events.py", json.dumps({"standby": True, "kafka": {"topics": ["e"]}}))

    def standby(standby_id: str, process: subprocess.Popen) -> None:
        standbys.register(standby_id, "job", "1.0", 1, host=socket.gethostname(), pid=process.pid, log_path=None)
        standbys.ready(standby_id)

    with subprocess.Popen(["sleep", "60"]) as first:
        standby("s-1", first)
        assert asyncio.run(_events(_trigger(), 4)) == [], "a warm standby: nothing to report"
        first.kill()
        first.wait()
        state_store.heartbeat(run_id)
        events = asyncio.run(_events(_trigger(), 4))
    assert [(e["diagnosis"]["health"], e["diagnosis"]["standby"]) for e in events] == [("HEALTHY", "MISSING")]
    assert "no standby is warm" in events[0]["message"]
    assert standbys.get("s-1").status == StandbyStatus.DEAD, "the vanished standby is recorded"
    state_store.heartbeat(run_id)
    assert asyncio.run(_events(_trigger(), 4)) == [], "reported once while it persists"

    with subprocess.Popen(["sleep", "60"]) as second:  # a standby came, and is lost again
        standby("s-2", second)
        state_store.heartbeat(run_id)
        assert asyncio.run(_events(_trigger(), 4)) == []
        second.kill()
        second.wait()
        state_store.heartbeat(run_id)
        again = asyncio.run(_events(_trigger(), 4))
    assert [e["diagnosis"]["standby"] for e in again] == ["MISSING"]

    state_store.set_status(run_id, "STOPPING")  # a job being stopped needs no standby
    state_store.heartbeat(run_id)
    plain = _running(state_store, "plain")  # nor does a run launched without one
    state_store.record_launch(plain, "/jobs/events.py", json.dumps({"kafka": {"topics": ["e"]}}))
    assert asyncio.run(_events(_trigger(), 4)) == []
    assert asyncio.run(_events(_trigger("plain"), 4)) == []


def test_a_run_an_upgrade_stopped_and_its_ended_task_left_down_is_reported_once(state_store, airflow_states):
    """An upgrade stopped the job, and its task ended (its worker lost, or failed on its last try) before it
    started the new version: the record stays in STOPPING.  The watcher reports the restart owed, once, as
    soon as Airflow says that task has ended; while it is at work (a retry to come included), nothing.
    Airflow's answer comes through the triggerer's supervisor, which does not run here: a stand-in gives it
    (the real ask is ``real_airflow/test_lost_upgrade.py``)."""
    task = "stream_upgrade/manual__1/upgrade/-1"
    states, asked = airflow_states, airflow_states.asked
    states[task] = "running"
    old = _running(state_store)
    upgrades = UpgradeLog(state_store)
    detail = {"task": task, "live_run_id": old}
    upgrade_id = upgrades.begin("job", "1.0", "1.1", detail)
    upgrades.move(upgrade_id, UpgradePhase.STOPPING, detail)
    assert asyncio.run(_events(_trigger(), 3)) == [] and asked == [], "a running job: Airflow is not asked"

    state_store.request_stop(old)
    state_store.finish_run(old, status="STOPPED", exit_code=0, message="stopped")
    for state in ("running", "up_for_retry"):
        states[task] = state
        assert asyncio.run(_events(_trigger(), 3)) == [], f"its task {state}: it goes on with the upgrade itself"
    assert asked == [task] * 2, "a task at work is asked about every few seconds, not at every poll"

    states[task] = "failed"
    events = asyncio.run(_events(_trigger(), 5))
    assert [(e["diagnosis"]["health"], e["diagnosis"]["run_id"]) for e in events] == [("STOPPED", old)], events
    owed = events[0]["diagnosis"]["interrupted_restart"]
    assert (owed["upgrade_id"], owed["failed_run_id"]) == (upgrade_id, old), owed
    assert "has ended in Airflow without finishing it" in events[0]["message"]
    assert len(asked) == 3, "an ended task is remembered: not asked at every poll"
    assert asyncio.run(_events(_trigger(), 3)) == [], "reported once, also across a triggerer restart"

    upgrades.move(upgrade_id, UpgradePhase.DONE, detail, result="killed")  # a recovery ended it
    assert asyncio.run(_events(_trigger(), 3)) == []


@pytest.mark.parametrize("thresholds", [{"poll_interval": 0}, {"poll_interval": -1}, {"stuck_after": -5}])
def test_a_watcher_that_would_poll_without_pause_or_report_every_run_fails_when_the_dag_is_parsed(thresholds):
    from airflow_stream_provider.assets.stream import stream_job_asset

    with pytest.raises(ValueError, match=f"{next(iter(thresholds))}=.*give a number of seconds above 0"):
        stream_job_asset("orders", **thresholds)
