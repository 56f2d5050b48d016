"""Bad input end to end: every kind of record the example job cannot use lands in the dead letters with
its position, its raw bytes and a reason that says what is wrong, in the same transaction as the good
rows of its batch; and a record that makes the job's own code fail is isolated and dead-lettered, or,
when even that is impossible, stops the job as POISON with its exact topic/partition/offset, which the
provider's diagnosis reports and its recovery refuses to paper over.

Counts are exact: good + dead == read, every produced record accounted for once.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import time
from dataclasses import replace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from sqlalchemy import select, text

from airflow_stream_provider import failures
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.state import schema
from stack.events import EventProducer
from stack.jobs import wait_until
from tests.dags import provider_scenarios as dags
from tests.dagtest.dagruns import FIXTURE_JOBS, caught_up, run_dag

BASE_TS = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)
MAX_VALUE_BYTES = 16_384  # the test job's configured limit (the example job's default is 64 KiB)


def _event(n: int, **changes) -> dict:
    event = {"event_id": f"b-{n}", "user_id": f"u-{n % 13}", "kind": "view", "amount": round(n * 0.37, 2),
             "ts": (BASE_TS + dt.timedelta(seconds=n)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    for name, value in changes.items():
        if value is ...:
            del event[name]
        else:
            event[name] = value
    return event


def _json(n: int, **changes) -> bytes:
    return json.dumps(_event(n, **changes)).encode()


#: (what, Kafka key, value, a fragment the dead letter's reason must contain)
BAD_RECORDS = [
    ("malformed JSON", b"k", b'{"event_id": "m-1", "user_id": ', "malformed JSON"),
    ("duplicate key", b"k", b'{"event_id": "d-1", "event_id": "d-2", "user_id": "u", "kind": "k", "amount": 1, '
                            b'"ts": "2026-11-22T10:00:00Z"}', "a key appears twice"),
    ("JSON array", None, b"[1, 2, 3]", "JSON value is an array, not an object"),
    ("JSON number", None, b"42", "JSON value is a number, not an object"),
    ("JSON string", b"k", b'"an event"', "JSON value is a string, not an object"),
    ("JSON null", b"k", b"null", "JSON value is null, not an object"),
    ("empty value", b"k", b"", "empty value"),
    ("tombstone", b"u-1", None, "null value (a tombstone)"),
    ("binary garbage", None, b"\xff\xfe\x00binary garbage", "not UTF-8"),
    ("gzip instead of JSON", b"k", gzip.compress(_json(1)), "not UTF-8"),
    ("amount as text", b"k", _json(2, amount="lots"), "amount must be a JSON number, got a string"),
    ("amount as boolean", b"k", _json(3, amount=True), "amount must be a JSON number, got a boolean"),
    ("event_id as number", b"k", _json(4, event_id=17), "event_id must be a JSON string, got a number"),
    ("user_id as object", None, _json(5, user_id={"id": 5}), "user_id must be a JSON string, got an object"),
    ("ts as number", b"k", _json(6, ts=1795348800), "ts must be a JSON string, got a number"),
    ("ts not a timestamp", b"k", _json(7, ts="yesterday"), "ts 'yesterday' is not an ISO-8601 timestamp"),
    ("event_id missing", b"k", _json(8, event_id=...), "missing event_id"),
    ("user_id null", b"k", _json(9, user_id=None), "missing user_id"),
    ("event_id empty", b"k", _json(10, event_id=""), "empty event_id"),
    ("kind with NUL", b"k", _json(11, kind="vi\u0000ew"), "kind contains a NUL character"),
    ("amount overflows cents", b"k", _json(12, amount=1e300), "amount 1.0E300 is out of range"),
    ("event_id too long for a key", b"k", _json(13, event_id="x" * 5000),
     "event_id is 5000 characters, over the limit of 200"),
    ("value over the size limit", b"k", _json(14, note="y" * 20_000),
     f"over the limit of {MAX_VALUE_BYTES} bytes (spark.stream.events.maxValueBytes)"),
]


class Feed:
    """Sends exact records and remembers what Kafka acknowledged for each (partition, offset)."""

    def __init__(self, broker, topic: str):
        self.topic = topic
        self.events = EventProducer(broker, topic, malformed_ratio=0.0)  # keyed good events
        self.bad: dict[tuple[int, int], tuple[bytes | None, bytes | None, str]] = {}
        self.unkeyed: set[str] = set()

    @property
    def produced(self):
        return self.events.produced

    def send(self, key: bytes | None, value: bytes | None) -> tuple[int, int]:
        return self.events.send_record(value, key)

    def good(self, event: dict, key: bytes | None = None) -> None:
        self.send(key, json.dumps(event).encode())
        self.produced.events[event["event_id"]] = event
        if key is None:
            self.unkeyed.add(event["event_id"])

    def bad_record(self, key: bytes | None, value: bytes | None, reason: str) -> tuple[int, int]:
        position = self.send(key, value)
        self.bad[position] = (key, value, reason)
        return position

    @property
    def total(self) -> int:
        return len(self.produced.events) + len(self.bad)


def _check(store, job_id: str, feed: Feed) -> dict[str, int]:
    """Every good event applied once, every bad record dead-lettered once with its bytes and reason, in the
    transaction of the batch that read it; aggregates equal a recomputation; good + dead == read."""
    with store.engine.connect() as conn:
        events = {r.event_id: r for r in conn.execute(text("SELECT event_id, user_id, kind, amount FROM events"))}
        kpi = {(r.user_id, str(r.minute)[:16].replace(" ", "T")): (r.event_count, r.amount_cents)
               for r in conn.execute(text("SELECT user_id, minute, event_count, amount_cents FROM kpi_minute"))}
        dead = {(r.partition, r.offset): r for r in conn.execute(
            select(schema.dead_letters).where(schema.dead_letters.c.job_id == job_id))}
        ledger = conn.execute(select(schema.batches).where(schema.batches.c.job_id == job_id)).all()
    produced = feed.produced
    assert set(events) == set(produced.events), (
        f"events: missing {sorted(set(produced.events) - set(events))[:5]}, "
        f"unexpected {sorted(set(events) - set(produced.events))[:5]}")
    for event_id, row in events.items():
        wanted = produced.events[event_id]
        assert (row.user_id, row.kind, row.amount) == (wanted["user_id"], wanted["kind"], wanted["amount"])
    assert kpi == produced.kpi_minute()
    assert set(dead) == set(feed.bad), (
        f"dead letters: missing {sorted(set(feed.bad) - set(dead))}, unexpected "
        f"{[(p, dead[p].error) for p in sorted(set(dead) - set(feed.bad))]}")
    for position, (key, value, reason) in feed.bad.items():
        row = dead[position]
        assert row.topic == feed.topic
        assert (None if row.value is None else bytes(row.value)) == value, f"raw bytes changed at {position}"
        assert (None if row.key is None else bytes(row.key)) == key, f"raw key changed at {position}"
        assert reason in row.error, f"{position}: reason {row.error!r} does not say {reason!r}"
    # Each dead letter was written by the transaction of the batch that read it: same generation and
    # batch as the ledger row covering its offset, and that row counts it.
    covering = {}
    for entry in ledger:
        for offset in range(entry.start_offset, entry.end_offset):
            assert (entry.partition, offset) not in covering, f"offset {offset} applied twice"
            covering[(entry.partition, offset)] = entry
    for position, row in dead.items():
        entry = covering[position]
        assert (row.generation, row.batch_id) == (entry.generation, entry.batch_id), position
    for entry in ledger:
        in_batch = sum(1 for (p, o) in dead if p == entry.partition and entry.start_offset <= o < entry.end_offset)
        assert entry.rows_dead == in_batch and entry.rows_applied + entry.rows_dead == entry.rows_read, entry
    read = sum(entry.rows_read for entry in ledger)
    assert read == feed.total and len(events) + len(dead) == read, (read, len(events), len(dead), feed.total)
    assert {p: o for (_, p), o in store.stored_offsets(job_id).items()} == dict(produced.end_offsets)
    return {"read": read, "good": len(events), "dead": len(dead), "batches": len({(e.generation, e.batch_id)
                                                                              for e in ledger})}


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_bad_input_is_dead_lettered_with_its_reason(broker, topic, runner, figures):
    """PostgreSQL: the stricter database (NUL characters, index size limits) for what the results hold."""
    runner.spec = replace(runner.spec, spark_conf={"spark.stream.events.maxValueBytes": str(MAX_VALUE_BYTES)},
                          kafka=replace(runner.spec.kafka, max_offsets_per_trigger=60))
    feed = Feed(broker, topic)
    feed.events.send(150)
    for n, (_, key, value, reason) in enumerate(BAD_RECORDS):
        feed.bad_record(key, value, reason)
        feed.good(_event(1000 + n))  # events without a Kafka key are ordinary events
    feed.good(_event(2000, note="z" * (MAX_VALUE_BYTES - 400)))  # large, under the limit: applied whole
    feed.good(_event(2001, amount=12, kind="x" * 200))  # an integer amount, a kind at the length limit
    driver = runner.start()
    runner.wait_caught_up(dict(feed.produced.end_offsets), driver)
    # more of both while it runs: later batches, same treatment
    feed.events.send(100)
    for _, key, value, reason in BAD_RECORDS[:8]:
        feed.bad_record(key, value, reason)
    runner.wait_caught_up(dict(feed.produced.end_offsets), driver)
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)
    counts = _check(runner.store, runner.spec.job_id, feed)
    assert counts["dead"] == len(BAD_RECORDS) + 8 and counts["batches"] > 3, counts
    assert feed.unkeyed <= set(feed.produced.events)
    figures.record("bad input [postgresql]", kinds=len(BAD_RECORDS), unkeyed_events=len(feed.unkeyed), **counts)


def _with(params: dict, application: str, **env) -> dict:
    return {**params, "application": str(FIXTURE_JOBS / application),
            "env_vars": {**params["env_vars"], **env}}


def _wait_failed(state, job_id: str, run_id: str) -> dict:
    return wait_until(lambda: (run := state.store.get_run(run_id)).status == "FAILED" and run, 240,
                      f"run {run_id} of job {job_id} to fail")


def test_poison_record_is_isolated_or_named_by_position(stream, broker, figures):
    """A record the job's own code fails on: isolated by bisection and dead-lettered with the exception;
    when its dead letter cannot be written (or the job's policy says fail), the run ends POISON with the
    record's exact position, the health DAG reports it, and recovery refuses to restart blindly."""
    state, job_id, topic = stream["state"], stream["job_id"], stream["topic"]
    params = _with(stream["params"], "poison_on_value.py")
    params = {**params, "spec": {**params["spec"], "kafka": {**params["spec"]["kafka"],
                                                             "max_offsets_per_trigger": 120}}}
    feed = Feed(broker, topic)
    started = time.monotonic()

    # 1. dead-letter and go on: the record is found among its batch's records and the batch commits.
    feed.events.send(300)
    first = feed.bad_record(b"u-1", _json(1, kind="POISON-1"), "ValueError: cannot handle record")
    feed.events.send(200)
    status, tasks = run_dag(dags.deploy, params)
    assert status == "success", tasks
    caught_up(state, job_id, feed.events)
    isolated_s = time.monotonic() - started

    # 2. the dead letter of the next one cannot be written (the table refuses it): POISON, exact position.
    with state.store.engine.begin() as conn:
        conn.execute(text("CREATE TRIGGER refuse_poison BEFORE INSERT ON dead_letters "
                          "WHEN CAST(NEW.value AS TEXT) LIKE '%POISON-2%' "
                          "BEGIN SELECT RAISE(ABORT, 'dead letters of this kind are refused'); END"))
    feed.events.send(150)
    partition, offset = feed.bad_record(None, _json(2, kind="POISON-2"), "ValueError: cannot handle record")
    feed.events.send(150)
    position = f"{topic}/{partition}:{offset}"
    run = _wait_failed(state, job_id, tasks["submit"][1]["run_id"])
    assert (run.exit_code, run.failure_kind) == (failures.EXIT_POISON, "POISON"), run
    assert f"[STREAM_POISON_RECORD] {position}:" in run.termination_message, run.termination_message[:2000]
    assert "dead letters of this kind are refused" in run.termination_message
    assert state.stored_offsets(job_id).get((topic, partition), 0) <= offset, "the poisoned batch committed"

    status, tasks = run_dag(dags.health, params)
    found = tasks["health"][1]
    assert (found["health"], found["failure_kind"]) == ("FAILED", "POISON"), found
    assert any(position in line for line in found["evidence"]), found
    assert tasks["recover"][0] == "failed", tasks
    recover = RecoverStreamingJobOperator(task_id="recover", **{k: params[k] for k in (
        "spec", "application", "conf", "env_vars", "driver_log_dir", "ready_timeout", "heartbeat_timeout")})
    with pytest.raises(AirflowFailException) as refusal:
        recover.execute(context={})
    assert position in str(refusal.value) and "No automatic recovery for POISON" in str(refusal.value)
    assert state.restarts_since(job_id, 0) == [], "a poison record must not be restarted blindly"

    # 3. policy on_poison='fail': the same record stops the job at once, named by its position.
    failing = state.latest_run(job_id).run_id
    run_dag(dags.deploy, {**params, "env_vars": {**params["env_vars"], "POISON_POLICY": "fail"}})  # may see it fail
    run = wait_until(lambda: (r := state.latest_run(job_id)).run_id != failing and r.status == "FAILED" and r,
                     240, "the run with on_poison='fail' to fail")
    assert run.failure_kind == "POISON" and f"[STREAM_POISON_RECORD] {position}:" in run.termination_message
    assert "on_poison='fail'" in run.termination_message

    # 4. the table accepts dead letters again: the replayed batch dead-letters the record, nothing is lost.
    # Meanwhile the results table refuses one event's row: the database, not the code, fails on that
    # record; it is isolated the same way (rows written and rolled back) and dead-lettered with the refusal.
    with state.store.engine.begin() as conn:
        conn.execute(text("DROP TRIGGER refuse_poison"))
        conn.execute(text("CREATE TRIGGER refuse_event BEFORE INSERT ON events WHEN NEW.event_id = 'b-3' "
                          "BEGIN SELECT RAISE(ABORT, 'this event is refused by the results table'); END"))
    status, tasks = run_dag(dags.deploy, params)
    assert status == "success", tasks
    feed.events.send(60)
    refused_row = feed.bad_record(b"u-3", _json(3), "the database refused this record's results: "
                                  "(sqlite3.IntegrityError) this event is refused by the results table")
    feed.events.send(60)
    caught_up(state, job_id, feed.events)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = _check(state.store, job_id, feed)
    dead = {(r.partition, r.offset): r.error for r in _dead_letters(state.store, job_id)}
    for where in (first, (partition, offset)):
        assert dead[where].startswith("the job's code failed on this record: ValueError: cannot handle record"), \
            dead[where]
    assert dead[refused_row].startswith("the database refused this record's results"), dead[refused_row]
    figures.record("poison record", position=position, seconds_to_isolate_first=round(isolated_s, 1),
                   seconds_total=round(time.monotonic() - started, 1), **counts)


def _dead_letters(store, job_id: str):
    with store.engine.connect() as conn:
        return conn.execute(select(schema.dead_letters).where(schema.dead_letters.c.job_id == job_id)).all()
