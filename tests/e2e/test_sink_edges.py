"""Edges of the transactional sink where what Spark hands a batch and what the offsets log says differ:
a rewritten or missing offsets-log entry, and output from batches that read nothing (stateful jobs).

Real drivers, broker and databases; the commit of a batch that read nothing also runs without Spark.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, Text, select, text

from airflow_stream_provider import failures
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.state.transaction import BatchRange, RunContext, Write, commit, plan
from stack.events import EventProducer
from stack.jobs import JOB_DEPS, check_exactly_once, wait_until

JOBS = Path(__file__).resolve().parents[1] / "fixtures" / "jobs"
TAMPER_JOB = str(JOBS / "tampered_offsets_log.py")
JOIN_JOB = str(JOBS / "payments_left_join.py")
FLAKY_STATEFUL_JOB = str(JOBS / "flaky_running_count.py")
POISON_TWO_STREAMS_JOB = str(JOBS / "poison_with_control_topic.py")
T = "events-topic"


def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _next_batch(runner) -> int:
    """The id Spark gives the next batch of a stopped job: one past the newest offsets-log entry."""
    entries = Path(runner.spec.checkpoint_path, "offsets").iterdir()
    return max(int(p.name) for p in entries if p.name.isdigit()) + 1


def _ledger_batches(runner) -> list[int]:
    with runner.store.engine.connect() as conn:
        return [r.batch_id for r in conn.execute(
            select(schema.batches.c.batch_id).where(schema.batches.c.job_id == runner.spec.job_id))]


def _applied_below_stored(runner) -> None:
    """The results hold exactly the records below the stored offsets: nothing applied beyond them, and
    nothing below them missing (so a restart neither repeats nor loses a record)."""
    stored = runner.stored_offsets()
    with runner.store.engine.connect() as conn:
        applied = {(r.partition, r.offset) for r in conn.execute(text('SELECT "partition", "offset" FROM events'))}
        dead = {(r.partition, r.offset) for r in conn.execute(
            select(schema.dead_letters).where(schema.dead_letters.c.job_id == runner.spec.job_id))}
    beyond = sorted(p for p in applied | dead if p[1] >= stored.get(p[0], 0))
    assert not beyond, f"records applied at or beyond the stored offsets {stored}: {beyond[:5]}"
    assert len(applied | dead) == sum(stored.values()), f"stored {stored}, applied {len(applied | dead)}"


# -- 1. the rows Spark hands a batch must match the range the offsets log gives it ---------------------
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_rewritten_offsets_log_is_refused(broker, topic, runner):
    """offsets/N is rewritten (as a second driver on the checkpoint would) to end before what Spark read.
    Trusting the log would apply the whole batch but store the smaller end; the crash that follows the
    commit makes the restart apply the records past it a second time."""
    producer = EventProducer(broker, topic)
    producer.send(600)
    runner.process_backlog(_end(producer))
    before = runner.stored_offsets()
    producer.send(600)
    runner.application = TAMPER_JOB
    batch = _next_batch(runner)
    tampered = runner.start(env={"STREAM_TEST_TAMPER": f"shrink:{batch}", "STREAM_FAULT": f"after_db_commit:{batch}"})
    code = tampered.wait(180)
    assert runner.stored_offsets() == before, "the stored offsets moved past what the batch applied"
    assert batch not in _ledger_batches(runner)
    _applied_below_stored(runner)
    assert code == failures.EXIT_CHECKPOINT_INCOMPATIBLE, runner.log_tail(tampered)
    row = runner.run_row(tampered)
    assert (row.failure_kind, row.error_class) == ("CHECKPOINT_INCOMPATIBLE", "STREAM_BATCH_RANGE_MISMATCH")
    message = row.termination_message
    assert f"batch {batch}" in message and "offsets log" in message, message[:2000]
    assert "STREAM_POISON_RECORD" not in message  # not a record's fault: no bisection

    # A plain restart replays batch N with the range the log now holds; the rest follows in batch N+1.
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)


# -- 3. a batch's start comes from offsets/N-1; only batch 0 starts at the generation's start ----------
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_missing_previous_offsets_entry_is_refused(broker, topic, runner):
    producer = EventProducer(broker, topic)
    producer.send(300)
    runner.process_backlog(_end(producer))
    stored = runner.stored_offsets()
    producer.send(300)
    runner.application = TAMPER_JOB
    batch = _next_batch(runner)
    driver = runner.start(env={"STREAM_TEST_TAMPER": f"drop-previous:{batch}"})
    wait_until(lambda: not driver.alive() or runner.stored_offsets() != stored, 180,
               "the driver to refuse the batch", on_timeout=runner.log_tail)
    assert runner.stored_offsets() == stored, "a batch without a known start was committed"
    assert driver.wait(60) == failures.EXIT_CHECKPOINT_INCOMPATIBLE, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert row.failure_kind == "CHECKPOINT_INCOMPATIBLE"
    assert f"offsets/{batch - 1}" in row.termination_message, row.termination_message[:2000]


# -- 2. output of a batch that read nothing (stateful jobs) is committed, exactly once ------------------
class _Events:
    """Events and payments as the join job reads them, with the offsets Kafka acknowledged."""

    def __init__(self, broker, topic: str):
        self.producer = broker.producer()
        self.topic = topic
        self.base = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)
        self.amounts: dict[str, float] = {}
        self.paid: dict[str, float] = {}
        self.end: dict[tuple[str, int], int] = {}

    def _send(self, topic: str, event_id: str, amount: float, seconds: float) -> None:
        ts = (self.base + dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
        value = {"event_id": event_id, "user_id": "u-1", "kind": "buy", "amount": amount, "ts": ts}
        meta = self.producer.send(topic, key=event_id.encode(), value=json.dumps(value).encode()).get(60)
        self.end[(topic, meta.partition)] = max(self.end.get((topic, meta.partition), 0), meta.offset + 1)

    def send(self, first: int, count: int, at: float) -> None:
        """Events ``first..first+count-1``, one a second from ``at``; the even ones paid a second later."""
        for i in range(first, first + count):
            event_id, amount = f"e-{i}", float(i)
            self._send(self.topic, event_id, amount, at + i - first)
            self.amounts[event_id] = amount
            if i % 2 == 0:
                self._send(f"{self.topic}-payments", event_id, amount + 0.5, at + i - first + 1)
                self.paid[event_id] = amount + 0.5


def _join_results(store: StateStore):
    with store.engine.connect() as conn:
        payments = {r.event_id: r.paid_amount for r in conn.execute(text("SELECT event_id, paid_amount FROM payments"))}
        counts = {r.outcome: r.events for r in conn.execute(text("SELECT outcome, events FROM payment_counts"))}
    return payments, counts


def _expected(events: _Events):
    payments = {e: events.paid.get(e) for e in events.amounts}
    unpaid = sum(1 for v in payments.values() if v is None)
    return payments, {"paid": len(payments) - unpaid, "unpaid": unpaid}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_output_of_batches_that_read_nothing_is_committed_once(broker, topic, runner):
    """Unpaid events leave the join only once the watermark has passed them, in the batch Spark runs
    without new data to move the watermark.  The driver is killed right after committing such a batch
    (the restart runs it again: its rows must not count twice) and right after a batch with data (a
    true replay: skipped as before)."""
    broker.create_topic(f"{topic}-payments", 1)
    runner.application = JOIN_JOB
    events = _Events(broker, topic)
    events.send(0, 20, at=0)
    events.send(100, 1, at=100)  # moves both watermarks far past the first events

    # batch 0 reads everything and matches the paid events; batch 1 reads nothing and emits the unpaid
    first = runner.start(env={"STREAM_FAULT": "after_db_commit:1"})
    wait_until(lambda: not first.alive(), 180, "the driver to die after committing batch 1",
               on_timeout=lambda: runner.log_tail(first))
    assert _join_results(runner.store) == _expected(events)

    events.send(200, 10, at=200)
    events.send(300, 1, at=300)
    second = runner.start(env={"STREAM_FAULT": "after_db_commit:2"})  # reruns batch 1, then batch 2
    wait_until(lambda: not second.alive(), 180, "the driver to die after committing batch 2",
               on_timeout=lambda: runner.log_tail(second))

    third = runner.start()  # reruns batch 2 (a replay), then batch 3 emits the new unpaid events
    expected = _expected(events)
    wait_until(lambda: _join_results(runner.store) == expected, 180, "the unpaid events of batch 3",
               on_timeout=lambda: f"{_join_results(runner.store)}\n{runner.log_tail(third)}")
    assert runner.stop(third) == failures.EXIT_STOPPED, runner.log_tail(third)
    assert _join_results(runner.store) == expected
    assert runner.store.stored_offsets(runner.spec.job_id) == events.end
    with runner.store.engine.connect() as conn:
        ledger = conn.execute(select(schema.batches).where(schema.batches.c.job_id == runner.spec.job_id)).all()
    empty = {r.batch_id for r in ledger if r.start_offset == r.end_offset}
    assert {1, 3} <= empty, f"batches that read nothing are in the ledger: {sorted(empty)}"
    assert all(r.start_offset == r.end_offset for r in ledger if r.batch_id in (1, 3))


# -- 4. a stateful query's batch its code failed on is completed by the stream alone -----------------------
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
# ``count`` in ``make soak``: its code cannot run outside a stream, so the batch failed before the fix too
# (with Spark's message in place of the job's); ``dedup`` is the one whose batch was committed.
@pytest.mark.parametrize("state", [pytest.param("count", marks=pytest.mark.soak), "dedup"])
def test_stateful_batch_the_code_failed_on_is_not_completed_outside_the_stream(broker, topic, runner, tmp_path,
                                                                              state):
    """The job's code fails on a batch inside the stream (every attempt of its task) and not when
    isolation runs it again on the batch's records, outside the stream: no record is to blame.  Results
    computed that way hold none of the stream's state (a running count would start again at 1), and
    Spark would find no state for the batch; a running count's code cannot run outside a stream at all.
    So the run fails with the job's own error, and the restart's stream completes the batch."""
    runner.application = FLAKY_STATEFUL_JOB
    producer = EventProducer(broker, topic, malformed_ratio=0)
    producer.send(300)
    count = tmp_path / "flaky-failures"
    env = {"STREAM_TEST_FLAKY_COUNT": str(count), "STREAM_TEST_FLAKY_STATE": state,
           "PYTHONPATH": str(JOB_DEPS)}  # the job's own pandas
    first = runner.start(env=env)
    runner.wait_caught_up(_end(producer), first)
    stored = runner.stored_offsets()
    flaky = {"event_id": "e-flaky", "user_id": "u-1", "kind": "FLAKY", "amount": 1.0, "ts": "2026-11-22T10:00:00Z"}
    producer.send_record(json.dumps(flaky).encode(), key=b"u-1")
    producer.produced.events[flaky["event_id"]] = flaky
    assert first.wait(180) == failures.EXIT_FAILED, runner.log_tail(first)
    assert count.stat().st_size == 4, "the job's code did not fail every attempt of its task"
    assert runner.stored_offsets() == stored, "a batch its stateful code failed on was committed"
    row = runner.run_row(first)
    assert row.failure_kind == "USER_CODE", row
    assert "failed on this batch once more" in row.termination_message, row.termination_message[:3000]

    producer.send(100)
    second = runner.start(env=env)
    runner.wait_caught_up(_end(producer), second)
    assert runner.stop(second) == failures.EXIT_STOPPED, runner.log_tail(second)
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    if state == "count":
        with runner.store.engine.connect() as conn:
            numbers: dict[str, list[int]] = {}
            for r in conn.execute(text("SELECT user_id, user_event_number FROM numbered")):
                numbers.setdefault(r.user_id, []).append(r.user_event_number)
        wrong = {u: sorted(n) for u, n in numbers.items() if sorted(n) != list(range(1, len(n) + 1))}
        assert not wrong, f"users whose events are not numbered 1..n from the stream's state: {wrong}"
        assert sum(map(len, numbers.values())) == len(producer.produced.events)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_transform_with_a_second_stream_fails_on_a_poison_record_with_its_own_error(broker, topic, runner):
    """A transform that reads a second stream of its own cannot be run again on chosen records of a batch
    (it would join them to a live stream).  A record it fails on ends the run with the job's own error,
    named USER_CODE, and nothing of the batch is committed; the position cannot be named."""
    broker.create_topic(f"{topic}-control", 1)
    runner.application = POISON_TWO_STREAMS_JOB
    producer = EventProducer(broker, topic, malformed_ratio=0)
    producer.send(200)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    stored = runner.stored_offsets()
    poison = {"event_id": "e-poison", "user_id": "u-1", "kind": "POISON", "amount": 1.0, "ts": "2026-11-22T10:00:00Z"}
    producer.send_record(json.dumps(poison).encode(), key=b"u-1")
    assert driver.wait(180) == failures.EXIT_FAILED, runner.log_tail(driver)
    assert runner.stored_offsets() == stored, "the batch holding the poison record was committed"
    row = runner.run_row(driver)
    assert row.failure_kind == "USER_CODE", row
    assert "ValueError: cannot handle record" in row.termination_message, row.termination_message[:3000]
    assert "writeStream" not in row.termination_message, row.termination_message[:3000]


# -- the commit of a batch that read nothing, on both databases, without Spark --------------------------
def test_batch_that_read_nothing_commits_its_rows_once(store):
    table = Table("unmatched", MetaData(), Column("k", Text, primary_key=True), Column("n", BigInteger))
    table.create(store.engine)
    ticket = store.begin_run("job", 1, "1.0")
    run = RunContext("job", ticket.run_id, ticket.epoch, 1)
    rows = [{"k": "late", "n": 1}]
    commit(store, run, plan(store, "job", BatchRange(0, {(T, 0): 0}, {(T, 0): 4})), read={(T, 0): 4},
           dead_letters=[], writes=[Write(table, [{"k": "on-time", "n": 4}], ("k",), ("n",))])
    empty = BatchRange(1, {(T, 0): 4}, {(T, 0): 4})
    for _ in range(2):  # the second time is Spark running batch 1 again after a crash
        commit(store, run, plan(store, "job", empty), read={}, dead_letters=[],
               writes=[Write(table, rows, ("k",), ("n",))])
    with store.engine.connect() as conn:
        assert {r.k: r.n for r in conn.execute(select(table))} == {"on-time": 4, "late": 1}
    assert store.stored_offsets("job") == {(T, 0): 4}
    assert store.count(schema.batches, job_id="job") == 2
    # a true replay of committed records stays skipped, whatever rows it brings
    replay = commit(store, run, plan(store, "job", BatchRange(0, {(T, 0): 0}, {(T, 0): 4})), read={(T, 0): 4},
                    dead_letters=[], writes=[Write(table, rows, ("k",), ("n",))])
    assert replay.skipped_replay
    with store.engine.connect() as conn:
        assert {r.k: r.n for r in conn.execute(select(table))} == {"on-time": 4, "late": 1}


# -- 4. isolating a record: what its search keeps, and its dead letter -----------------------------------
#: Run in the drivers' Python, which has Spark: the sink's building blocks on a real session.
ISOLATION_PARTS = """
import json

