"""The Python Kafka source: a Spark 4 ``DataSourceStreamReader`` on kafka-python.

Used when Spark's JVM connector (spark-sql-kafka-0-10) is not on the classpath.  It follows the same
"direct" model: the driver plans per-partition offset ranges, each Spark task reads exactly one range,
nothing is copied into a second log.  Columns and offset JSON match the JVM source, so a checkpoint's
offset log reads the same and jobs do not care which source they got.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from airflow_stream_provider import kafka_client, kafka_offsets

log = logging.getLogger(__name__)

FORMAT = "stream_kafka"
SCHEMA = "topic string, partition int, offset long, key binary, value binary, timestamp timestamp"


class KafkaDataLossError(RuntimeError):
    """Offsets the query must read are gone from Kafka.  The message uses the JVM source's error class."""


@dataclass(frozen=True)
class KafkaRange(InputPartition):
    topic: str
    partition: int
    start: int
    end: int


class KafkaDataSource(DataSource):
    """Options mirror the JVM source: ``kafka.bootstrap.servers``, ``subscribe``, ``startingOffsets``,
    ``maxOffsetsPerTrigger``, ``failOnDataLoss``, and ``kafka.*`` client properties."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema) -> KafkaStreamReader:
        return KafkaStreamReader(dict(self.options))


class KafkaStreamReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]):
        lowered = {k.lower(): v for k, v in options.items()}
        self.bootstrap = lowered["kafka.bootstrap.servers"]
        self.topics = tuple(t.strip() for t in lowered["subscribe"].split(",") if t.strip())
        self.starting = lowered.get("startingoffsets", "earliest")
        limit = lowered.get("maxoffsetspertrigger")
        self.max_offsets = int(limit) if limit else None
        self.fail_on_data_loss = lowered.get("failondataloss", "true").lower() != "false"
        self.client_options = kafka_client.client_options(options)

    # -- driver side: planning ---------------------------------------------------------------------
    def _consumer(self):
        return kafka_client.consumer(self.bootstrap, self.client_options)

    def initialOffset(self) -> dict:
        earliest, latest = kafka_client.watermarks(self._consumer(), self.topics)
        starting = (
            self.starting
            if self.starting in ("earliest", "latest")
            else kafka_offsets.from_spark_json(self.starting)
        )
        return kafka_offsets.to_spark_dict(kafka_offsets.resolve(starting, earliest, latest))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_offsets) if self.max_offsets else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        earliest, latest = kafka_client.watermarks(self._consumer(), self.topics)
        position = kafka_offsets.from_spark_json(start)
        position = self._check_data_loss(position, earliest, latest)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return kafka_offsets.to_spark_dict(kafka_offsets.plan_batch_end(position, earliest, latest, max_rows))

    def reportLatestOffset(self) -> dict | None:
        _, latest = kafka_client.watermarks(self._consumer(), self.topics)
        return kafka_offsets.to_spark_dict(latest)

    def _check_data_loss(self, position, earliest, latest):
        lost = kafka_offsets.find_lost_ranges(position, earliest, latest)
        if not lost:
            return position
        detail = "; ".join(r.describe() for r in lost)
        if self.fail_on_data_loss:
            raise KafkaDataLossError(
                f"[KAFKA_DATA_LOSS.START_OFFSET_RESET] Some data may have been lost because they are not "
                f"available in Kafka any more: {detail}. Lost ranges (JSON): "
                f"{json.dumps([r.to_dict() for r in lost])}. Set failOnDataLoss=false only if losing them "
                f"is acceptable."
            )
        log.warning("Skipping records that Kafka no longer has (failOnDataLoss=false): %s", detail)
        moved = dict(position)
        for r in lost:
            tp = (r.topic, r.partition)
            if tp not in latest:
                del moved[tp]
            else:  # below retention, or the log went backwards (topic recreated): everything Kafka holds
                # from its earliest offset on is unread
                moved[tp] = earliest[tp]
        return moved

    def partitions(self, start: dict, end: dict) -> list[KafkaRange]:
        begin = kafka_offsets.from_spark_json(start)
        finish = kafka_offsets.from_spark_json(end)
        if not self.fail_on_data_loss:
            begin = self._skip_lost_starts(begin, finish)
        return [
            KafkaRange(topic, partition, begin.get((topic, partition), 0), stop)
            for (topic, partition), stop in sorted(finish.items())
            if stop > begin.get((topic, partition), 0)
        ]

    def _skip_lost_starts(self, begin, finish):
        """With failOnDataLoss=false a batch may start where Kafka holds nothing any more (below retention,
        or past the end of a log that went backwards: ``latestOffset`` then planned the end from the
        earliest offset): read from the earliest offset Kafka still has.  The offsets log keeps the batch's
        planned start, so a replay of the batch reads the same records."""
        earliest, _ = kafka_client.watermarks(self._consumer(), self.topics)
        moved = dict(begin)
        for tp, stop in finish.items():
            first = begin.get(tp)
            if first is None or tp not in earliest:
                continue
            if first < earliest[tp] or stop < first:
                moved[tp] = earliest[tp]
                lost_end = earliest[tp] if first < earliest[tp] else "end of the old log"
                log.warning(
                    "Skipping %s-%s [%s, %s): no longer in Kafka (failOnDataLoss=false); reading from offset %s",
                    tp[0], tp[1], first, lost_end, earliest[tp],
                )
        return moved

    def commit(self, end: dict) -> None:
        """Nothing to do: the sink commits the consumer group after the results are durable."""

    # -- executor side: reading --------------------------------------------------------------------
    def read(self, partition: KafkaRange) -> Iterator[pa.RecordBatch]:
        """The range as Arrow record batches: Spark takes them without converting row by row, which is
        most of the cost of a Python source (the alternative, yielding tuples, pickles every record)."""
        columns: tuple[list, ...] = ([], [], [], [], [], [])
        for record in kafka_client.read_range(
            self.bootstrap,
            self.client_options,
            partition.topic,
            partition.partition,
            partition.start,
            partition.end,
        ):
            for column, value in zip(columns, _row(record), strict=True):
                column.append(value)
            if len(columns[0]) >= ARROW_BATCH_ROWS:
                yield _record_batch(columns)
                columns = ([], [], [], [], [], [])
        if columns[0]:
            yield _record_batch(columns)


#: Records per Arrow batch handed to Spark: large enough to amortise the hand-over, small enough to
#: keep a Python worker's memory bounded whatever maxOffsetsPerTrigger is.
ARROW_BATCH_ROWS = 5000
ARROW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
    ]
)


def _row(record) -> tuple:
    # Kafka timestamps are epoch milliseconds (-1: none set); Spark's timestamps are microseconds.
    timestamp = record.timestamp * 1000 if record.timestamp >= 0 else None
    return record.topic, record.partition, record.offset, record.key, record.value, timestamp


def _record_batch(columns: tuple[list, ...]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(values, type=field.type) for values, field in zip(columns, ARROW_SCHEMA, strict=True)],
        schema=ARROW_SCHEMA,
    )
