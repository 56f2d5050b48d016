"""The Python Kafka source: a Spark 4 ``DataSourceStreamReader`` on kafka-python.

Used when Spark's JVM connector (spark-sql-kafka-0-10) is not on the classpath.  It follows the same
"direct" model: the driver plans per-partition offset ranges, each Spark task reads exactly one range,
nothing is copied into a second log.  Columns and offset JSON match the JVM source, so a checkpoint's
offset log reads the same and jobs do not care which source they got.

A read task may read several partitions' ranges one after the other (``readTasks``): in local mode the
read tasks' Python decoding and the JVM's work on what they hand over share the driver's cores, and one
Python reader per two cores keeps both busy with one Python worker process instead of one per Kafka
partition (about 120 MB each).

Spark starts Python processes only to create the source and to plan its reads, and keeps them for the
application's life: pyarrow (and kafka-python, in ``kafka_client``) are imported where records are
read, so those processes do not carry them.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from airflow_stream_provider import confluent_reader, kafka_client, kafka_offsets
from airflow_stream_provider.kafka_client import Columns

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

FORMAT = "stream_kafka"
SCHEMA = "topic string, partition int, offset long, key binary, value binary, timestamp timestamp"


class KafkaDataLossError(RuntimeError):
    """Offsets the query must read are gone from Kafka.  The message uses the JVM source's error class."""

    @classmethod
    def of(cls, error_class: str, lost: Sequence[kafka_offsets.LostRange]) -> KafkaDataLossError:
        """The failure for ``lost`` (failOnDataLoss), naming the ranges as text and as JSON."""
        return cls(
            f"[KAFKA_DATA_LOSS.{error_class}] Some data may have been lost because they are not available in "
            f"Kafka any more: {'; '.join(r.describe() for r in lost)}. Lost ranges (JSON): "
            f"{json.dumps([r.to_dict() for r in lost])}. Set failOnDataLoss=false only if losing them is acceptable."
        )


def _say_skipped(lost: Sequence[kafka_offsets.LostRange]) -> None:
    log.warning("Skipping records that Kafka no longer has (failOnDataLoss=false): %s",
                "; ".join(r.describe() for r in lost))


@dataclass(frozen=True)
class KafkaRange:
    topic: str
    partition: int
    start: int
    end: int


@dataclass(frozen=True)
class KafkaReadTask(InputPartition):
    """One Spark task's share of a batch: the ranges it reads, one after the other."""

    ranges: tuple[KafkaRange, ...]


