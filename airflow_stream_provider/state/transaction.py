"""The exactly-once commit of one micro-batch: results, dead letters, offsets and ledger in ONE transaction.

Spark replays batch N with the same offset range after a driver dies (the offsets log is written
before the batch runs).  This module turns that at-least-once delivery into exactly-once results:

1. ``plan`` compares the batch's per-partition range with the stored next offsets: a partition whose
   range ends at or below the stored offset is a replay (skip), one that starts *above* it is a gap
   (records would be lost: refuse).  Checked per batch, never per record: compaction and transaction
   markers leave holes in offsets.
2. ``commit`` writes everything inside one transaction that first checks the run's fencing epoch, so a
   zombie driver cannot commit, and that re-reads the stored offsets under the lock.

Pure database code (no pyspark): the Spark side hands it Arrow tables or plain rows (``bulk``).
``trial_write`` lets the sink ask the database whether it accepts a batch's rows without committing
them (poison record isolation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, func, select

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.kafka_offsets import Offsets
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.bulk import Rows, write_rows
from airflow_stream_provider.state.dialect import upsert
from airflow_stream_provider.state.store import StateStore, archive_dead_letters

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

TopicPartition = tuple[str, int]


class FencedError(RuntimeError):
    """This run no longer holds the job's epoch: another driver took over.  Its batch is rejected."""


class OffsetGapError(RuntimeError):
    """A batch starts above the stored offset: applying it would silently lose records."""


class ConcurrentCommitError(RuntimeError):
    """The stored offsets changed between planning and committing a batch."""


@dataclass(frozen=True)
class BatchRange:
    """Batch N of a generation: from ``start`` (end of batch N-1) to ``end`` (offsets log entry N)."""

    batch_id: int
    start: Offsets
    end: Offsets

    @property
    def is_empty(self) -> bool:
        """Nothing was read: every partition's range is empty (e.g. the batch a stateful query runs without
        new data to move its watermark; what it emits comes from its state)."""
        return all(end == self.start.get(tp, 0) for tp, end in self.end.items())


@dataclass(frozen=True)
class BatchPlan:
    range: BatchRange
    #: stored next offsets when planned; the commit verifies they did not move
    stored: Offsets
    #: per partition with a non-empty range, the first offset to apply (records below it are replays)
    apply_from: dict[TopicPartition, int]
    #: partitions whose log went backwards (topic recreated) and that the source restarted: only a job
    #: that accepts data loss gets such a batch; its stored offset moves back, the loss is recorded
    restarted: frozenset[TopicPartition] = frozenset()

    @property
    def is_replay(self) -> bool:
        """Every record of the batch is already reflected in the results."""
        return not self.apply_from

    @property
    def replayed(self) -> int:
        """How many of the batch's records are already reflected in the results (a batch replayed in part
        after a restart): below ``apply_from``, or in a partition with nothing to apply."""
        return sum(max(0, min(self.apply_from.get(tp, end), end) - self.range.start.get(tp, 0))
                   for tp, end in self.range.end.items())

    def is_fresh(self, topic: str, partition: int, offset: int) -> bool:
        first = self.apply_from.get((topic, partition))
        return first is not None and first <= offset < self.range.end[(topic, partition)]


@dataclass
class Write:
    """Rows for one result table.  On a key conflict, ``increments`` columns are added to the stored
    value (aggregates applied as increments) and every other column is overwritten (idempotent upsert).
    ``rows``: an Arrow table (as the sink collects them) or dicts; several rows may share a key."""

    table: Table
    rows: Rows | pa.Table
    key: tuple[str, ...]
    increments: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunContext:
    job_id: str
    run_id: str
    #: the fencing epoch the run took; None for a dry run, which takes none and may commit nothing
    epoch: int | None
    generation: int


@dataclass
class BatchOutcome:
    """What a commit did, for the ledger, the progress heartbeat and the tests."""

    batch_id: int
    read: dict[TopicPartition, int] = field(default_factory=dict)
    applied: dict[TopicPartition, int] = field(default_factory=dict)
    dead: dict[TopicPartition, int] = field(default_factory=dict)
    committed_offsets: Offsets = field(default_factory=dict)
    skipped_replay: bool = False
    #: seconds spent writing result rows and dead letters, inside the transaction
    write_s: float = 0.0


