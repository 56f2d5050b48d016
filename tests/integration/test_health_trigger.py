"""The health trigger under asyncio, against a real state database: it fires the right event, serialises
for the triggerer, and keeps polling while the job is healthy."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from sqlalchemy.exc import OperationalError

from airflow_stream_provider import kafka_offsets, local_driver
from airflow_stream_provider.diagnosis import Health, Thresholds
from airflow_stream_provider.lifecycle import health
from airflow_stream_provider.lifecycle.controller import caught_up
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.state import schema
from airflow_stream_provider.triggers.health import StreamHealthTrigger


def _trigger(**kwargs) -> StreamHealthTrigger:
    return StreamHealthTrigger(job_id="job", topics=["events"], state_conn_id="stream_state_default",
                               kafka_conn_id="stream_kafka_default", heartbeat_timeout=5, poll_interval=0.2,
                               **kwargs)


def test_serialises_to_its_own_classpath_and_json():
    classpath, kwargs = _trigger().serialize()
    assert classpath == "airflow_stream_provider.triggers.health.StreamHealthTrigger"
    assert StreamHealthTrigger(**json.loads(json.dumps(kwargs))).serialize() == (classpath, kwargs)


def test_fires_dead_for_a_driver_without_heartbeat(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.mark_query_started(ticket.run_id)
    state_store._update_run(ticket.run_id, heartbeat_at=time.time() - 60)
    event = asyncio.run(_trigger().run().asend(None))
    assert event.payload["status"] == "fired"
    assert event.payload["diagnosis"]["health"] == "DEAD"
    assert event.payload["diagnosis"]["run_id"] == ticket.run_id


def test_keeps_polling_while_healthy_then_fires_on_failure(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.mark_query_started(ticket.run_id)

    async def scenario():
        watcher = asyncio.ensure_future(_trigger().run().asend(None))
        for _ in range(5):  # healthy: no event for a while
            await asyncio.sleep(0.2)
            state_store.heartbeat(ticket.run_id)
            assert not watcher.done()
        state_store.finish_run(ticket.run_id, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                         error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
                         message="[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match")
        return await asyncio.wait_for(watcher, 10)

    event = asyncio.run(scenario())
    assert event.payload["diagnosis"]["failure_kind"] == "CHECKPOINT_INCOMPATIBLE"


def test_failure_kind_filter_ignores_other_failures(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.finish_run(ticket.run_id, status="FAILED", exit_code=1, failure_kind="USER_CODE", message="bug")
    trigger = _trigger(fire_on=["FAILED"], failure_kinds=["CHECKPOINT_INCOMPATIBLE"])

    async def scenario():
        watcher = asyncio.ensure_future(trigger.run().asend(None))
        await asyncio.sleep(1.0)
        assert not watcher.done(), "a USER_CODE failure must not fire the checkpoint sensor"
        watcher.cancel()

    asyncio.run(scenario())


def test_records_below_the_generations_start_are_no_lag(state_store, broker, job_id, topic):
    """A generation that starts from ``latest`` leaves what its topic held unread on purpose; a partition
    that has had no new record since has no stored offset.  Its old records are no lag: the query is
    idle, not STUCK, and an upgrade's verify sees it caught up.  Records above the start are lag."""
    with broker.producer() as producer:
        for partition in range(3):
            for _ in range(5):
                producer.send(topic, value=b"{}", partition=partition)
    state_store.ensure_generation(job_id, 1, "/checkpoints/gen-1",
                                  kafka_offsets.to_spark_json({(topic, p): 5 for p in range(3)}))
    ticket = state_store.begin_run(job_id, 1, "1.0")
    state_store.mark_query_started(ticket.run_id)
    state_store._update_run(ticket.run_id, query_started_at=time.time() - 60)
    with broker.producer() as producer:  # two new records, in partition 0 only
        for _ in range(2):
            producer.send(topic, value=b"{}", partition=0)
    probe = HealthProbe.connect(job_id, [topic], "stream_state_default", "stream_kafka_default",
                                Thresholds(stuck_after_s=5))
    state_store.heartbeat(ticket.run_id)
    waiting = probe.check()
    assert (waiting.health, waiting.lag) == (Health.STUCK, 2), waiting  # the new records wait

    with state_store.engine.begin() as conn:  # a batch applied them
        conn.execute(schema.offsets.insert().values(job_id=job_id, topic=topic, partition=0, next_offset=7,
                                                    generation=1, batch_id=0))
    state_store.heartbeat(ticket.run_id)
    idle = probe.check()
    assert (idle.health, idle.lag) == (Health.HEALTHY, 0), idle
    assert caught_up(probe.state, probe.kafka, job_id, [topic])


