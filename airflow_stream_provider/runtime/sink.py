"""The transactional sink: a ``foreachBatch`` function that makes results exactly-once.

The job hands it the parsed records (Kafka provenance columns plus an ``error`` column that is null for
a good record) and a function from good records to result tables.  Per batch it reads the batch's
range from the offsets log, drops replayed records, computes the results with Spark, and commits
results + dead letters + offsets + ledger in one database transaction (see ``transaction``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T
from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    LargeBinary,
    MetaData,
    Numeric,
    Table,
    Text,
)
from sqlalchemy import Column as SqlColumn

from airflow_stream_provider.kafka_offsets import Offsets
from airflow_stream_provider.runtime import faults, transaction
from airflow_stream_provider.runtime.checkpoint_log import OffsetLog
from airflow_stream_provider.state.store import StateStore

log = logging.getLogger(__name__)

PROVENANCE = ("topic", "partition", "offset")
DEAD_LETTER_COLUMNS = ("topic", "partition", "offset", "key", "value", "error")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Result:
    """One result table the job writes: ``frame``'s rows are upserted on ``key``; ``increments`` columns
    are added to what is stored (per-batch partial aggregates), the others overwritten."""

    table: str
    frame: DataFrame
    key: tuple[str, ...]
    increments: tuple[str, ...] = ()


ResultsFn = Callable[[DataFrame], Sequence[Result]]


class TransactionalSink:
    def __init__(
        self,
        *,
        store: StateStore,
        run: transaction.RunContext,
        offset_log: OffsetLog,
        generation_start: Offsets,
        results: ResultsFn,
        dry_run: bool = False,
        after_commit: Callable[[transaction.BatchOutcome], None] | None = None,
    ):
        self.store = store
        self.run = run
        self.offset_log = offset_log
        self.generation_start = generation_start
        self.results = results
        self.dry_run = dry_run
        self.after_commit = after_commit
        self._tables: dict[str, Table] = {}
        self._metadata = MetaData()

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        faults.maybe_crash("batch_start", batch_id)
        batch = self._batch_range(batch_id)
        if self.dry_run:  # a preflight replays a committed batch on purpose: run all of it, write nothing
            plan = transaction.whole_batch(batch)
        else:
            plan = transaction.plan(self.store, self.run.job_id, batch)
            if plan.is_replay:
                # Nothing to apply, but a stateful query's state stores commit only when every partition
                # of the batch is evaluated (Spark 4 fails the query otherwise): run it, discard it.
                records.write.format("noop").mode("append").save()
                log.info("batch %s is a replay of committed offsets (or empty): skipped", batch_id)
                return
        fresh = _only_fresh(records, plan).persist()
        try:
            outcome = self._apply(fresh, plan)
        finally:
            fresh.unpersist()
        if outcome is not None and self.after_commit is not None:
            self.after_commit(outcome)

    def _batch_range(self, batch_id: int) -> transaction.BatchRange:
        end = self.offset_log.source_offsets(batch_id)
        if end is None:
            raise RuntimeError(f"offsets log entry {batch_id} is missing: the checkpoint is not readable")
        start = self.offset_log.source_offsets(batch_id - 1)
        return transaction.BatchRange(batch_id, self.generation_start if start is None else start, end)

    def _apply(self, fresh: DataFrame, plan: transaction.BatchPlan) -> transaction.BatchOutcome | None:
        read = {
            (r.topic, r.partition): r["count"] for r in fresh.groupBy("topic", "partition").count().collect()
        }
        dead = [
            r.asDict() for r in fresh.where(F.col("error").isNotNull()).select(*DEAD_LETTER_COLUMNS).collect()
        ]
        good = fresh.where(F.col("error").isNull())
        writes = [self._write(result) for result in self.results(good)]
        if self.dry_run:
            log.info(
                "dry run: batch %s computed %s result rows, %s dead letters; nothing written",
                plan.range.batch_id,
                sum(len(w.rows) for w in writes),
                len(dead),
            )
            return transaction.BatchOutcome(plan.range.batch_id, read=read)
        faults.maybe_crash("before_db_commit", plan.range.batch_id)
        outcome = transaction.commit(self.store, self.run, plan, read=read, dead_letters=dead, writes=writes)
        faults.maybe_crash("after_db_commit", plan.range.batch_id)
        log.info(
            "batch %s committed: read %s, dead %s, offsets %s",
            plan.range.batch_id,
            sum(read.values()),
            len(dead),
            outcome.committed_offsets,
        )
        return outcome

    def _write(self, result: Result) -> transaction.Write:
        table = self._table(result)
        rows = [row.asDict() for row in result.frame.collect()]
        return transaction.Write(table, rows, tuple(result.key), tuple(result.increments))

    def _table(self, result: Result) -> Table:
        """The SQL table for a result, created from the frame's Spark schema on first use."""
        table = self._tables.get(result.table)
        if table is None:
            for name in (result.table, *(f.name for f in result.frame.schema.fields)):
                if not _IDENTIFIER.match(name):
                    raise ValueError(
                        f"result table/column name {name!r} is not a plain SQL identifier "
                        f"(letters, digits, underscore; not starting with a digit)"
                    )
            missing = set(result.key) - set(result.frame.columns)
            if missing:
                raise ValueError(
                    f"result {result.table!r}: key columns {sorted(missing)} are not in the frame"
                )
            table = Table(
                result.table,
                self._metadata,
                *[
                    SqlColumn(
                        f.name,
                        _sql_type(f.dataType),
                        primary_key=f.name in result.key,
                        nullable=f.name not in result.key,
                    )
                    for f in result.frame.schema.fields
                ],
            )
            if not self.dry_run:
                table.create(self.store.engine, checkfirst=True)
            self._tables[result.table] = table
        return table


def _only_fresh(records: DataFrame, plan: transaction.BatchPlan) -> DataFrame:
    """Drop replayed records.  Usually every planned partition starts fresh and no filter is needed."""
    start, end = plan.range.start, plan.range.end
    planned = {tp for tp, stop in end.items() if stop > start.get(tp, 0)}
    if planned == set(plan.apply_from) and all(plan.apply_from[tp] == start.get(tp, 0) for tp in planned):
        return records
    conditions: list[Column] = [
        (F.col("topic") == topic) & (F.col("partition") == partition) & (F.col("offset") >= first)
        for (topic, partition), first in plan.apply_from.items()
    ]
    return records.where(reduce(lambda a, b: a | b, conditions))


def _sql_type(spark_type: T.DataType):
    if isinstance(spark_type, T.StringType):
        return Text()
    if isinstance(spark_type, T.LongType | T.IntegerType | T.ShortType | T.ByteType):
        return BigInteger()
    if isinstance(spark_type, T.DoubleType | T.FloatType):
        return Float(53)
    if isinstance(spark_type, T.DecimalType):
        return Numeric(spark_type.precision, spark_type.scale)
    if isinstance(spark_type, T.BooleanType):
        return Boolean()
    if isinstance(spark_type, T.TimestampType | T.TimestampNTZType):
        return DateTime()
    if isinstance(spark_type, T.DateType):
        return Date()
    if isinstance(spark_type, T.BinaryType):
        return LargeBinary()
    raise ValueError(
        f"result column type {spark_type.simpleString()} has no SQL mapping; cast it to a "
        f"string, number, boolean, date, timestamp or binary column"
    )