def plan(store: StateStore, job_id: str, batch: BatchRange) -> BatchPlan:
    stored = store.stored_offsets(job_id)
    restarted = _restarted(batch, stored)
    apply_from = _apply_from(job_id, batch, stored, restarted)
    backwards = {tp for tp, end in batch.end.items() if end < batch.start.get(tp, end)}
    if backwards:  # the source read these from the new log's start, not from the old log's end (also on replay)
        batch = replace(batch, start={**batch.start, **{tp: 0 for tp in backwards}})
    return BatchPlan(batch, stored, apply_from, frozenset(restarted))


def whole_batch(batch: BatchRange) -> BatchPlan:
    """A plan that applies every record of the batch, ignoring the stored offsets (preflight dry runs)."""
    apply_from = {tp: batch.start.get(tp, 0) for tp, end in batch.end.items() if end > batch.start.get(tp, 0)}
    return BatchPlan(batch, {}, apply_from)


def _restarted(batch: BatchRange, stored: Offsets) -> set[TopicPartition]:
    """Partitions the batch reads from a log that went backwards: the range ends below its start, which a
    source plans only when failOnDataLoss=false, and the stored offset is past that end (once committed,
    the stored offset equals the end and a replay of the batch is skipped as usual)."""
    return {
        tp
        for tp, end in batch.end.items()
        if batch.start.get(tp) is not None and end < batch.start[tp] and stored.get(tp, end + 1) > end
    }


def _apply_from(
    job_id: str, batch: BatchRange, stored: Offsets, restarted: set[TopicPartition] = frozenset()
) -> dict[TopicPartition, int]:
    apply_from = {}
    for tp, end in sorted(batch.end.items()):
        start = batch.start.get(tp)
        position = stored.get(tp)
        if tp in restarted:  # the batch holds the new log's records below ``end``, all fresh; even with
            apply_from[tp] = 0  # none, the commit must move the stored offset back to the new log
            continue
        if end <= (start if start is not None else 0):
            continue  # nothing planned for this partition (e.g. an empty second stream)
        if position is None:
            apply_from[tp] = start if start is not None else 0
            continue
        if end <= position:
            continue  # replay of a batch already committed
        if start is not None and start > position:
            raise OffsetGapError(
                f"[STREAM_OFFSET_GAP] job {job_id} batch {batch.batch_id}: partition {tp[0]}-{tp[1]} starts at "
                f"offset {start} but the results only cover up to {position}; records [{position}, {start}) "
                f"would be lost. The checkpoint does not match the stored offsets: reset the job to a new "
                f"generation that starts from the stored offsets."
            )
        apply_from[tp] = position if start is None else max(start, position)
    return apply_from


