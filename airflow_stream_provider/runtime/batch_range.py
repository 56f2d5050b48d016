"""A batch's range and the rows it admits.

The offsets log gives each batch a range per partition, ``[start, end)``, and the plan the first offset to
apply (``transaction.BatchPlan``): below it a record was applied by an earlier run and is a replay.  The
sink checks the records Spark handed the batch against the range before anything is written (a log that
does not describe what Spark read must not have its offsets stored with these results) and keeps the rows
to apply, in Spark (``Bounds.select``) or on rows already on the driver (``Bounds.mask``).
"""

from __future__ import annotations

from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from airflow_stream_provider.state import transaction
from airflow_stream_provider.state.transaction import TopicPartition


class BatchRangeError(RuntimeError):
    """The offsets log cannot say which records a batch holds: an entry is missing, or the records Spark
    handed the batch lie outside the range it gives (``[STREAM_OFFSET_LOG_MISSING]``,
    ``[STREAM_BATCH_RANGE_MISMATCH]``).  Nothing of the batch is written.  Not a record's fault."""


class Bounds:
    """Which of the rows Spark hands a batch the sink applies, from the batch's range and plan.

    Per partition of the range [start, end): records at or past the plan's first offset are applied,
    those below it are replays.  A stateful query may also emit rows of records read by earlier batches
    (outer-join rows, closed windows, timers: its state releases them now), so rows below ``start`` are
    its output, not replays.  No query can hand over a record at or past ``end``: Spark has not read it.
    """

    def __init__(self, plan: transaction.BatchPlan, stateful: bool):
        self.range = plan.range
        self.stateful = stateful
        # a range ending below its start is a log that went backwards (recreated topic), read from its
        # beginning: no lower bound
        self.start = {
            tp: start if start <= end else 0
            for tp, end in plan.range.end.items()
            for start in [plan.range.start.get(tp, 0)]
        }
        self.first = {tp: plan.apply_from.get(tp, end) for tp, end in plan.range.end.items()}
        #: some partition's range holds replayed records: drop them (usually every record is fresh)
        self.needs_filter = any(
            self.first[tp] != self.start[tp] for tp, end in plan.range.end.items() if end > self.start[tp]
        )

    def check(self, span: dict[TopicPartition, tuple[int, int]], job_id: str) -> None:
        """Refuse the batch when its records' lowest/highest offset per partition contradict the range:
        the offsets log does not describe what Spark read (e.g. rewritten by a second driver), and
        committing would store offsets that do not match the results."""
        for tp, (low, high) in sorted(span.items(), key=str):
            if tp[0] is None or tp[1] is None or low is None:
                continue  # no record's row (a stateful operator's own output): no position to check
            end = self.range.end.get(tp)
            if end is not None and high < end and (self.stateful or low >= self.start[tp]):
                continue
            batch = self.range.batch_id
            logged = (
                "no range for this partition"
                if end is None
                else f"[{self.start[tp]}, {end}) "
                + (f"(offsets/{batch - 1} to offsets/{batch})" if batch else "(generation start to offsets/0)")
            )
            raise BatchRangeError(
                f"[STREAM_BATCH_RANGE_MISMATCH] job {job_id} batch {batch}: partition {tp[0]}-{tp[1]}: the "
                f"offsets log gives the batch {logged} but the records Spark handed it span offsets {low} to "
                f"{high}. The offsets log does not describe what Spark read (rewritten, e.g. by a second "
                f"driver on this checkpoint); nothing was written and the stored offsets did not move. Make "
                f"sure only one driver runs on this checkpoint, then reset the job to a new generation from "
                f"the stored offsets (or restart it: Spark replays the batch with the logged range)."
            )

    def select(self, records: DataFrame) -> DataFrame:
        """The rows to apply (after ``check``): all of them unless a range holds replayed records."""
        if not self.needs_filter:
            return records
        offset = F.col("offset")
        conditions: list[Column] = [offset.isNull()] if self.stateful else []
        for (topic, partition), end in self.range.end.items():
            keep = (offset >= self.first[(topic, partition)]) & (offset < end)
            if self.stateful:
                keep = keep | (offset < self.start[(topic, partition)])
            conditions.append((F.col("topic") == topic) & (F.col("partition") == partition) & keep)
        return records.where(reduce(lambda a, b: a | b, conditions) if conditions else F.lit(False))

    def mask(self, table: pa.Table) -> pa.ChunkedArray | pa.Array:
        """``select`` on rows already on the driver."""
        tps = list(self.range.end)
        names = pa.array([f"{t}\x00{p}" for t, p in tps], pa.string())
        keys = pc.binary_join_element_wise(
            pc.cast(table["topic"], pa.string()), pc.cast(table["partition"], pa.string()), "\x00"
        )
        index = pc.index_in(keys, value_set=names)

        def per_row(values: dict[TopicPartition, int]):
            return pc.take(pa.array([values[tp] for tp in tps], pa.int64()), index)

        offset = table["offset"]
        keep = pc.and_(pc.greater_equal(offset, per_row(self.first)), pc.less(offset, per_row(self.range.end)))
        if self.stateful:
            keep = pc.or_kleene(pc.or_kleene(keep, pc.less(offset, per_row(self.start))), pc.is_null(offset))
        return pc.fill_null(keep, False)


def stats(table: pa.Table, *aggregates: str) -> dict[TopicPartition, dict]:
    """``aggregates`` of the offsets per partition of ``table``'s rows, named ``offset_<aggregate>``."""
    rows = table.group_by(["topic", "partition"]).aggregate([("offset", a) for a in aggregates]).to_pylist()
    return {(row["topic"], row["partition"]): row for row in rows}


def span(table: pa.Table, found: dict[TopicPartition, dict] | None = None) -> dict[TopicPartition, tuple[int, int]]:
    """Each partition's lowest and highest offset among ``table``'s rows (from ``stats`` already taken)."""
    found = stats(table, "min", "max") if found is None else found
    return {tp: (row["offset_min"], row["offset_max"]) for tp, row in found.items()}