import pyarrow as pa
from pyspark.sql import SparkSession, functions as F

from airflow_stream_provider.runtime.batch_range import Bounds
from airflow_stream_provider.runtime.poison import keeps_state, positions
from airflow_stream_provider.runtime.sink import _tally
from airflow_stream_provider.state.transaction import BatchPlan, BatchRange

spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
rows = spark.createDataFrame([("t", 0, 5), ("t", 0, 6), (None, None, None)],
                             "topic string, partition int, offset long")
kept = rows.where(F.lit(True) & ~positions([("t", 0, 5)])).collect()
exploded = pa.table({"topic": ["t", "t", "t"], "partition": [0, 0, 0], "offset": [1, 1, 2],
                     "key": [b"k", b"k", None], "value": [b"[1,", b"[1,", None],
                     "error": ["bad item 0", "bad item 1", None]})
plan = BatchPlan(BatchRange(0, {("t", 0): 0}, {("t", 0): 3}), {}, {("t", 0): 0})
dead = _tally(None, Bounds(plan, stateful=False), exploded).dead
stream, static = spark.readStream.format("rate").load(), spark.range(3)
stream.createOrReplaceTempView("stream")
stateful = {"distinct": keeps_state(stream.distinct()),
            "sql": keeps_state(spark.sql("SELECT DISTINCT value FROM stream")),
            "projection": keeps_state(stream.select("value")),
            "stream-static join": keeps_state(stream.join(static, stream.value == static.id)),
            "static side aggregated": keeps_state(stream.join(static.groupBy("id").count(), stream.value == F.col("id"),
                                                              "left")),
            "stream-stream join": keeps_state(stream.alias("a").join(stream.alias("b"), "value")),
            "static query": keeps_state(rows.distinct())}
