"""A range of one partition read whole, as a read task hands it to Spark: the tests of the Python source's
readers compare what they read column by column."""

from __future__ import annotations

from collections.abc import Iterable

from airflow_stream_provider import kafka_client
from airflow_stream_provider.kafka_client import Columns


def joined(polls: Iterable[Columns]) -> Columns:
    """Polls' columns as one ``Columns``, in order."""
    whole = Columns([], [], [], [])
    for columns in polls:
        for column, part in zip(whole, columns, strict=True):
            column.extend(part)
    return whole


def read_kafka_python(bootstrap: str, topic: str, start: int, end: int) -> Columns:
    """``[start, end)`` of partition 0 through the default reader and its cached consumer."""
    return joined(map(Columns.of, kafka_client.read_range_batches(bootstrap, {}, topic, 0, start, end)))
