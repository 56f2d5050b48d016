"""The Python source's planning when a partition vanishes from Kafka and its topic comes back, down to what
the sink then applies, on a real state database.

Tansu reports a deleted topic's partitions as empty rather than gone, and Apache Kafka, which drops them,
cannot run on these machines: the broker's watermarks are therefore given to the source here."""

from __future__ import annotations

import logging

from airflow_stream_provider.runtime.kafka_source import KafkaStreamReader
from airflow_stream_provider.state import schema, transaction
from airflow_stream_provider.state.transaction import BatchRange

T0 = ("events", 0)


def _reader(watermarks: list[tuple[dict, dict]]) -> KafkaStreamReader:
    reader = KafkaStreamReader({"kafka.bootstrap.servers": "127.0.0.1:9", "subscribe": "events",
                                "failOnDataLoss": "false"})
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