class KafkaDataSource(DataSource):
    """Options mirror the JVM source: ``kafka.bootstrap.servers``, ``subscribe``, ``startingOffsets``,
    ``maxOffsetsPerTrigger``, ``failOnDataLoss``, and ``kafka.*`` client properties; ``reader``
    (``kafka-python`` or ``confluent-kafka``) chooses the read tasks' client, ``readTasks`` how many tasks
    read a batch (absent: one per partition, as the JVM source plans).

    ``maxOffsetsPerTrigger`` is a ceiling: a run's first batch reads at most ``FIRST_BATCH_RECORDS``,
    later ones up to the ceiling while a backlog lasts (``kafka_offsets.batch_limit``)."""

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
        #: the read tasks' client: kafka-python, or confluent-kafka when the ``confluent`` extra is there
        self.reader = lowered.get("reader", "kafka-python")
        self.confluent_config = confluent_reader.client_config(self.bootstrap, options)
        tasks = lowered.get("readtasks")
        self.read_tasks = int(tasks) if tasks else None
        #: records the previous batch planned: fewer than a first batch's size keeps the next small (``batch_limit``)
        self.previous_batch_records: int | None = None
        #: partitions Kafka no longer has, already reported by ``_check_data_loss``
        self.reported_vanished: set[tuple[str, int]] = set()

    # -- driver side: planning ---------------------------------------------------------------------
    def _consumer(self):
        return kafka_client.consumer(self.bootstrap, self.client_options)

    def _watermarks(self):
        """The topics' watermarks, asked once more after a timeout, as Spark's own Kafka source retries its
        offset fetches (``fetchOffset.numRetries``).  A broker that stops answering for longer than
        kafka-python's ``request_timeout_ms`` (a long pause of its own), or a pause of this process that
        long, expires one request; a second timeout ends the batch's planning as before."""
        from kafka.errors import KafkaTimeoutError

        try:
            return kafka_client.watermarks(self._consumer(), self.topics)
        except KafkaTimeoutError as err:
            log.warning("reading the offsets of %s timed out (%s); asking once more", ", ".join(self.topics), err)
            return kafka_client.watermarks(self._consumer(), self.topics)

    def initialOffset(self) -> dict:
        earliest, latest = self._watermarks()
        starting = (
            self.starting
            if self.starting in ("earliest", "latest")
            else kafka_offsets.from_spark_json(self.starting)
        )
        return kafka_offsets.to_spark_dict(kafka_offsets.resolve(starting, earliest, latest))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_offsets) if self.max_offsets else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        earliest, latest = self._watermarks()
        position = kafka_offsets.from_spark_json(start)
        position = self._check_data_loss(position, earliest, latest)
        ceiling = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = kafka_offsets.plan_batch_end(
            position, earliest, latest, kafka_offsets.batch_limit(self.previous_batch_records, ceiling)
        )
        self.previous_batch_records = kafka_offsets.records_between({**earliest, **position}, end)
        return kafka_offsets.to_spark_dict(end)

    def reportLatestOffset(self) -> dict | None:
        _, latest = self._watermarks()
        return kafka_offsets.to_spark_dict(latest)

    def _check_data_loss(self, position, earliest, latest):
        lost = kafka_offsets.find_lost_ranges(position, earliest, latest)
        if not lost:
            return position
        if self.fail_on_data_loss:
            raise KafkaDataLossError.of("START_OFFSET_RESET", lost)
        vanished = {(r.topic, r.partition) for r in lost if (r.topic, r.partition) not in latest}
        news = [r for r in lost if (r.topic, r.partition) not in self.reported_vanished]
        if news:  # a partition that stays gone is planned every trigger: said once
            _say_skipped(news)
        self.reported_vanished = vanished
        moved = dict(position)
        for r in lost:
            tp = (r.topic, r.partition)
            if tp in latest:  # below retention, or the log went backwards (topic recreated): everything
                moved[tp] = earliest[tp]  # Kafka holds from its earliest offset on is unread
            # A partition Kafka no longer has keeps its position, with nothing to read: should its topic come
            # back, the next plan finds the new log's end below it (the log went backwards), and the sink
            # records the loss and applies the new log from its start.  Dropped, the partition would come
            # back as a new one with no start, and the sink would take the new log's first records, up to
            # the stored offset, for a replay of the old log's.
        return moved

    def partitions(self, start: dict, end: dict) -> list[KafkaReadTask]:
        begin = kafka_offsets.from_spark_json(start)
        finish = kafka_offsets.from_spark_json(end)
        if added := [tp for tp in finish if tp not in begin]:
            begin = self._start_added_partitions(begin, added)
        if not self.fail_on_data_loss:
            begin = self._skip_lost_starts(begin, finish)
        ranges = {tp: (begin.get(tp, 0), stop) for tp, stop in finish.items() if stop > begin.get(tp, 0)}
        return [
            KafkaReadTask(tuple(KafkaRange(*tp, *ranges[tp]) for tp in group))
            for group in kafka_offsets.read_tasks(ranges, self.read_tasks)
        ]

    def _start_added_partitions(self, begin, added):
        """Partitions new in this batch (added to a topic since the last one) begin at their earliest offset,
        where ``latestOffset`` planned them from, not at 0: a log whose first records retention removed
        before the job saw it would fail every read of the batch, and its replays, out of range.  Records
        below it were never read: data loss, reported as Spark's own Kafka source reports an added partition
        that does not start at 0, or skipped with failOnDataLoss=false."""
        earliest, _ = self._watermarks()
        lost = [kafka_offsets.LostRange(*tp, 0, earliest[tp], "an added partition whose first records Kafka no "
                                        "longer has (retention) before the job read them")
                for tp in added if earliest.get(tp, 0) > 0]
        if lost and self.fail_on_data_loss:
            raise KafkaDataLossError.of("ADDED_PARTITION_DOES_NOT_START_FROM_OFFSET_ZERO", lost)
        if lost:
            _say_skipped(lost)
        return {**begin, **{tp: earliest.get(tp, 0) for tp in added}}

    def _skip_lost_starts(self, begin, finish):
        """With failOnDataLoss=false a batch may start where Kafka holds nothing any more (below retention,
        or past the end of a log that went backwards: ``latestOffset`` then planned the end from the
        earliest offset): read from the earliest offset Kafka still has.  The offsets log keeps the batch's
        planned start, so a replay of the batch reads the same records."""
        earliest, _ = self._watermarks()
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
    def read(self, partition: KafkaReadTask) -> Iterator[pa.RecordBatch]:
        """The task's ranges as Arrow record batches: Spark takes them without converting row by row, which
        is most of the cost of a Python source (the alternative, yielding tuples, pickles every record).
        Columns are built a poll at a time, not a record at a time."""
        for kafka_range in partition.ranges:
            yield from self._read_range(kafka_range)

    def _read_range(self, partition: KafkaRange) -> Iterator[pa.RecordBatch]:
        where = (partition.topic, partition.partition, partition.start, partition.end)
        if self.reader == confluent_reader.READER:
            polls = confluent_reader.read_range_columns(self.confluent_config, *where)
        else:
            polls = map(Columns.of, kafka_client.read_range_batches(self.bootstrap, self.client_options, *where))
        for columns in polls:
            for first in range(0, len(columns.offsets), ARROW_BATCH_ROWS):
                yield _record_batch(partition, Columns(*(c[first : first + ARROW_BATCH_ROWS] for c in columns)))


#: Records per Arrow batch handed to Spark: large enough to amortise the hand-over, small enough to
#: keep a Python worker's memory bounded whatever maxOffsetsPerTrigger is.
ARROW_BATCH_ROWS = 5000


@functools.cache
def arrow_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("topic", pa.string()),
            ("partition", pa.int32()),
            ("offset", pa.int64()),
            ("key", pa.binary()),
            ("value", pa.binary()),
            ("timestamp", pa.timestamp("us", tz="UTC")),
        ]
    )


def _record_batch(partition: KafkaRange, columns: Columns) -> pa.RecordBatch:
    import pyarrow as pa
    import pyarrow.compute as pc

    # Kafka timestamps are epoch milliseconds (-1: none set); Spark's timestamps are microseconds.
    rows = len(columns.offsets)
    millis = pa.array(columns.timestamps, pa.int64())
    micros = pc.if_else(pc.less(millis, 0), pa.nulls(rows, pa.int64()), pc.multiply(millis, 1000))
    schema = arrow_schema()
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(partition.topic, rows).cast(pa.string()),
            pa.repeat(partition.partition, rows).cast(pa.int32()),
            pa.array(columns.offsets, pa.int64()),
            pa.array(columns.keys, pa.binary()),
            pa.array(columns.values, pa.binary()),
            micros.cast(schema.field("timestamp").type),
        ],
        schema=schema,
    )