print("RESULT " + json.dumps({"kept": [r.offset for r in kept], "stateful": stateful,
                              "dead": [(d["offset"], d["error"]) for d in dead]}))
"""


def test_isolation_keeps_rows_without_a_position_and_dead_letters_a_record_once(tmp_path):
    """A record found while isolating a failure is left out of every later probe with ``~positions(found)``:
    on a stateful operator's own output, which has no position, that was NULL, and the rows were dropped
    from the batch's results while its offsets moved on.  And a transform that makes several rows of one
    malformed record (an explode) gave it several dead letters at one position: the commit failed on the
    table's key, then the isolation, and the run ended POISON.  And which queries keep state."""
    import subprocess

    from stack.jobs import SPARK_BIN, spark_env

    script = tmp_path / "parts.py"
    script.write_text(ISOLATION_PARTS)
    done = subprocess.run([str(SPARK_BIN / "python"), str(script)], env=spark_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found = json.loads(lines[-1].removeprefix("RESULT "))
    assert found["kept"] == [6, None], found
    assert found["dead"] == [[1, "bad item 0; bad item 1"]], found
    # a DISTINCT keeps state: taken for stateless, its job ran write-behind and its rows failed the range check;
    # a stream-static join keeps none: taken for stateful, its job lost write-behind and stopped on a poison record
    assert found["stateful"] == {"distinct": True, "sql": True, "projection": False, "stream-static join": False,
                                 "static side aggregated": False, "stream-stream join": True,
                                 "static query": False}, found