def commit(
    store: StateStore,
    run: RunContext,
    batch_plan: BatchPlan,
    *,
    read: Mapping[TopicPartition, int],
    dead_letters: Sequence[Mapping[str, Any]],
    writes: Sequence[Write],
    started_at: float | None = None,
) -> BatchOutcome:
    """Apply one planned batch atomically.  ``read`` counts the fresh records per partition; the rows in
    ``writes`` and ``dead_letters`` come from those records only; ``started_at`` is when the driver began
    the batch (for its latency in the ledger)."""
    outcome = BatchOutcome(batch_plan.range.batch_id, read=dict(read))
    for row in dead_letters:
        tp = (row["topic"], row["partition"])
        outcome.dead[tp] = outcome.dead.get(tp, 0) + 1
    outcome.applied = {tp: n - outcome.dead.get(tp, 0) for tp, n in read.items()}
    now = store.now()
    started = None if started_at is None else store.clock.to_database(started_at)
    with store.engine.begin() as conn:
        _check_epoch(conn, run)
        stored = store.stored_offsets(run.job_id, conn)
        if stored != batch_plan.stored:
            raise ConcurrentCommitError(
                f"[STREAM_CONCURRENT_COMMIT] job {run.job_id} batch {batch_plan.range.batch_id}: stored offsets "
                f"moved from {kafka_offsets.to_spark_json(batch_plan.stored)} to "
                f"{kafka_offsets.to_spark_json(stored)} while the batch was being computed, though run "
                f"{run.run_id} still holds the job's epoch {run.epoch}: something besides this run writes the "
                f"job's stored offsets. Nothing of the batch was written."
            )
        # A batch that read nothing has nothing to replay, but its output (from state) is written once:
        # recorded in the ledger at its position, so that Spark running it again is recognised.
        empty = batch_plan.is_replay and batch_plan.range.is_empty
        if batch_plan.is_replay and (not empty or _empty_batch_committed(conn, run, batch_plan.range)):
            outcome.skipped_replay = True
            return outcome
        ledger_batch = _ledger_batch_id(conn, run, batch_plan.range.batch_id)
        _record_restarts(conn, run, batch_plan, stored, now)
        _archive_gone_logs(conn, run, batch_plan, now)  # before the batch writes its own at those positions
        began = time.perf_counter()
        for write in writes:
            write_rows(conn, write.table, write.key, write.increments, write.rows)
        if dead_letters:
            conn.execute(schema.dead_letters.insert(), _dead_letter_rows(run, ledger_batch, dead_letters, now))
        outcome.write_s = time.perf_counter() - began
        ledger = []
        for tp, first in (batch_plan.range.end if empty else batch_plan.apply_from).items():
            end = batch_plan.range.end[tp]
            if not empty:  # an empty batch moves no offset
                outcome.committed_offsets[tp] = end
            ledger.append(
                {
                    "job_id": run.job_id,
                    "generation": run.generation,
                    "batch_id": ledger_batch,
                    "topic": tp[0],
                    "partition": tp[1],
                    "start_offset": first,
                    "end_offset": end,
                    "rows_read": read.get(tp, 0),
                    "rows_applied": outcome.applied.get(tp, 0),
                    "rows_dead": outcome.dead.get(tp, 0),
                    "epoch": run.epoch,
                    "run_id": run.run_id,
                    "committed_at": now,
                    "started_at": started,
                }
            )
        if ledger:
            conn.execute(schema.batches.insert(), ledger)
        _advance_offsets(conn, run, ledger_batch, stored, outcome.committed_offsets, now, batch_plan.restarted)
    return outcome


def trial_write(
    store: StateStore,
    run: RunContext,
    batch_plan: BatchPlan,
    *,
    dead_letters: Sequence[Mapping[str, Any]],
    writes: Sequence[Write],
) -> None:
    """Write a batch's rows and dead letters in a transaction that is always rolled back: raises what the
    database says about them (e.g. a value it refuses), changes nothing.  No epoch or offset check: this
    is a question about the rows, not a commit; a restarted partition's old dead letters are archived
    first, as the commit does."""
    batch_id, now = batch_plan.range.batch_id, store.now()
    with store.engine.connect() as conn:
        tx = conn.begin()
        try:
            _archive_gone_logs(conn, run, batch_plan, now)
            for write in writes:
                write_rows(conn, write.table, write.key, write.increments, write.rows)
            if dead_letters:
                conn.execute(schema.dead_letters.insert(), _dead_letter_rows(run, batch_id, dead_letters, now))
        finally:
            tx.rollback()


def _dead_letter_rows(
    run: RunContext, batch_id: int, dead_letters: Sequence[Mapping[str, Any]], now: float
) -> list[dict[str, Any]]:
    return [
        {**row, "job_id": run.job_id, "generation": run.generation, "batch_id": batch_id, "recorded_at": now}
        for row in dead_letters
    ]


def _empty_batch_committed(conn, run: RunContext, batch: BatchRange) -> bool:
    """Was this batch that read nothing committed already (Spark runs it again after a crash)?  Then it is
    the newest batch of the generation's ledger, recorded at the same positions; matched by position too
    because ledger ids can run ahead of Spark's (see ``_ledger_batch_id``)."""
    table = schema.batches
    mine = (table.c.job_id == run.job_id, table.c.generation == run.generation)
    newest = conn.execute(select(func.max(table.c.batch_id)).where(*mine)).scalar()
    if newest is None or newest < batch.batch_id:
        return False
    rows = conn.execute(
        select(table.c.topic, table.c.partition, table.c.start_offset, table.c.end_offset)
        .where(*mine, table.c.batch_id == newest)
    ).all()
    return all(r.start_offset == r.end_offset == batch.end.get((r.topic, r.partition)) for r in rows)


