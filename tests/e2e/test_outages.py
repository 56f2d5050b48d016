"""Outages of what a stream job depends on, each followed by the provider's recovery, with exact counts.

* The broker: a Kafka-protocol proxy (Tansu's own ``proxy`` command) stands between the job and the
  session broker; the job's Kafka connection names the proxy, the test's producer writes to the broker
  itself, so killing the proxy cuts the job off while every record stays in Kafka.
* The database: a PostgreSQL server of the test's own holds the job's state and results, and crashes
  (``pg_ctl stop -m immediate``) while a batch's transaction is half written.

What a user expects, and what is checked: a broker outage of some seconds does not even end the driver
(kafka-python retries), nor does a broker that stops answering for longer than one request's timeout
(the source asks again, as Spark's own Kafka source does); a longer outage ends the run FAILED/TRANSIENT
once the client gives up, and the health DAG restarts it from the checkpoint when the broker is back.
A database crash in the middle of a batch loses that whole transaction and nothing else: results,
ledger and offsets stay consistent, the driver fails at once (it classifies TRANSIENT), records that
when the database is back, exits 6, and the health DAG restarts it.  Nothing is lost or applied twice.

The broker test also checks, while its first driver runs, that a second submit follows the declared
``if_running`` policy (the default, ``fail``) through a real DAG run.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from airflow_stream_provider import failures, local_driver
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import ACTIVE_STATUSES
from stack.events import EventProducer, Produced, Trickle
from stack.jobs import check_exactly_once, wait_until
from stack.outages import KafkaProxy, PostgresServer
from tests.dags import provider_scenarios as dags
from tests.dagtest import airflow as airflow_stack
from tests.dagtest.dagruns import caught_up, deployed, run_dag, runs

#: The job's Kafka request timeout, named in its spec's client options in Kafka's own spelling and as
#: text (a spec is JSON), so that every Kafka call of the driver must take it converted.  Shorter than
#: kafka-python's default (30 s), as a job that wants to notice an outage sooner sets it: the offset
#: planning gives up after two such timeouts.  A read cut by the outage ends after Spark's four attempts,
#: each bounded by it: the first stalls for one request timeout, a retry whose consumer must connect again
#: waits as long to bootstrap.
REQUEST_TIMEOUT_MS = 12_000
#: Shorter than every kafka-python client timeout the job uses.
SHORT_BROKER_OUTAGE_S = 6.0
#: Longer than one kafka-python request's timeout, shorter than two, with seconds of margin each way: the
#: idle driver's first planning request goes out within a trigger interval of the stall's start.
BROKER_STALL_S = 18.0
DATABASE_OUTAGE_S = 10.0


@pytest.fixture
def proxy(stream, broker, monkeypatch):
    """The job (drivers and the Airflow side) reaches the broker only through this proxy."""
    instance = KafkaProxy(broker.bootstrap, stream["tmp"] / "kafka-proxy.log").start()
    monkeypatch.setenv(*airflow_stack.connection_env("stream_kafka_default", conn_type="stream_kafka",
                                                     host="127.0.0.1", port=instance.port))
    yield instance
    instance.stop()


@pytest.fixture
def own_postgres(stream, monkeypatch):
    """The job's state and results on a PostgreSQL server this test may crash; its own state hook."""
    server = PostgresServer().init()
    stream["state"].store  # noqa: B018 - bind the fixture's own hook to its SQLite file before the switch
    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_default", conn_type="stream_state",
                                                     extra={"url": server.url}))
    state = StreamStateHook()
    yield server, state
    try:  # the drivers' run rows live in this server, not in the ``stream`` fixture's SQLite file
        if not server.running():
            server.start()
        for run in runs(state, stream["job_id"]):
            if run.pid:
                local_driver.signal_group(run.pid, signal.SIGKILL)
    finally:
        state.store.dispose()
        server.destroy()


def _alive(run: dict) -> bool:
    return run.status in ACTIVE_STATUSES and local_driver.process_alive(run.pid)


