"""Write-behind end to end: a large batch commits while Spark reads the next one, and exactly-once holds at
the moments that opens: a driver killed after Spark logged a batch as done but before its commit landed,
a commit the database refuses, results that fail on a record, a graceful stop with a commit in flight.

Batches of 25,000 records (the ceiling; a run's first batch reads 10,000), so every batch after the first
goes behind (``write_behind.MIN_RECORDS``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from sqlalchemy import select, text

from airflow_stream_provider import failures
from airflow_stream_provider.runtime.write_behind import MIN_RECORDS, REDO_DESCRIPTION
from airflow_stream_provider.state import schema
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until
from tests.backends import POSTGRESQL_THEN_SQLITE_IN_SOAK
from tests.dagtest.dagruns import FIXTURE_JOBS

CEILING = 25_000
assert CEILING >= MIN_RECORDS


@pytest.fixture
def big_batches(runner):
    runner.spec = dataclasses.replace(runner.spec, kafka=dataclasses.replace(runner.spec.kafka,
                                                                             max_offsets_per_trigger=CEILING))
    return runner


def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _ledger(store, job_id: str) -> set[int]:
    with store.engine.connect() as conn:
        return set(conn.execute(select(schema.batches.c.batch_id).where(schema.batches.c.job_id == job_id)).scalars())


def _marks(checkpoint: Path) -> list[str]:
    folder = checkpoint / "write-behind"
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


# Both databases wait for ``make soak``: real_airflow/test_write_behind.py meets the same window, with the
# same checks, on a real Airflow in the default run.
@pytest.mark.soak
@POSTGRESQL_THEN_SQLITE_IN_SOAK
def test_kill9_with_spark_ahead_of_the_database(broker, topic, big_batches, figures):
    """Killed while batch 1's commit waits in the writer and batch 2 already runs: Spark's commit log holds
    batch 1, the database does not.  The next run applies batch 1 from Kafka before its query starts."""
    runner = big_batches
    checkpoint = Path(runner.spec.checkpoint_path)
    producer = EventProducer(broker, topic, malformed_ratio=0.01)
    producer.send(80_000)
    driver = runner.start(env={"STREAM_FAULT": "write_behind:1"})
    wait_until(lambda: not driver.alive(), 240, "the driver to die with batch 1 in its writer",
               on_timeout=lambda: runner.log_tail(driver))
    assert (checkpoint / "commits" / "1").exists() and (checkpoint / "offsets" / "2").exists()
    assert _ledger(runner.store, runner.spec.job_id) == {0}, "batch 1 is not in the database"
    assert _marks(checkpoint) == ["1"]

    producer.send(20_000)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver, timeout=400)
    log = Path(driver.log_path).read_text(errors="replace")
    assert "batch 1 was handed to the writer of a run that ended" in log
    assert "'write_behind':" in log, "later batches committed behind"
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    assert _marks(checkpoint) == [], "a clean stop leaves every batch in the database"
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == 100_000
    figures.record(f"write-behind kill -9 [{runner.store.dialect}]", **counts)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_commit_the_database_refuses_is_isolated_behind(broker, topic, big_batches, figures, tmp_path):
    """The results table refuses one event of a batch that commits behind: the writer applies the batch
    again from Kafka, isolates the record, dead-letters it with the refusal, and the stream goes on.
    SQLite: a trigger is the simplest refusal to set up (the same path serves PostgreSQL's errors).
    Spark's event log shows the redo's jobs described, and outside the query's job group (which a stop
    cancels)."""
    runner = big_batches
    spark_events = tmp_path / "spark-events"
    spark_events.mkdir()
    runner.conf = {**runner.conf, "spark.eventLog.enabled": "true", "spark.eventLog.dir": spark_events.as_uri(),
                   "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "true"}
    producer = EventProducer(broker, topic, malformed_ratio=0.0)
    producer.send(1_000)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    refused = "e-31000"
    with runner.store.engine.begin() as conn:
        conn.execute(text(f"CREATE TRIGGER refuse_event BEFORE INSERT ON events WHEN NEW.event_id = '{refused}' "
                          "BEGIN SELECT RAISE(ABORT, 'this event is refused by the results table'); END"))
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    producer.send(60_000)  # a backlog: the next run reads it in batches of the ceiling
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver, timeout=400)
    log = Path(driver.log_path).read_text(errors="replace")
    assert "the database refused its commit" in log and "applying it again from Kafka" in log
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)

    with runner.store.engine.connect() as conn:
        events = conn.execute(text("SELECT count(*) FROM events")).scalar()
        dead = conn.execute(select(schema.dead_letters.c.value, schema.dead_letters.c.error)
                            .where(schema.dead_letters.c.job_id == runner.spec.job_id)).all()
    assert events == 61_000 - 1
    assert len(dead) == 1 and refused.encode() in bytes(dead[0].value), dead
    assert dead[0].error.startswith("the database refused this record's results"), dead[0].error
    stored = {p: o for (_, p), o in runner.store.stored_offsets(runner.spec.job_id).items()}
    assert stored == _end(producer)
    redo = REDO_DESCRIPTION.format(batch_id=re.search(r"batch (\d+): the database refused its commit", log)[1])
    jobs = _job_properties(spark_events)
    assert jobs, f"no Spark event log in {spark_events}"
    redo_jobs = [job for job in jobs if job.get("spark.job.description") == redo]
    assert redo_jobs, "the redo's Spark jobs carry their description"
    assert any(job.get("spark.jobGroup.id") for job in jobs), "the query's own jobs run in its job group"
    assert all("spark.jobGroup.id" not in job for job in redo_jobs), redo_jobs
    figures.record("write-behind commit refused [sqlite]", events=events, dead=len(dead))


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_record_the_results_fail_on_is_isolated_and_its_batch_commits_behind(broker, topic, big_batches,
                                                                              figures):
    """The job's results (not its parse) fail on one record of a large batch: the sink isolates it among
    the batch's records, and the batch, its dead letter included, still commits behind.  Every other record
    is applied once."""
    runner = big_batches
    runner.application = str(FIXTURE_JOBS / "poison_on_value.py")
    producer = EventProducer(broker, topic, malformed_ratio=0.0)
    producer.send(30_000)  # the first batch (10,000) commits in line; the poison lands in a batch behind
    poison = json.dumps({"event_id": "p-1", "user_id": "u-1", "kind": "POISON-results", "amount": 1.0,
                         "ts": "2026-11-22T10:00:00Z"}).encode()
    partition, offset = producer.send_record(poison, key=b"u-1")
    producer.produced.malformed[(partition, offset)] = poison
    producer.send(30_000)
    driver = runner.start(env={"POISON_IN": "results"})
    runner.wait_caught_up(_end(producer), driver, timeout=400)
    log = Path(driver.log_path).read_text(errors="replace")
    position = f"{topic}/{partition}:{offset}"
    committed = re.search(rf"batch \d+ committed: .*\(poison {re.escape(position)}\).*", log)
    assert "failed while computing" in log and committed, runner.log_tail(driver)
    assert "'write_behind':" in committed[0], committed[0]
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    with runner.store.engine.connect() as conn:
        reasons = conn.execute(select(schema.dead_letters.c.error)
                               .where(schema.dead_letters.c.job_id == runner.spec.job_id)).scalars().all()
    assert len(reasons) == 1 and "cannot handle record" in reasons[0], reasons
    figures.record(f"write-behind batch with a poison record [{runner.store.dialect}]", **counts)


def _run_until_batch_1_is_purged(runner, producer: EventProducer) -> None:
    """A run that keeps two batches in its offsets log, fed a batch at a time until Spark (which purges in
    the background) dropped batch 1's entry, then stopped."""
    runner.spec = dataclasses.replace(runner.spec, min_batches_to_retain=2)
    checkpoint = Path(runner.spec.checkpoint_path)
    driver = runner.start()
    for _ in range(12):
        producer.send(30)
        runner.wait_caught_up(_end(producer), driver)
        if _purged(checkpoint, 1):
            break
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    assert _purged(checkpoint, 1), "Spark purged batch 1's entries"