def _ledger_batch_id(conn, run: RunContext, batch_id: int) -> int:
    """Spark's batch id, unless this generation's ledger already holds it.  A lost checkpoint (or one
    restored from an older copy) numbers its batches again from 0 (or from the copy's last batch); the
    batches below the stored offsets are skipped as replays, but the first partly fresh one would reuse
    an id.  It takes the next free id instead: ledger ids stay unique and in commit order."""
    table = schema.batches
    last = conn.execute(
        select(func.max(table.c.batch_id)).where(table.c.job_id == run.job_id, table.c.generation == run.generation)
    ).scalar()
    if last is None or batch_id > last:
        return batch_id
    log.warning(
        "batch %s of generation %s: the ledger already holds batches up to %s, committed from an earlier "
        "state of the checkpoint (lost or restored from an older copy); the records past the stored offsets "
        "are applied once and recorded as ledger batch %s",
        batch_id, run.generation, last, last + 1,
    )
    return last + 1


def _record_restarts(conn, run: RunContext, batch_plan: BatchPlan, stored: Offsets, now: float) -> None:
    """A restarted partition's records from its stored offset to the end of the old log are gone: the job
    accepts that (failOnDataLoss=false), and the loss is recorded in the transaction that moves the stored
    offset back, so results, ledger and accepted losses still add up to the stored offsets."""
    for tp in sorted(batch_plan.restarted):
        position = stored.get(tp)
        if position is None:
            continue
        reason = (
            f"offsets went backwards: stored position {position}, the log now ends at "
            f"{batch_plan.range.end[tp]} (topic recreated or truncated); accepted: failOnDataLoss=false, "
            f"batch {batch_plan.range.batch_id} resumed the partition at its earliest offset"
        )
        log.warning("job %s %s-%s: %s", run.job_id, tp[0], tp[1], reason)
        conn.execute(
            schema.accepted_losses.insert().values(
                job_id=run.job_id, generation=run.generation, topic=tp[0], partition=tp[1],
                start_offset=position, end_offset=None, resume_offset=batch_plan.apply_from[tp],
                reason=reason, accepted_at=now,
            )
        )


def _archive_gone_logs(conn, run: RunContext, batch_plan: BatchPlan, now: float) -> None:
    """A restarted partition's old dead letters, from the new log's start on, move to the archive: the new
    log numbers its records from those positions again."""
    for tp in sorted(batch_plan.restarted):
        archive_dead_letters(conn, run.job_id, *tp, batch_plan.apply_from[tp], now)


def _check_epoch(conn, run: RunContext) -> None:
    if run.epoch is None:
        raise FencedError(
            f"[STREAM_RUN_FENCED] run {run.run_id} of job {run.job_id} is a dry run (an upgrade's preflight), "
            "which holds no epoch and may commit nothing: its batch was rejected and nothing was written."
        )
    current = conn.execute(
        select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == run.job_id).with_for_update()
    ).scalar()
    if current != run.epoch:
        raise FencedError(
            f"[STREAM_RUN_FENCED] run {run.run_id} of job {run.job_id} holds epoch {run.epoch} but the job's "
            f"current epoch is {current}: a newer driver took over, so this driver's batch was rejected and "
            f"nothing was written. Stop this driver; the newer run owns the job."
        )


def _advance_offsets(
    conn, run: RunContext, batch_id: int, stored: Offsets, new: Offsets, now: float, moved_back=frozenset()
) -> None:
    dialect = conn.dialect.name
    rows = []
    for tp, end in new.items():
        # invariant 2: offsets only move forward, except on a log that went backwards (recorded as a loss)
        if end < stored.get(tp, 0) and tp not in moved_back:
            raise AssertionError(f"stored offset of {tp} would move backwards: {stored[tp]} -> {end}")
        rows.append(
            {
                "job_id": run.job_id,
                "topic": tp[0],
                "partition": tp[1],
                "next_offset": end,
                "generation": run.generation,
                "batch_id": batch_id,
                "updated_at": now,
            }
        )
    if rows:
        conn.execute(_upsert(dialect, Write(schema.offsets, rows, ("job_id", "topic", "partition"))), rows)


def _upsert(dialect: str, write: Write):
    return upsert(dialect, write.table, write.key, write.increments)
