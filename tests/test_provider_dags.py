"""The Airflow side end to end: real DAGs run by real Airflow (``dag.test()``) against real drivers, a real
broker and a real state database.

The state database is SQLite here: the Airflow side reads it through the same SQLAlchemy code as
PostgreSQL, which the runtime tests cover with real drivers.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from pathlib import Path

import pytest
from airflow.sdk import DAG, task

from airflow_stream_provider import failures
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.reset import ResetStreamingJobOperator
from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from airflow_stream_provider.sensors.health import CheckpointIncompatibilitySensor, StreamHealthSensor
from airflow_stream_provider.triggers.health import StreamHealthTrigger
from tests.stack import airflow as airflow_stack
from tests.stack.events import EventProducer
from tests.stack.jobs import (
    EVENTS_JOB,
    REPO,
    TEST_SPARK_CONF,
    check_exactly_once,
    spark_env,
    wait_until,
)

FIXTURE_JOBS = REPO / "tests" / "fixtures" / "jobs"
RESULTS: dict[str, object] = {}


# -- instrumentation: observe that the sensor really deferred, and when its trigger fired -----------------
TRIGGER_STARTED = threading.Event()
TRIGGER_FIRED_AT: list[float] = []


class ObservedHealthTrigger(StreamHealthTrigger):
    async def run(self):
        TRIGGER_STARTED.set()
        async for event in super().run():
            TRIGGER_FIRED_AT.append(time.time())
            yield event


class ObservedHealthSensor(StreamHealthSensor):
    trigger_class = ObservedHealthTrigger


@task
def capture(key: str, value):
    RESULTS[key] = value


# -- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture
def stream(airflow_db, broker, topic, job_id, tmp_path, monkeypatch):
    """Connections for one job, and the operator arguments every DAG of the job shares."""
    db_path = tmp_path / "state.db"
    for conn_id, fields in {
        "stream_state_default": {"conn_type": "stream_state", "extra": {"url": f"sqlite:///{db_path}"}},
        "stream_kafka_default": {"conn_type": "stream_kafka", "host": "127.0.0.1", "port": broker.port},
        "spark_default": {"conn_type": "spark", "host": "local[2]",
                          "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}},
    }.items():
        monkeypatch.setenv(*airflow_stack.connection_env(conn_id, **fields))
    env = spark_env()
    monkeypatch.setenv("PATH", env["PATH"])  # spark-submit of the driver environment
    TRIGGER_STARTED.clear()
    TRIGGER_FIRED_AT.clear()
    RESULTS.clear()
    spec = {"job_id": job_id, "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "trigger_interval": "500 milliseconds", "heartbeat_seconds": 1.0,
            "kafka": {"topics": [topic], "source": "python", "max_offsets_per_trigger": 1500}}
    common = {"spec": spec, "application": EVENTS_JOB, "conf": TEST_SPARK_CONF, "ready_timeout": 240,
              "env_vars": {k: env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP")},
              "driver_log_dir": str(tmp_path / "driver-logs"), "heartbeat_timeout": 15, "stop_timeout": 90}
    from airflow_stream_provider.hooks.state import StreamStateHook

    state = StreamStateHook()
    yield {"spec": spec, "common": common, "job_id": job_id, "topic": topic, "state": state, "tmp": tmp_path}
    for run in _runs(state, job_id):
        if run["pid"]:
            from airflow_stream_provider.hooks.driver import StreamDriverHook

            StreamDriverHook._signal(run, 9)
    state.store.dispose()


def _runs(state, job_id):
    from sqlalchemy import select

    from airflow_stream_provider.state import schema

    with state.store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(schema.runs).where(schema.runs.c.job_id == job_id)).mappings()]


def _dag(name: str) -> DAG:
    return DAG(f"{name}_{uuid.uuid4().hex[:6]}", schedule=None, start_date=dt.datetime(2026, 1, 1),
               catchup=False)


def _run(dag: DAG):
    dag_run = dag.test()
    return dag_run, {ti.task_id: ti for ti in dag_run.get_task_instances()}


def _caught_up(state, job_id, producer, timeout=240):
    wait_until(lambda: {p: o for (_, p), o in state.stored_offsets(job_id).items()}
               == dict(producer.produced.end_offsets), timeout, "the job to catch up",
               on_timeout=lambda: f"stored {state.stored_offsets(job_id)} vs {dict(producer.produced.end_offsets)}")


# -- scenarios -------------------------------------------------------------------------------------------
def test_kill9_is_detected_by_a_deferred_sensor_and_recovered(stream, broker, figures):
    state, job_id = stream["state"], stream["job_id"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(2000)

    with _dag("deploy") as deploy:
        capture("submit", SubmitStreamingJobOperator(task_id="submit", **stream["common"]).output)
    dag_run, tis = _run(deploy)
    assert dag_run.state == "success", tis
    first = RESULTS["submit"]
    assert first["action"] == "submitted" and first["generation"] == 1 and first["epoch"] == 1

    # The sensor defers (the job is healthy); once its trigger polls, the driver is killed with SIGKILL.
    killed_at: list[float] = []

    def kill_when_watched():
        assert TRIGGER_STARTED.wait(300)
        run = state.store.get_run(first["run_id"])
        from airflow_stream_provider.hooks.driver import StreamDriverHook

        killed_at.append(time.time())
        StreamDriverHook._signal(run, 9)

    killer = threading.Thread(target=kill_when_watched, daemon=True)
    killer.start()
    with _dag("health") as health:
        sensor = ObservedHealthSensor(task_id="health", job_id=job_id, topics=[stream["topic"]],
                                      poke_interval=1, heartbeat_timeout=15, timeout=600)
        recover = RecoverStreamingJobOperator(task_id="recover", **stream["common"], backoff_base=0)
        capture("diagnosis", sensor.output)
        capture("recover", recover.output)
        sensor >> recover
    dag_run, tis = _run(health)
    killer.join(10)
    assert dag_run.state == "success", tis
    assert TRIGGER_STARTED.is_set() and killed_at and TRIGGER_FIRED_AT, "the sensor did not defer"
    detection_s = TRIGGER_FIRED_AT[0] - killed_at[0]
    assert RESULTS["diagnosis"]["health"] == "DEAD" and RESULTS["diagnosis"]["run_id"] == first["run_id"]
    assert RESULTS["recover"]["action"] == "restart" and RESULTS["recover"]["generation"] == 1
    recovered_at = state.store.get_run(RESULTS["recover"]["run_id"])["query_started_at"]

    producer.send(800)
    _caught_up(state, job_id, producer)

    with _dag("stop") as stop:
        capture("stop", StopStreamingJobOperator(task_id="stop", **stream["common"]).output)
    dag_run, _ = _run(stop)
    assert dag_run.state == "success"
    assert RESULTS["stop"]["outcome"] == "stopped" and RESULTS["stop"]["exit_code"] == failures.EXIT_STOPPED
    dag_run, _ = _run(stop)  # a second stop is a no-op that says so
    assert dag_run.state == "success" and RESULTS["stop"]["outcome"] == "not running"

    counts = check_exactly_once(state.store, job_id, producer.produced)
    figures.record("airflow kill -9 -> DEAD", detection_seconds=round(detection_s, 2),
                   kill_to_recovered_query_seconds=round(recovered_at - killed_at[0], 1), **counts)


def test_incompatible_checkpoint_is_reset_from_stored_offsets(stream, broker, figures):
    state, job_id = stream["state"], stream["job_id"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(1500)
    with _dag("deploy") as deploy:
        SubmitStreamingJobOperator(task_id="submit", **stream["common"])
    assert _run(deploy)[0].state == "success"
    _caught_up(state, job_id, producer)

    # Version 2 adds a stateful operator: Spark cannot run it on version 1's checkpoint.
    upgraded = {**stream["common"], "application": str(FIXTURE_JOBS / "events_with_dedup.py"),
                "spec": {**stream["spec"], "version": "2.0"}}
    with _dag("deploy_v2") as deploy_v2:
        SubmitStreamingJobOperator(task_id="submit", if_running="replace", **upgraded)
    producer.send(500)  # the incompatibility shows only when a batch with data runs
    _run(deploy_v2)  # may succeed (query starts) or fail (query fails at once): the sensor decides

    with _dag("incompatible") as incompatible:
        sensor = CheckpointIncompatibilitySensor(task_id="checkpoint", job_id=job_id, topics=[stream["topic"]],
                                                 poke_interval=1, timeout=300)
        reset = ResetStreamingJobOperator(task_id="reset", reason="upgrade to 2.0", **upgraded)
        capture("diagnosis", sensor.output)
        capture("reset", reset.output)
        sensor >> reset
    dag_run, tis = _run(incompatible)
    assert dag_run.state == "success", tis
    found = RESULTS["diagnosis"]
    assert found["failure_kind"] == "CHECKPOINT_INCOMPATIBLE", found
    assert found["error_class"] == "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY", found
    reset_result = RESULTS["reset"]
    assert reset_result["generation"] == 2 and reset_result["archived_generation"] == 1
    archive = Path(reset_result["archive_path"])
    assert archive.is_dir() and (archive / "offsets").is_dir(), "generation 1 must be archived, not deleted"
    assert not (Path(stream["spec"]["checkpoint_root"]) / job_id / "gen-1").exists()

    producer.send(700)
    _caught_up(state, job_id, producer)
    with _dag("stop") as stop:
        StopStreamingJobOperator(task_id="stop", **upgraded)
    assert _run(stop)[0].state == "success"
    counts = check_exactly_once(state.store, job_id, producer.produced)
    figures.record("airflow incompatible checkpoint -> reset", archive=archive.name, **counts)


def test_crash_loop_ends_at_the_restart_budget(stream, broker):
    state, job_id = stream["state"], stream["job_id"]
    EventProducer(broker, stream["topic"]).send(200)
    crashing = {**stream["common"], "application": str(FIXTURE_JOBS / "crash_on_batch.py")}
    with _dag("deploy") as deploy:
        SubmitStreamingJobOperator(task_id="submit", **crashing)
    _run(deploy)
    messages = []
    for _ in range(3):
        with _dag("health") as health:
            sensor = StreamHealthSensor(task_id="health", job_id=job_id, topics=[stream["topic"]], poke_interval=1,
                                        timeout=300)
            sensor >> RecoverStreamingJobOperator(task_id="recover", max_restarts=2, backoff_base=0.2,
                                                  **crashing)
        dag_run, tis = _run(health)
        messages.append((dag_run.state, tis["recover"].state))
        if tis["recover"].state == "failed":
            break
    assert [m[1] for m in messages] == ["success", "success", "failed"], messages
    assert len(state.restarts_since(job_id, 0)) == 2
    last = state.latest_run(job_id)
    assert last["failure_kind"] == "USER_CODE" and "simulated bug" in last["termination_message"]


def test_stuck_query_is_reported_stuck(stream, broker):
    state, job_id = stream["state"], stream["job_id"]
    EventProducer(broker, stream["topic"]).send(300)
    stuck = {**stream["common"], "application": str(FIXTURE_JOBS / "stuck_on_batch.py")}
    with _dag("deploy") as deploy:
        SubmitStreamingJobOperator(task_id="submit", **stuck)
    assert _run(deploy)[0].state == "success"
    with _dag("health") as health:
        capture("diagnosis", StreamHealthSensor(task_id="health", job_id=job_id, topics=[stream["topic"]],
                                                poke_interval=1, stuck_after=8, timeout=300).output)
    dag_run, tis = _run(health)
    assert dag_run.state == "success", tis
    found = RESULTS["diagnosis"]
    assert found["health"] == "STUCK" and found["lag"] == 300, found
    run = state.latest_run(job_id)
    assert run["status"] == "RUNNING" and run["last_batch_id"] is None