def _stopped_by_a_restart(store, *, killed: bool = False) -> str:
    """A STUCK run whose restart stopped it, then launched nothing (its launch failed, its task was lost):
    STOPPED when the stop ended cleanly, DEAD when the driver had to be killed."""
    ticket = store.begin_run("job", 1, "1.0")
    store.mark_query_started(ticket.run_id)
    store.record_restart("job", "restart", "STUCK: no batch for 600s", ticket.run_id, None)
    store.request_stop(ticket.run_id)
    store.finish_run(ticket.run_id, status="DEAD" if killed else "STOPPED", exit_code=None if killed else 0,
                     message="killed after the stop timeout" if killed else "stopped")
    return ticket.run_id


def test_a_run_a_restart_stopped_and_left_down_fires_the_health_sensor(state_store):
    """A DAG author's own health DAG (sensor >> recover) must finish such a restart as ``stream_health``
    does: by its health the run is only STOPPED, which used to keep the sensor waiting for ever."""
    run_id = _stopped_by_a_restart(state_store)
    event = asyncio.run(asyncio.wait_for(_trigger().run().asend(None), 10))
    found = event.payload["diagnosis"]
    assert (event.payload["status"], found["health"], found["run_id"]) == ("fired", "STOPPED", run_id), event
    assert found["interrupted_restart"]["reason"] == "STUCK: no batch for 600s", found

    only_health = _trigger(fire_on=["DEAD", "STUCK", "FAILED"])  # waits for health values alone, as it asked
    assert not only_health.matches(HealthProbe.connect("job", ["events"], "stream_state_default",
                                                       "stream_kafka_default", Thresholds(5, 300)).check())


def test_a_dead_run_owed_a_restart_fires_on_either_condition(state_store):
    _stopped_by_a_restart(state_store, killed=True)
    probe = HealthProbe.connect("job", ["events"], "stream_state_default", "stream_kafka_default", Thresholds(5, 300))
    found = probe.check()
    assert found.health == Health.DEAD and found.restart_owed, found
    assert found.conditions == ("INTERRUPTED_RESTART", "DEAD")
    assert _trigger(fire_on=["DEAD"]).matches(found)
    assert _trigger(fire_on=["INTERRUPTED_RESTART"]).matches(found)
    assert not _trigger(fire_on=["FAILED"], failure_kinds=["CHECKPOINT_INCOMPATIBLE"]).matches(found)
    # failure kinds name failures and nothing else, whatever fire_on holds besides FAILED
    assert not _trigger(failure_kinds=["CHECKPOINT_INCOMPATIBLE"]).matches(found)
    probe.close()


def test_a_stuck_run_whose_restart_s_task_ended_before_its_stop_is_owed_it(state_store, monkeypatch):
    """A STUCK run's recovery began the restart, then its task ended before its stop ended the run: the
    sensors and the recovery's own diagnosis (``HealthProbe``) see it owed, as the watcher does, once Airflow
    says that task has ended; no upgrade left it so, and none is looked up.  Airflow's answer comes through
    the task's own instance, which does not run here: a stand-in gives it (``health.task_ended``)."""
    task = "stream_health/asset_triggered__1/recover/-1"
    ended: dict[str, bool] = {}
    monkeypatch.setattr(health, "task_ended", lambda owner, log: ended[owner])
    # Its driver: this process, alive on this host, and silent past stuck_after
    run_id = state_store.begin_run("job", 1, "1.0", host=local_driver.this_host(), pid=os.getpid()).run_id
    state_store.mark_query_started(run_id)
    state_store._update_run(run_id, heartbeat_at=time.time() - 60)
    state_store.record_restart("job", "restart", "STUCK: silent for 60s", run_id, None, task)
    probe = HealthProbe.connect("job", ["events"], "stream_state_default", "stream_kafka_default", Thresholds(5, 10))
    probe.upgrades.leaving_down = None  # not called for a STUCK run: an upgrade's stop ends the run it stops
    try:
        ended[task] = False
        found = probe.check()
        assert found.health == Health.STUCK and not found.restart_owed, found
        ended[task] = True
        found = probe.check()
        assert found.health == Health.STUCK and found.restart_owed, found
        assert found.interrupted_restart["failed_run_id"] == run_id
        assert found.conditions == ("INTERRUPTED_RESTART", "STUCK")
    finally:
        probe.close()