def test_broker_outage_short_is_ridden_out_long_ends_transient_and_is_recovered(stream, broker, proxy, figures,
                                                                                 capfd):
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    kafka = {**params["spec"]["kafka"], "client_options": {"request.timeout.ms": str(REQUEST_TIMEOUT_MS)}}
    params = {**params, "spec": {**params["spec"], "kafka": kafka}}
    producer = EventProducer(broker, stream["topic"])
    producer.send(1500)
    first = deployed(dags.deploy, params, state, job_id, producer)

    # A second submit of the running job follows the declared policy, the default if_running="fail": the
    # task fails naming the live run, and that run goes on undisturbed.
    capfd.readouterr()
    status, tasks = run_dag(dags.deploy, params)
    assert status == "failed" and tasks["submit"][0] == "failed", tasks
    assert f"already runs (run {first['run_id']}" in capfd.readouterr().out
    assert [r.run_id for r in runs(state, job_id)] == [first["run_id"]]

    # Some seconds without the broker: the clients retry, the driver lives on and catches up.
    with Trickle(producer, chunk=20, pause_s=0.5):
        time.sleep(2)
        proxy.stop()
        time.sleep(SHORT_BROKER_OUTAGE_S)
        proxy.start()
        time.sleep(2)
    caught_up(state, job_id, producer)
    assert [r.run_id for r in runs(state, job_id)] == [first["run_id"]]
    assert _alive(state.store.get_run(first["run_id"])), "a short broker outage must not end the driver"

    # A broker that answers nothing for longer than a request's timeout (a long pause of its own; a pause
    # of the driver's process is the same to the client): the offset planning that waited times out once
    # and asks again, and the answer comes when the broker does.  The driver is caught up, so no read is
    # cut; it goes on without a restart.
    time.sleep(3)  # the last batch's consumer-group commit is done: an idle driver only plans
    proxy.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(BROKER_STALL_S)
    finally:
        proxy.process.send_signal(signal.SIGCONT)
    producer.send(200)
    caught_up(state, job_id, producer)
    assert _alive(state.store.get_run(first["run_id"])), "one request timed out must not end the driver"
    log = Path(first["log_path"]).read_text(errors="replace")
    assert f"reading the offsets of {stream['topic']} timed out" in log, "the stall must have expired a request"
    assert [r.run_id for r in runs(state, job_id)] == [first["run_id"]]

    # A long outage: once the client gives up the query fails, and the driver records why.  Usually the
    # driver's offset planning gives up first (after two request timeouts); an outage that cuts a running
    # read ends after Spark's task retries (about 50 s: see REQUEST_TIMEOUT_MS).
    with Trickle(producer, chunk=20, pause_s=0.5):
        time.sleep(2)
        proxy.stop()
        down = time.monotonic()
        ended = wait_until(lambda: (r := state.store.get_run(first["run_id"])).status not in ACTIVE_STATUSES
                           and r, 300, "the driver to give up on the broker")
        gave_up_s = time.monotonic() - down
    assert (ended.status, ended.failure_kind, ended.exit_code) == (
        "FAILED", "TRANSIENT", failures.EXIT_TRANSIENT), ended
    assert failures.classify(ended.termination_message).signature == "kafka-unreachable"
    wait_until(lambda: not local_driver.process_alive(first["pid"]), 60, "the failed driver to exit")

    # The broker is back: the health DAG sees the TRANSIENT failure and restarts from the checkpoint.
    proxy.start()
    back = time.monotonic()
    recovered_s, counts = _restarted_by_health_dag(state, job_id, params, producer, first["run_id"], back,
                                                     more=300)
    figures.record("broker outage", request_timeout_ms=REQUEST_TIMEOUT_MS,
                   short_outage_seconds=SHORT_BROKER_OUTAGE_S, driver_survived=True, stall_seconds=BROKER_STALL_S,
                   long_outage_to_transient_seconds=round(gave_up_s, 1),
                   back_to_caught_up_seconds=round(recovered_s, 1), **counts)


