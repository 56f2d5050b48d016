"""Edges where the checkpoint and the stored offsets disagree, with real drivers, broker and databases.

The stored offsets, not the checkpoint, say what was applied: a lost or restored checkpoint, a second
stream on a reset and a recreated topic must each end with every record applied exactly once (or, for
records Kafka no longer has, knowingly skipped) and a job that keeps running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import pytest
from kafka.errors import TopicAlreadyExistsError
from sqlalchemy import select, text

from airflow_stream_provider import failures
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.transaction import BatchRange, RunContext, commit, plan, trial_write
from stack.events import MALFORMED_SAMPLES, EventProducer
from stack.jobs import check_exactly_once, wait_until

# -- the transaction alone (no Spark) -------------------------------------------------------------------------
T = "edge-topic"


def _commit(store, run, batch_id, start, end, read):
    batch_plan = plan(store, run.job_id, BatchRange(batch_id, {(T, 0): start}, {(T, 0): end}))
    return batch_plan, commit(store, run, batch_plan, read={(T, 0): read} if read else {}, dead_letters=(),
                              writes=())


def _ledger(store, job_id):
    with store.engine.connect() as conn:
        return [(r.batch_id, r.start_offset, r.end_offset) for r in conn.execute(
            select(schema.batches).where(schema.batches.c.job_id == job_id).order_by(schema.batches.c.batch_id))]


def test_batch_ids_reused_by_an_older_checkpoint_get_the_next_ledger_id(store):
    ticket = store.begin_run("job", 1, "1.0")
    run = RunContext("job", ticket.run_id, ticket.epoch, 1)
    for batch_id, (start, end) in enumerate([(0, 10), (10, 20), (20, 30)]):
        _commit(store, run, batch_id, start, end, end - start)
    # the checkpoint was lost: Spark's batch 0 again, replayed up to 30 and fresh past it
    assert _commit(store, run, 0, 0, 25, 0)[0].is_replay
    batch_plan, outcome = _commit(store, run, 1, 25, 40, 10)
    assert batch_plan.apply_from == {(T, 0): 30} and outcome.committed_offsets == {(T, 0): 40}
    _commit(store, run, 5, 40, 45, 5)  # ids past the ledger's keep Spark's
    assert _ledger(store, "job") == [(0, 0, 10), (1, 10, 20), (2, 20, 30), (3, 30, 40), (5, 40, 45)]
    assert store.stored_offsets("job") == {(T, 0): 45}


def test_a_log_that_went_backwards_moves_the_stored_offset_back_once(store):
    ticket = store.begin_run("job", 1, "1.0")
    run = RunContext("job", ticket.run_id, ticket.epoch, 1)
    _commit(store, run, 0, 0, 300, 300)
    # the topic was recreated and the job accepts loss: the source read the new log up to 20
    batch_plan, _ = _commit(store, run, 1, 300, 20, 20)
    assert batch_plan.restarted == {(T, 0)} and batch_plan.apply_from == {(T, 0): 0}
    assert store.stored_offsets("job") == {(T, 0): 20}
    replay = _commit(store, run, 1, 300, 20, 0)[0]
    assert replay.is_replay  # a replay of that batch applies nothing
    assert replay.range.start == {(T, 0): 0}  # its records come from the new log, below the old end
    _commit(store, run, 2, 20, 25, 5)
    assert store.stored_offsets("job") == {(T, 0): 25}
    with store.engine.connect() as conn:
        losses = conn.execute(select(schema.accepted_losses).where(schema.accepted_losses.c.job_id == "job")).all()
    assert [(r.partition, r.start_offset, r.end_offset, r.resume_offset) for r in losses] == [(0, 300, None, 0)]


def test_a_recreated_logs_dead_letter_at_an_old_ones_position_is_recorded(store):
    """The new log's malformed record at a position the old log's dead letter holds: the batch commits, the
    old dead letter is archived byte for byte in the same transaction, and the new one takes its place."""
    ticket = store.begin_run("job", 1, "1.0")
    run = RunContext("job", ticket.run_id, ticket.epoch, 1)

    def letter(value):
        return {"topic": T, "partition": 0, "offset": 5, "key": None, "value": value, "error": "malformed"}

    old_plan = plan(store, run.job_id, BatchRange(0, {(T, 0): 0}, {(T, 0): 300}))
    commit(store, run, old_plan, read={(T, 0): 300}, dead_letters=[letter(b"old log")], writes=())
    new_plan = plan(store, run.job_id, BatchRange(1, {(T, 0): 300}, {(T, 0): 20}))
    assert new_plan.restarted == {(T, 0)}
    trial_write(store, run, new_plan, dead_letters=[letter(b"new log")], writes=())  # the isolation's question
    commit(store, run, new_plan, read={(T, 0): 20}, dead_letters=[letter(b"new log")], writes=())

    with store.engine.connect() as conn:
        live = conn.execute(select(schema.dead_letters)).all()
        archived = conn.execute(select(schema.dead_letters_archive)).all()
    assert [(r.offset, r.value, r.batch_id) for r in live] == [(5, b"new log", 1)]
    assert [(r.offset, r.value, r.batch_id) for r in archived] == [(5, b"old log", 0)]
    assert store.stored_offsets("job") == {(T, 0): 20}


# -- real drivers -------------------------------------------------------------------------------------------
def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _small_batches(runner, **kafka) -> None:
    """Batches of at most 300 records, so a run makes several and a replay takes several."""
    spec = runner.spec
    runner.spec = dataclasses.replace(
        spec, kafka=dataclasses.replace(spec.kafka, max_offsets_per_trigger=300, **kafka)
    ).validate()


def _feed_in_chunks(runner, producer, driver, chunks: int, size: int) -> None:
    """One or more batches per chunk: the ledger gets more batch ids than a replay of it needs."""
    for _ in range(chunks):
        producer.send(size)
        runner.wait_caught_up(_end(producer), driver)


def _resume_and_check(runner, producer, expected_read: int) -> None:
    """Restart on the same generation: the job catches up, keeps running, stops cleanly, exactly once."""
    producer.send(250)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    producer.send(150)  # it goes on after the first fresh batch
    runner.wait_caught_up(_end(producer), driver)
    assert driver.alive()
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert (row.status, row.failure_kind) == ("STOPPED", None)
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == expected_read
    log = Path(driver.log_path).read_text(errors="replace")
    assert "behind the stored offsets" in log and "are replays" in log, runner.log_tail(driver)
    assert "poison" not in log.lower(), runner.log_tail(driver)


# The ledger-id rule runs on both databases above, without Spark; end to end one database suffices.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_lost_checkpoint_resumes_from_stored_offsets(broker, topic, runner):
    _small_batches(runner)
    producer = EventProducer(broker, topic)
    driver = runner.start()
    _feed_in_chunks(runner, producer, driver, chunks=5, size=120)
    assert runner.stop(driver) == failures.EXIT_STOPPED
    first_batches = runner.committed_batches()

    shutil.rmtree(runner.spec.checkpoint_path)  # lost: Spark numbers its batches from 0 again
    _resume_and_check(runner, producer, 1000)
    assert runner.committed_batches() > first_batches
    assert runner.store.get_generation(runner.spec.job_id, 1)["archived_at"] is None


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_checkpoint_restored_from_older_copy(broker, topic, runner):
    _small_batches(runner)
    producer = EventProducer(broker, topic)
    producer.send(120)
    runner.process_backlog(_end(producer))
    older = Path(runner.spec.job_root) / "older-copy"
    shutil.copytree(runner.spec.checkpoint_path, older)

    driver = runner.start()
    _feed_in_chunks(runner, producer, driver, chunks=4, size=120)
    assert runner.stop(driver) == failures.EXIT_STOPPED
    shutil.rmtree(runner.spec.checkpoint_path)
    shutil.move(older, runner.spec.checkpoint_path)  # restored: batch ids and offsets go back
    _resume_and_check(runner, producer, 1000)


# -- helpers ------------------------------------------------------------------------------------------------
def _stored(runner) -> dict[tuple[str, int], int]:
    return runner.store.stored_offsets(runner.spec.job_id)


def _ends(*producers) -> dict[tuple[str, int], int]:
    return {(p.produced.topic, part): o for p in producers for part, o in p.produced.end_offsets.items()}


def _caught_up(runner, driver, *producers) -> None:
    def done():
        if not driver.alive():
            raise AssertionError(f"driver died\n{runner.log_tail(driver)}")
        return _stored(runner) == _ends(*producers)

    wait_until(done, 240, "stored offsets to reach the end of both topics",
               on_timeout=lambda: f"stored {_stored(runner)}\nends {_ends(*producers)}\n{runner.log_tail(driver)}")


# -- the Python source accepting data loss -------------------------------------------------------------------
def _malformed_first(producer, count: int = 6) -> None:
    """The log begins with malformed records, keyed, so that a recreated log that begins the same way holds
    its own at the same positions: each of them is dead-lettered where an old dead letter was."""
    for i in range(count):
        value = MALFORMED_SAMPLES[i % len(MALFORMED_SAMPLES)]
        producer.produced.malformed[producer.send_record(value, key=f"malformed-{i}".encode())] = value


def _both_logs_applied_and_the_old_ones_rest_on_record(runner, producer, recreated, old) -> None:
    """Every event of the old log and of the recreated one is in the results, and the old log's rest (from
    the stored offset on) is an accepted loss, with the partition resumed at the new log's start.  The
    dead letters are the recreated log's; the old log's are archived, byte for byte."""
    def letters(table):
        return {(r.partition, r.offset): r.value for r in conn.execute(
            select(table).where(table.c.job_id == runner.spec.job_id))}

    with runner.store.engine.connect() as conn:
        stored_events = {r.event_id for r in conn.execute(text("SELECT event_id FROM events"))}
        losses = conn.execute(select(schema.accepted_losses).where(
            schema.accepted_losses.c.job_id == runner.spec.job_id)).all()
        dead, archived = letters(schema.dead_letters), letters(schema.dead_letters_archive)
    assert stored_events == set(producer.produced.events) | set(recreated.produced.events)
    assert {(r.topic, r.partition): (r.start_offset, r.resume_offset) for r in losses} == {
        tp: (o, 0) for tp, o in old.items()
    }
    assert dead == recreated.produced.malformed
    assert archived == producer.produced.malformed
    assert set(dead) & set(archived), "no new dead letter took an old one's position: the test shows nothing"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_python_source_skips_lost_ranges_when_loss_is_accepted(broker, topic, runner):
    _small_batches(runner, fail_on_data_loss=False)
    assert runner.spec.kafka.source == "python"
    producer = EventProducer(broker, topic)
    _malformed_first(producer)
    producer.send(600)
    runner.process_backlog(_end(producer))
    old = runner.store.stored_offsets(runner.spec.job_id)

    # The topic is recreated: the positions the checkpoint and the database hold are gone from Kafka.
    broker.delete_topic(topic)
    broker.create_topic(topic, 3)
    recreated = EventProducer(broker, topic, seed=99)
    recreated.sent = 100_000
    _malformed_first(recreated)
    recreated.send(60)
    driver = runner.start()
    runner.wait_caught_up(_end(recreated), driver)
    recreated.send(40)
    runner.wait_caught_up(_end(recreated), driver)
    assert driver.alive()
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)

    _both_logs_applied_and_the_old_ones_rest_on_record(runner, producer, recreated, old)
    log = Path(driver.log_path).read_text(errors="replace")
    assert "failOnDataLoss=false" in log, runner.log_tail(driver)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_topic_deleted_under_a_running_job_is_read_again_from_its_new_start(broker, topic, runner):
    """The topic is deleted under a running job and written again: the new log's records are fresh, not a
    replay of what the old log held at those offsets, and the skipped rest of the old log is on record.
    The job's informational consumer-group commit fails on the deleted topic: it gives up after a few
    seconds instead of holding the job."""
    _small_batches(runner, fail_on_data_loss=False)
    producer = EventProducer(broker, topic)
    _malformed_first(producer)
    producer.send(600)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    old = runner.store.stored_offsets(runner.spec.job_id)

    broker.delete_topic(topic)
    log = Path(driver.log_path)
    wait_until(lambda: "offsets went backwards" in log.read_text(errors="replace"), 120,
               "a batch planned on the deleted topic", on_timeout=lambda: runner.log_tail(driver))
    # While the topic is gone the broker refuses the group commit of the batch that moved the offsets back:
    # it gives up after GROUP_COMMIT_TIMEOUT_MS (5 s), not after kafka-python's default of 30 s, which held the
    # job that long for every such batch
    wait_until(lambda: "could not commit offsets to the consumer group" in log.read_text(errors="replace"), 20,
               "the group commit to give up", on_timeout=lambda: runner.log_tail(driver))
    with contextlib.suppress(TopicAlreadyExistsError):  # Tansu lists a deleted topic again, empty, when asked
        broker.create_topic(topic, 3)
    recreated = EventProducer(broker, topic, seed=99)
    recreated.sent = 100_000
    _malformed_first(recreated)
    recreated.send(60)
    runner.wait_caught_up(_end(recreated), driver)
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)

    _both_logs_applied_and_the_old_ones_rest_on_record(runner, producer, recreated, old)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_kill_during_the_first_offsets_write_does_not_brick_the_generation(broker, topic, runner):
    """A driver killed while Spark wrote the generation's first offsets entry leaves only its temporary
    file (``offsets/.0.<uuid>.tmp``).  Spark takes such a checkpoint for a new one and refuses it as not
    empty ([STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY]); the next run removes the leftover and processes.
    The leftover is made by hand: the kill's window is a few milliseconds."""
    checkpoint = Path(runner.spec.checkpoint_path)
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "offsets" / ".0.4223d3fb-662a-4ca8-a50d-df14327424ce.tmp").write_text("v1\n")
    producer = EventProducer(broker, topic)
    producer.send(300)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    log = Path(driver.log_path).read_text()
    assert "removed what a killed driver left of the generation's first log entry" in log
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