def _purged(checkpoint: Path, batch_id: int) -> bool:
    """Spark logged ``batch_id`` and has dropped its entry since (it keeps ``min_batches_to_retain``)."""
    entries = [int(p.name) for p in (checkpoint / "offsets").glob("[0-9]*")]
    return bool(entries) and min(entries) > batch_id


def _job_properties(spark_events: Path) -> list[dict[str, str]]:
    """The local properties of every Spark job the drivers' event logs record."""
    return [
        event.get("Properties") or {}
        for log in spark_events.glob("eventlog_v2_*/events_*")  # a rolling log: a folder per application
        for event in map(json.loads, log.read_text().splitlines())
        if event.get("Event") == "SparkListenerJobStart"
    ]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_gap_names_the_write_behind_mark_it_could_not_apply(broker, topic, runner):
    """A run finds a write-behind mark whose batch Spark has purged from the offsets log while the database
    stops below the checkpoint: a batch was handed to a writer, its commit never confirmed, and nothing
    can apply it from the checkpoint any more.  The first batch ends the run as data loss with the gap and
    the mark named; the database stays as it was, and the mark stays for the next attempt.  The state is
    made by hand: a run applies a mark before Spark can purge its batch, so only a mark whose removal
    failed long ago, or a checkpoint moved between deployments, leaves one."""
    checkpoint = Path(runner.spec.checkpoint_path)
    producer = EventProducer(broker, topic, malformed_ratio=0.0)
    _run_until_batch_1_is_purged(runner, producer)

    job_id = runner.spec.job_id
    with runner.store.engine.begin() as conn:  # the stored offsets and the ledger as if no batch had landed
        conn.execute(schema.offsets.update().where(schema.offsets.c.job_id == job_id).values(next_offset=0))
        conn.execute(schema.batches.delete().where(schema.batches.c.job_id == job_id))
    (checkpoint / "write-behind").mkdir(exist_ok=True)
    (checkpoint / "write-behind" / "1").touch()
    ledger = _ledger(runner.store, job_id)
    producer.send(30)

    driver = runner.start()
    assert driver.wait(180) == failures.EXIT_DATA_LOSS, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert row.failure_kind == "DATA_LOSS" and "STREAM_OFFSET_GAP" in row.error_class, row
    assert "would be lost" in row.termination_message
    assert "write-behind mark of batch(es) 1 whose range the offsets log no longer holds" in row.termination_message
    assert _marks(checkpoint) == ["1"], "the mark stays until a batch plans without a gap"
    assert _ledger(runner.store, job_id) == ledger
    assert set(runner.store.stored_offsets(job_id).values()) == {0}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_purged_marks_batch_is_taken_as_landed_once_the_stored_offsets_pass_it(broker, topic, runner):
    """A write-behind mark whose batch Spark purged is settled by the stored offsets: at or past the end of
    the oldest batch the offsets log holds, on every partition, the batch landed, and the mark goes before
    the query starts.  Short of it on one partition, the mark stays through batches that read only other
    partitions (before, the first batch without a gap dropped it), and the gap that partition's next records
    open names it.  The state is made by hand, as in the test above."""
    checkpoint = Path(runner.spec.checkpoint_path)
    job_id = runner.spec.job_id
    producer = EventProducer(broker, topic, malformed_ratio=0.0)
    _run_until_batch_1_is_purged(runner, producer)
    (checkpoint / "write-behind").mkdir(exist_ok=True)
    (checkpoint / "write-behind" / "1").touch()

    driver = runner.start()  # the database holds every batch
    runner.wait_running(driver)
    assert _marks(checkpoint) == [], "the mark of a batch the stored offsets are past stayed"
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)

    doubt, other = sorted(runner.store.stored_offsets(job_id))[:2]  # (topic, partition)
    with runner.store.engine.begin() as conn:  # one partition's stored offset as if batch 1 had not landed there
        conn.execute(schema.offsets.update().where((schema.offsets.c.job_id == job_id)
                                                   & (schema.offsets.c.partition == doubt[1])).values(next_offset=0))
    (checkpoint / "write-behind" / "1").touch()
    producer._partition = lambda key: other[1]  # records for another partition only
    producer.send(30)
    driver = runner.start()
    wait_until(lambda: runner.store.stored_offsets(job_id)[other] == _end(producer)[other[1]], 120,
               "a batch that reads only another partition to commit", on_timeout=lambda: runner.log_tail(driver))
    assert _marks(checkpoint) == ["1"], "a batch that read nothing from the partition in doubt dropped the mark"

    del producer._partition  # every partition again: the one in doubt opens the gap
    producer.send(30)
    assert driver.wait(180) == failures.EXIT_DATA_LOSS, runner.log_tail(driver)
    message = runner.run_row(driver).termination_message
    assert "write-behind mark of batch(es) 1 whose range the offsets log no longer holds" in message, message


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("landed", [False, True], ids=["not-landed", "landed"])
def test_a_run_that_commits_in_line_settles_a_mark_before_its_query_starts(broker, topic, runner, landed):
    """A write-behind mark found by a run that commits in line: its query keeps state, so it cannot apply a
    batch from Kafka outside the stream.  A marked batch that Spark logged as done and the database does not
    hold fails the run before its query starts (checkpoint incompatible: a reset from the stored offsets
    reads it again), naming the batch and its range, the database untouched and the mark kept.  Left to the
    first batch, the gap showed only on a partition that batch read from.  One that landed just loses its
    mark.  The state is made by hand: a version that wrote behind, followed on its checkpoint by one the sink
    takes for stateful (a stream-static join), leaves it."""
    runner.application = str(FIXTURE_JOBS / "dedup_by_position.py")
    checkpoint = Path(runner.spec.checkpoint_path)
    job_id = runner.spec.job_id
    producer = EventProducer(broker, topic, malformed_ratio=0.0)
    producer.send(60)
    runner.process_backlog(_end(producer))
    landed_offsets, ledger = runner.store.stored_offsets(job_id), _ledger(runner.store, job_id)
    producer.send(60)
    runner.process_backlog(_end(producer))
    marked = min(_ledger(runner.store, job_id) - ledger)
    if not landed:
        with runner.store.engine.begin() as conn:  # the second run's batches as if their commits never landed
            for (t, partition), position in landed_offsets.items():
                conn.execute(schema.offsets.update().where(
                    (schema.offsets.c.job_id == job_id) & (schema.offsets.c.topic == t)
                    & (schema.offsets.c.partition == partition)).values(next_offset=position))
            conn.execute(schema.batches.delete().where(
                (schema.batches.c.job_id == job_id) & schema.batches.c.batch_id.not_in(ledger)))
        ledger_before = ledger
    else:
        ledger_before = _ledger(runner.store, job_id)
    stored_before = runner.store.stored_offsets(job_id)
    (checkpoint / "write-behind").mkdir(exist_ok=True)
    (checkpoint / "write-behind" / str(marked)).touch()

    if landed:
        producer.send(30)
        runner.process_backlog(_end(producer))
        assert _marks(checkpoint) == [], "a landed batch's mark goes"
        check_exactly_once(runner.store, job_id, producer.produced)
        return
    driver = runner.start()
    assert driver.wait(180) == failures.EXIT_CHECKPOINT_INCOMPATIBLE, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert (row.failure_kind, row.error_class) == ("CHECKPOINT_INCOMPATIBLE", "STREAM_WRITE_BEHIND_UNAPPLIED"), row
    message = row.termination_message
    assert f"batch {marked}: a run that wrote behind handed the batch to its writer" in message, message[:3000]
    assert "This run's query keeps state" in message and "reset the job to a new generation" in message
    assert row.query_started_at is None, "refused before the query started"
    assert _marks(checkpoint) == [str(marked)], "the mark stays for the reset to archive with the checkpoint"
    assert _ledger(runner.store, job_id) == ledger_before
    assert runner.store.stored_offsets(job_id) == stored_before