def _sink_waiting(dsn: str) -> dict | None:
    """The sink's backend when it waits for a lock inside its transaction, with the tables it has written."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND query LIKE 'INSERT INTO stream_offsets%%'").fetchone()
        if row is None:
            return None
        written = conn.execute("SELECT DISTINCT relation::regclass::text FROM pg_locks WHERE pid = %s "
                               "AND mode = 'RowExclusiveLock' AND relation IS NOT NULL", (row[0],)).fetchall()
        return {"pid": row[0], "written": {name for (name,) in written}}


def _snapshot(produced: Produced) -> Produced:
    with produced.lock:
        return Produced(produced.topic, dict(produced.events), dict(produced.malformed),
                        Counter(produced.end_offsets))


def test_database_crash_mid_batch_keeps_results_and_offsets_consistent(stream, broker, own_postgres, figures):
    server, state = own_postgres
    job_id, params = stream["job_id"], stream["params"]
    producer = EventProducer(broker, stream["topic"])
    producer.send(1200)
    first = deployed(dags.deploy, params, state, job_id, producer)
    applied = _snapshot(producer.produced)

    # Hold the job's offset rows: the next batch's transaction writes its results, dead letters and
    # ledger rows, then waits for them in its last statement (the offsets upsert).  The server dies then.
    blocker = psycopg.connect(server.dsn)
    try:
        blocker.execute("SELECT 1 FROM stream_offsets WHERE job_id = %s FOR UPDATE", (job_id,))
        producer.send(600)
        sink = wait_until(lambda: _sink_waiting(server.dsn), 120, "the sink to wait inside its transaction")
        assert {"events", "kpi_minute", schema.batches.name} <= sink["written"], sink
        server.crash()
        down = time.monotonic()
    finally:
        blocker.close()

    # The driver does not hang: its commit fails and it classifies the failure TRANSIENT.  It keeps trying
    # to record that in the database it lost (for a bounded time) before it exits 6.
    log_path = Path(first["log_path"])
    wait_until(lambda: f"could not record the end of run {first['run_id']} yet" in log_path.read_text(
        errors="replace"), 120, "the driver to fail TRANSIENT and retry recording it")
    driver_failed_s = time.monotonic() - down

    # While the database is down the provider takes no action: the health check fails, naming it.
    status, tasks = run_dag(dags.health, params)
    assert status == "failed" and tasks["health"][0] == "failed" and tasks["recover"][0] == "upstream_failed"

    time.sleep(max(0.0, DATABASE_OUTAGE_S - (time.monotonic() - down)))
    server.start()
    back = time.monotonic()
    wait_until(lambda: not local_driver.process_alive(first["pid"]), 120, "the driver to end")
    log = log_path.read_text(errors="replace")
    assert f"run {first['run_id']} ended: exit {failures.EXIT_TRANSIENT} (TRANSIENT)" in log, log[-3000:]
    # Crash recovery rolled the half-written batch back as one: results, dead letters, ledger and offsets
    # are exactly those of the records applied before it.
    before = check_exactly_once(state.store, job_id, applied)

    # The run's end reached the database once it was back: the health DAG restarts it from the checkpoint.
    recovered_s, counts = _restarted_by_health_dag(state, job_id, params, producer, first["run_id"], back,
                                                     more=400)
    figures.record("database crash mid-batch", outage_seconds=DATABASE_OUTAGE_S,
                   driver_failed_after_seconds=round(driver_failed_s, 1),
                   read_before_crash=before["read"], back_to_caught_up_seconds=round(recovered_s, 1), **counts)


def _restarted_by_health_dag(state, job_id: str, params: dict, producer, failed_run_id: str, back: float, *,
                             more: int):
    """The health DAG finds the run FAILED/TRANSIENT and restarts it from the checkpoint; with ``more``
    events the job catches up and stops cleanly, exactly once.  ``state`` is the hook on the job's state
    database.  Returns (seconds from ``back`` to caught up, the exact counts)."""
    status, tasks = run_dag(dags.health, params)
    assert status == "success", tasks
    found, recovered = tasks["health"][1], tasks["recover"][1]
    assert (found["health"], found["failure_kind"], found["run_id"]) == ("FAILED", "TRANSIENT", failed_run_id)
    assert recovered["action"] == "restart" and recovered["generation"] == 1, recovered
    producer.send(more)
    caught_up(state, job_id, producer)
    recovered_s = time.monotonic() - back
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(state.store, job_id, producer.produced)
    assert counts["read"] == producer.sent
    return recovered_s, counts
