"""The Python source's planning when a partition vanishes from Kafka and its topic comes back, down to what
the sink then applies, on a real state database.

Tansu reports a deleted topic's partitions as empty rather than gone, and Apache Kafka, which drops them,
cannot run on these machines: the broker's watermarks are therefore given to the source here."""

from __future__ import annotations

import logging

import pytest

from airflow_stream_provider import failures
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.runtime.kafka_source import KafkaDataLossError, KafkaRange, KafkaStreamReader
from airflow_stream_provider.state import schema, transaction
from airflow_stream_provider.state.transaction import BatchRange

T0 = ("events", 0)
T1 = ("events", 1)


def _reader(watermarks: list[tuple[dict, dict]], fail_on_data_loss: bool = False) -> KafkaStreamReader:
    reader = KafkaStreamReader({"kafka.bootstrap.servers": "127.0.0.1:9", "subscribe": "events",
                                "failOnDataLoss": str(fail_on_data_loss).lower()})
    reader._watermarks = lambda: watermarks.pop(0)
    return reader


def test_a_partition_that_vanishes_keeps_its_position_so_its_recreated_log_is_read_as_new(state_store, caplog):
    """Dropped from the plan, the partition came back as a new one with no start, and the sink took the new
    log's records below the stored offset for a replay of the old log's: applied never, with no loss on
    record.  Kept at its position, the new log's end shows below it, and the sink applies the new log from
    its start and records what the old log held past the stored offset."""
    gone: tuple[dict, dict] = ({}, {})
    reader = _reader([gone, gone, ({T0: 0}, {T0: 20})])
    committed = {"events": {"0": 338}}
    with caplog.at_level(logging.WARNING, "airflow_stream_provider"):
        while_gone = reader.latestOffset(committed, reader.getDefaultReadLimit())
        assert reader.latestOffset(while_gone, reader.getDefaultReadLimit()) == while_gone == committed
    said = [r.getMessage() for r in caplog.records if "Skipping records that Kafka no longer has" in r.getMessage()]
    assert len(said) == 1 and "events-0 [338, ?): partition no longer exists" in said[0], said  # once, not each plan

    back = reader.latestOffset(while_gone, reader.getDefaultReadLimit())
    assert back == {"events": {"0": 20}}

    with state_store.engine.begin() as conn:  # what the sink stored from the old log
        conn.execute(schema.offsets.insert(), [{"job_id": "job", "topic": "events", "partition": 0, "next_offset": 338,
                                                "updated_at": 0.0}])
    planned = transaction.plan(state_store, "job", BatchRange(7, {T0: 338}, {T0: 20}))
    assert planned.restarted == {T0} and planned.apply_from == {T0: 0}, planned


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_partition_added_after_retention_cut_its_head_is_read_from_its_earliest_offset(fail_on_data_loss, caplog):
    """A partition added while the job was away, whose first 500 records retention removed before the job
    saw it: ``latestOffset`` plans it from its earliest offset, but its read began at 0 and failed out of
    range on every replay of the batch, whatever failOnDataLoss said.  Now the batch reads it from 500, or
    fails as data loss naming the records never read."""
    marks = ({T0: 0, T1: 500}, {T0: 100, T1: 800})
    reader = _reader([marks, marks, marks], fail_on_data_loss)
    start = {"events": {"0": 100}}
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert end == {"events": {"0": 100, "1": 800}}
    if fail_on_data_loss:
        with pytest.raises(KafkaDataLossError) as raised:
            reader.partitions(start, end)
        assert "events-1 [0, 500): an added partition" in str(raised.value)
        found = failures.classify(f"KafkaDataLossError: {raised.value}")
        assert (found.kind, found.signature) == (FailureKind.DATA_LOSS, "kafka-data-loss"), found
        return
    with caplog.at_level(logging.WARNING, "airflow_stream_provider"):
        (task,) = reader.partitions(start, end)
    assert task.ranges == (KafkaRange("events", 1, 500, 800),)
    assert any("events-1 [0, 500)" in r.getMessage() for r in caplog.records), caplog.records