def test_a_misspelt_condition_fails_when_the_dag_is_parsed():
    from airflow_stream_provider.sensors.health import CheckpointIncompatibilitySensor, StreamHealthSensor

    with pytest.raises(ValueError, match=r"fire_on \['DIED'\] are not conditions.*'DEAD'"):
        StreamHealthSensor(task_id="health", job_id="job", topics=["events"], fire_on=["DEAD", "DIED"])
    with pytest.raises(ValueError, match="INTERRUPTED_RESTART"):
        _trigger(fire_on=["interrupted_restart"])
    with pytest.raises(ValueError, match=r"fire_on='FAILED' must be a list of conditions, e.g. \['FAILED'\]"):
        _trigger(fire_on="FAILED")
    assert CheckpointIncompatibilitySensor(task_id="checkpoint", job_id="job", topics=["events"]).fire_on == ("FAILED",)


@pytest.mark.parametrize(("arguments", "message"), [
    ({"fire_on": ["FAILED"], "failure_kinds": ["POISN"]}, r"failure_kinds \['POISN'\] are not kinds of failure.*'POISON'"),
    ({"fire_on": ["DEAD"], "failure_kinds": ["POISON"]}, "leaves out FAILED"),
    ({"stuck_after": 0}, r"stuck_after=0: give a number of seconds above 0"),
    ({"heartbeat_timeout": float("nan")}, "heartbeat_timeout=nan"),
    ({"topics": "events"}, r"topics='events' must be a list of topics"),
])
def test_a_sensor_that_would_wait_on_nothing_fails_when_the_dag_is_parsed(arguments, message):
    """Each of these waited for ever, or fired on every healthy run: a kind no run has, a kind of failure
    without FAILED, a threshold of 0, or the topics as one string (its letters: no lag)."""
    from airflow_stream_provider.sensors.health import StreamHealthSensor

    with pytest.raises(ValueError, match=message):
        StreamHealthSensor(task_id="health", job_id="job", **{"topics": ["events"], **arguments})
    StreamHealthSensor(task_id="templated", job_id="job", topics="{{ var.json.spec.kafka.topics }}",
                       stuck_after="{{ params.stuck_after }}")  # checked once rendered, when used


def test_a_failing_check_is_tried_again_until_it_has_failed_too_long(state_store, monkeypatch):
    """A blip of the state database (what a run's wait rides out, ``waits.DATABASE_OUTAGE``) must not end a
    sensor's watch: the check is tried again; only one that keeps failing ends it, saying for how long and
    which connections to look at, and any other error ends it at once.  The failures are a stand-in: a real
    database cannot be made to fail for exactly one query."""
    from airflow_stream_provider.triggers import health

    run_id = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(run_id)
    state_store._update_run(run_id, heartbeat_at=time.time() - 60)
    real_check = HealthProbe.check
    failures = iter([_outage("server closed the connection unexpectedly")] * 2)

    def flaky(probe):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real_check(probe)

    monkeypatch.setattr(HealthProbe, "check", flaky)
    event = asyncio.run(asyncio.wait_for(_trigger().run().asend(None), 10))
    assert (event.payload["status"], event.payload["diagnosis"]["health"]) == ("fired", "DEAD"), event

    monkeypatch.setattr(health, "OUTAGE_LIMIT_S", 0.5)
    monkeypatch.setattr(HealthProbe, "check", lambda probe: (_ for _ in ()).throw(_outage("refused")))
    event = asyncio.run(asyncio.wait_for(_trigger().run().asend(None), 10))
    assert event.payload["status"] == "error", event
    assert event.payload["message"].startswith("health check of job job has failed for "), event
    assert "'stream_state_default', 'stream_kafka_default'" in event.payload["message"]

    monkeypatch.setattr(health, "OUTAGE_LIMIT_S", 600)
    monkeypatch.setattr(HealthProbe, "check", lambda probe: (_ for _ in ()).throw(ValueError("a bug")))
    event = asyncio.run(asyncio.wait_for(_trigger().run().asend(None), 10))
    assert event.payload["status"] == "error", event
    assert event.payload["message"].startswith("health check of job job failed: ValueError('a bug'). The job "
                                               "itself is untouched"), event
    assert "'stream_state_default' and 'stream_kafka_default'" in event.payload["message"], event


def _outage(message: str) -> OperationalError:
    return OperationalError("SELECT 1", {}, ConnectionError(message))
