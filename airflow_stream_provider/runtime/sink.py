"""The transactional sink: a ``foreachBatch`` function that makes results exactly-once.

The job hands it the parsed records (Kafka provenance columns plus an ``error`` column that is null for
a good record) and a function from good records to result tables.  Per batch it reads the batch's
range from the offsets log, refuses the batch when the records Spark handed it lie outside that range
(the log does not describe what was read: storing its offsets would not match the results), drops
replayed records, computes the results with Spark, and commits results + dead letters + offsets +
ledger in one database transaction (see ``state.transaction``).  A batch that read nothing is no replay: a
stateful query's no-data batch emits what its state releases, and that is committed once too.

Write-behind (``write_behind``).  For a query that keeps no state, a batch of at least
``write_behind.MIN_RECORDS`` fresh records hands its transaction to a writer thread once its results are
computed, and the next batch reads and parses its records while that commit runs; it waits for the commit
before it plans.  A killed run can leave Spark's commit log ahead of the database by that batch: its mark
in the checkpoint makes the next run apply it from Kafka (``catch_up``) before the query starts.

Poison records.  A record the job's own code cannot handle (a UDF raises on it, an ANSI cast
overflows, the database refuses the row its results make) would otherwise fail the batch on every
restart.  When computing or committing a batch fails with such an error, the sink isolates the records
that cause it by bisection over the batch's offsets, running the job's code on halves: about
log2(batch size) evaluations per poison record.  Spark hands ``foreachBatch`` the stream's output
computed for the whole batch, so when the job's transform itself fails the sink reads the batch's
records again from Kafka (``read_raw``) and applies the transform to the chosen ones; when the results
or the commit fail, it splits the batch's already computed records.  Then, by the job's ``on_poison``
policy:

* ``dead_letter`` (default): each isolated record goes to the dead letters with the error as the
  reason, in the same transaction as the rest of the batch, and the stream goes on;
* ``fail``: the batch fails with ``[STREAM_POISON_RECORD] topic/partition:offset``.

The batch also fails with ``[STREAM_POISON_RECORD]`` when the record cannot be dead-lettered: its dead
letter is refused by the database, or the transform that fails on it keeps state (a stateful query's
batch cannot be completed without one of its records, nor outside the stream that holds its state: when
no record alone reproduces the failure, the batch fails with it).  The driver then ends with the POISON exit code
and the provider reports the position instead of restarting blindly.  A failure that is no record's
fault (the code fails on no data at all, or on no single record; an outage; more than
``MAX_POISON_PER_BATCH`` records) fails the batch as before.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.util import inheritable_thread_target
from sqlalchemy import MetaData, Table

from airflow_stream_provider import faults
from airflow_stream_provider.kafka_client import KafkaReadError
from airflow_stream_provider.kafka_offsets import Offsets
from airflow_stream_provider.runtime import write_behind
from airflow_stream_provider.runtime.batch_range import BatchRangeError, Bounds, span, stats
from airflow_stream_provider.runtime.checkpoint_log import OffsetLog
from airflow_stream_provider.runtime.poison import (
    MAX_POISON_PER_BATCH,
    MAX_REASON_CHARS,
    POISON_POLICIES,
    RAW_SCHEMA,
    NotIsolated,
    Poison,
    PoisonRecordError,
    PositionSpace,
    RawReader,
    Source,
    may_be_record_error,
    poison_error,
    positions,
    reason,
)
from airflow_stream_provider.runtime.result_tables import Result, table_for
from airflow_stream_provider.runtime.write_behind import REDO_DESCRIPTION, WriteBehind, WriteBehindUnapplied
from airflow_stream_provider.state import schema, transaction
from airflow_stream_provider.state.dialect import is_data_error
from airflow_stream_provider.state.store import StateStore, plain_text

log = logging.getLogger(__name__)

PROVENANCE = ("topic", "partition", "offset")
DEAD_LETTER_COLUMNS = ("topic", "partition", "offset", "key", "value", "error")
TopicPartition = transaction.TopicPartition


ResultsFn = Callable[[DataFrame], Sequence[Result]]


@dataclass
class _Computed:
    """One batch (or part of one) evaluated, nothing written yet."""

    read: dict[TopicPartition, int] = dataclasses.field(default_factory=dict)
    dead: list[dict] = dataclasses.field(default_factory=list)
    writes: list[transaction.Write] = dataclasses.field(default_factory=list)


class TransactionalSink:
    """The ``foreachBatch`` function that makes a stream job's results exactly-once.

    For each micro-batch it reads the batch's offset range from the checkpoint's offsets log, drops the
    records the stored offsets say were applied already (Spark replays a batch after a crash), computes
    the job's result tables, and commits results, dead letters, the batch ledger and the new stored
    offsets in ONE database transaction that only the run holding the job's epoch can make
    (:func:`airflow_stream_provider.state.transaction.commit`).  A record the job's code fails on is
    isolated and dead-lettered or fails the run, by ``on_poison`` (see the module docstring).

    A job file does not build it: :class:`~airflow_stream_provider.runtime.harness.StreamHarness` does,
    from the job's spec and its ``results`` function, and a job only returns
    :class:`~airflow_stream_provider.runtime.result_tables.Result` tables::

        def results(events: DataFrame) -> list[Result]:
            return [Result("events", events.select(...), key=("event_id",)),
                    Result("kpi_minute", per_minute, key=("user_id", "minute"),
                           increments=("event_count", "amount_cents"))]

        sys.exit(StreamHarness.from_argv().run(parse, results))

    The harness then starts ``records.writeStream.foreachBatch(sink)``; Spark calls
    ``sink(records, batch_id)`` once per micro-batch.

    :param store: the state database, which also holds the result tables.
    :param run: this driver's run: job, run id, fencing epoch and checkpoint generation.
    :param offset_log: the checkpoint's offsets log, read for each batch's range.
    :param generation_start: where the generation's batch 0 starts, per partition.
    :param results: turns a batch's good records into result tables.
    :param dry_run: compute every batch in full but write nothing (an upgrade's preflight).
    :param after_commit: called with each committed batch's outcome (the harness records progress).
    :param on_poison: ``dead_letter`` (default) or ``fail``: what to do with a record the job's code or the
        database refuses.
    :param transform: the job's parsing, as applied to the stream; with ``read_raw`` it lets the sink run
        the job's code again on chosen records of a batch, which poison isolation needs when that code
        fails inside the stream.
    :param read_raw: reads a partition's offset range from Kafka again (see ``transform``).
    :param stateful: whether the query keeps state; then a batch cannot be completed without one of its
        records, and a poison record stops the job.
    :param behind: commits a query's large batches while Spark reads the next one (``write_behind``); used
        for a query without state that gives ``transform`` and ``read_raw``.
    """

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
        on_poison: str = "dead_letter",
        transform: Callable[[DataFrame], DataFrame] | None = None,
        read_raw: RawReader | None = None,
        stateful: bool = True,
        behind: WriteBehind | None = None,
    ):
        if on_poison not in POISON_POLICIES:
            raise ValueError(f"on_poison={on_poison!r} is not one of {', '.join(POISON_POLICIES)}")
        self.store = store
        self.run = run
        self.offset_log = offset_log
        self.generation_start = generation_start
        self.results = results
        self.dry_run = dry_run
        self.after_commit = after_commit
        self.on_poison = on_poison
        self.transform = transform
        self.read_raw = read_raw
        self.stateful = stateful
        #: the writer that commits large batches while the next one is read: for a query without state only,
        #: which ``catch_up`` can apply again from Kafka
        self.behind = behind if (not stateful and not dry_run and transform is not None and read_raw is not None) \
            else None
        #: the checkpoint's write-behind marks, which a killed run may have left whatever this run's query:
        #: applied, or named, before it plans against the stored offsets
        self.marks = behind.marks if behind is not None and not dry_run else None
        self._tables: dict[str, Table] = {}
        self._metadata = MetaData()
        self._outputs: list[str] = []
        #: where the recent batches' time went, by batch id (the listener adds it to the progress record)
        self.clocks: dict[int, BatchClock] = {}
        #: write-behind marks whose batch the offsets log no longer holds (``catch_up``), each with the position
        #: the stored offsets must reach to show that it landed (``_landed_by``): kept, and named by a gap,
        #: until they do
        self._unmatched_marks: dict[int, Offsets | None] = {}

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        faults.maybe_crash("batch_start", batch_id)
        clock = self.clocks[batch_id] = BatchClock()
        while len(self.clocks) > KEEP_CLOCKS:  # the listener reads a batch's clock just after it ends
            del self.clocks[next(iter(self.clocks))]
        batch = self._batch_range(batch_id)
        handed = records.persist()
        try:
            read_ahead = None
            if self.behind is not None:
                self.behind.next_batch_started()
                if self.behind.in_flight is not None:  # read and parse while the previous batch commits
                    read_ahead = self._read_ahead(handed)
                    clock.lap("read_parse")
                self._settle()
                clock.lap("wait_write")
            if self.dry_run:  # a preflight replays a committed batch on purpose: run all of it, write nothing
                plan = transaction.whole_batch(batch)
            else:
                plan = self._plan(batch)
                clock.lap("plan")
                # A batch that read nothing is no replay: a stateful query's no-data batch (run to move the
                # watermark) emits what its state releases (outer-join rows, closed windows, timers).
                if plan.is_replay and not batch.is_empty:
                    self._evaluate_replay(handed, plan)
                    clock.lap("replay")
                    log.info("batch %s is a replay of committed offsets: skipped", batch_id)
                    return
            outcome = self._apply(handed, plan, clock, read_ahead=read_ahead)
        finally:
            handed.unpersist()
            clock.lap("release")
        if outcome is not None and self.after_commit is not None:
            self.after_commit(outcome)

    # -- write-behind (see ``write_behind``) -----------------------------------------------------------
    def catch_up(self) -> None:
        """Before the query starts: apply the batches a killed driver handed to its writer and Spark may
        have logged as done, from Kafka, if the stored offsets still stop at their start.  A marked batch
        that landed, or that Spark has not logged (it runs it again), is skipped as a replay.  A run that
        commits in line (its query keeps state, or reads a stream the sink cannot read again) cannot apply
        one: it refuses to start on a batch that did not land and that Spark will not run again."""
        if self.marks is None:
            return
        for batch_id in self.marks.marked():
            if self.offset_log.source_offsets(batch_id) is None or (
                    batch_id > 0 and self.offset_log.source_offsets(batch_id - 1) is None):
                # Spark purged the batch's entries (a mark whose removal failed, long ago): it landed, or
                # the stored offsets lag the checkpoint and a batch's gap check says so
                landed_by = self._landed_by(batch_id)
                if _passed(self.store.stored_offsets(self.run.job_id), landed_by):
                    log.info("write-behind mark of batch %s: the stored offsets are past it, so it landed",
                             batch_id)
                    write_behind.clear_mark(self.marks, batch_id)
                    continue
                log.warning("write-behind mark of batch %s: the offsets log no longer holds the batch, which "
                            "cannot be applied from it; the mark goes once the stored offsets pass %s",
                            batch_id, landed_by)
                self._unmatched_marks[batch_id] = landed_by
            elif self.behind is None:
                self._settle_mark_in_line(batch_id)
            else:
                log.warning("batch %s was handed to the writer of a run that ended before its commit was "
                            "known; applying it again from Kafka if the database does not hold it", batch_id)
                try:
                    self._redo(batch_id)
                except KafkaReadError as err:
                    raise KafkaReadError(
                        f"{err} (reading write-behind batch {batch_id} again before the query starts: a run "
                        f"that ended before its commit was known handed it to its writer, and Spark logged it "
                        f"as done; nothing was written. Once Kafka serves the range, the next start applies "
                        f"it; if its records left Kafka, only a reset to a new generation from the stored "
                        f"offsets with the loss accepted goes on)") from err
                write_behind.clear_mark(self.marks, batch_id)

    def _landed_by(self, batch_id: int) -> Offsets | None:
        """Where the stored offsets show that ``batch_id``, whose range the offsets log lost, landed: the end
        of the oldest batch the log holds from it on, which is at or past the lost batch's end on every
        partition.  None where the log holds no batch."""
        held = [entry for entry in self.offset_log.batch_ids() if entry >= batch_id]
        return self.offset_log.source_offsets(held[0]) if held else None

    def _settle_mark_in_line(self, batch_id: int) -> None:
        """A mark a run that commits in line finds: a version that wrote behind left it.  The batch landed, or
        Spark runs it again (``commits/N`` missing) and this run applies it in line: the mark goes.  Else it
        is a gap this run cannot close, found here before anything is written rather than at the first
        batch, which plans no gap on a partition it reads nothing from."""
        batch = self._batch_range(batch_id)
        plan = transaction.plan(self.store, self.run.job_id, batch)
        if plan.is_replay or not self.offset_log.batch_done(batch_id):
            write_behind.clear_mark(self.marks, batch_id)
            return
        why = "keeps state" if self.stateful else "reads a second stream"
        missing = ", ".join(f"{t}-{p} [{plan.apply_from[(t, p)]}, {batch.end[(t, p)]})"
                            for t, p in sorted(plan.apply_from) if plan.apply_from[(t, p)] < batch.end[(t, p)])
        raise WriteBehindUnapplied(
            f"[STREAM_WRITE_BEHIND_UNAPPLIED] job {self.run.job_id} batch {batch_id}: a run that wrote behind "
            f"handed the batch to its writer and ended before its commit was known; Spark logged the batch as "
            f"done, and the database does not hold it ({missing}). This run's query {why}, so it commits every "
            f"batch in line and cannot apply a batch from Kafka outside the stream. Nothing was written and "
            f"the stored offsets did not move: reset the job to a new generation from the stored offsets, "
            f"which reads these records again (none is lost while Kafka holds them).")

    def _plan(self, batch: transaction.BatchRange) -> transaction.BatchPlan:
        """The batch's plan against the stored offsets.  A gap names the write-behind marks ``catch_up``
        could not apply, a possible cause; a plan without one shows their batches landed."""
        try:
            plan = transaction.plan(self.store, self.run.job_id, batch)
        except transaction.OffsetGapError as gap:
            if not self._unmatched_marks:
                raise
            marks = ", ".join(map(str, sorted(self._unmatched_marks)))
            raise transaction.OffsetGapError(
                f"{gap} The checkpoint holds a write-behind mark of batch(es) {marks} whose range the "
                f"offsets log no longer holds: if that batch never landed, it is the gap (handed to a writer "
                f"whose commit was never confirmed, it can no longer be applied from the checkpoint)."
            ) from gap
        # Without a gap here, the stored offsets may still stop short of a lost batch on a partition this batch
        # reads nothing from: only reaching its position shows that it landed.
        for batch_id, landed_by in list(self._unmatched_marks.items()):
            if landed_by is None or _passed(plan.stored, landed_by):
                write_behind.clear_mark(self.marks, batch_id)
                del self._unmatched_marks[batch_id]
        return plan

    def flush(self) -> None:
        """Wait for the batch in flight (after the query stopped): its results are in the database when
        this returns, or it raises why not (the mark stays for the next run)."""
        if self.behind is not None:
            self._settle()

    def write_failure(self) -> BaseException | None:
        """Why the batch in flight could not commit, once it failed (the run then fails as a synchronous
        commit's failure would fail it; the mark stays for the next run)."""
        return self.behind.failure() if self.behind is not None else None

    def _settle(self) -> None:
        settled = self.behind.settle()
        if settled is not None and settled[1] is not None:
            log.error("batch %s: its commit in the writer failed (%r); the batch stays marked for the job's "
                      "next run", *settled)
            raise settled[1]

    def _redo(self, batch_id: int) -> transaction.BatchOutcome | None:
        """Apply a batch whose frame is gone, synchronously: its range from the offsets log, its records
        from Kafka, the job's transform and results as in the stream."""
        batch = self._batch_range(batch_id)
        plan = self._plan(batch)
        if plan.is_replay:
            return None
        handed = self.transform(self._raw_frame(plan)).persist()
        try:
            outcome = self._apply(handed, plan, BatchClock(), behind=False)
        finally:
            handed.unpersist()
        if outcome is not None and self.after_commit is not None:
            self.after_commit(outcome)
        return outcome

    def _read_ahead(self, handed: DataFrame) -> pa.Table | None:
        """The batch's positions (``_tally``'s Spark job), taken while the previous batch commits.  None
        when the job's code fails on a record: the batch then goes the usual way, isolation included."""
        try:
            return _positions(handed)
        except Exception as err:
            if not may_be_record_error(err):
                raise
            return None

    def _evaluate_replay(self, records: DataFrame, plan: transaction.BatchPlan) -> None:
        """Nothing to apply, but a stateful query's state stores commit only when every partition of the
        batch is evaluated (Spark 4 fails the query otherwise): run it, keep only the records' positions
        to check them against the batch's range.  A stateless query needs no evaluation, so a record that
        fails the job's code again (a poison record dead-lettered when the batch first ran) does not
        stop it."""
        try:
            table = _arrow(records.select(*PROVENANCE))
        except Exception as err:
            if self.stateful or not may_be_record_error(err):
                raise
            log.warning("replayed batch %s fails in the job's code (%s); it is committed and the query keeps "
                        "no state: nothing to evaluate", plan.range.batch_id, reason(err))
            return
        # a log rewritten to end below the stored offsets makes a batch look committed: the records it
        # holds beyond that end would be skipped for good
        Bounds(plan, self.stateful).check(span(table), self.run.job_id)

    def _batch_range(self, batch_id: int) -> transaction.BatchRange:
        end = self.offset_log.source_offsets(batch_id)
        if end is None:
            raise self._missing_entry(batch_id, batch_id, "where the batch ends")
        if batch_id == 0:  # only batch 0 starts where the generation starts
            return transaction.BatchRange(batch_id, self.generation_start, end)
        start = self.offset_log.source_offsets(batch_id - 1)
        if start is None:  # the generation's start would make the batch claim records it never read
            raise self._missing_entry(batch_id, batch_id - 1, "where the batch starts")
        return transaction.BatchRange(batch_id, start, end)

    def _missing_entry(self, batch_id: int, entry: int, role: str) -> BatchRangeError:
        return BatchRangeError(
            f"[STREAM_OFFSET_LOG_MISSING] job {self.run.job_id} batch {batch_id}: offsets log entry "
            f"offsets/{entry} ({role}) is missing from {self.offset_log.path}, so the sink cannot tell which "
            f"records the batch holds; nothing was written and the stored offsets did not move. Restore the "
            f"entry from a copy of the checkpoint, or reset the job to a new generation from the stored "
            f"offsets."
        )

    # -- one batch: compute, commit, isolate poison records when either fails on a record ---------------
    def _apply(
        self,
        handed: DataFrame,
        plan: transaction.BatchPlan,
        clock: BatchClock,
        *,
        read_ahead: pa.Table | None = None,
        behind: bool = True,
    ) -> transaction.BatchOutcome | None:
        """``handed`` is persisted: its first evaluation runs the job's transform on the batch (inside the
        stream: Spark hands ``foreachBatch`` the stream's output) and keeps the result.  ``read_ahead``:
        its positions, taken already; ``behind``: the commit may go to the writer (then None is returned,
        and the writer reports the outcome)."""
        batch_id = plan.range.batch_id
        bounds = Bounds(plan, self.stateful)
        poison: list[Poison] = []
        fresh = bounds.select(handed)
        source: Source = Source(fresh.where)
        try:
            tally = _tally(handed, bounds, read_ahead)
        except Exception as err:  # the job's transform failed inside the stream
            if not may_be_record_error(err):
                raise
            source = self._raw_source(fresh, plan, err)
            if self.stateful:
                blamed = self._blame_in_state(source, plan, err)
                if blamed is None:
                    raise
                raise blamed from err
            poison, computed = self._isolate(source, plan, err, trial_write=False, in_transform=True)
        else:
            clock.lap("read_parse")
            bounds.check(tally.span, self.run.job_id)  # before anything is computed from the records
            try:
                computed = self._compute(fresh, bounds, tally)
                clock.lap("results")
            except Exception as err:  # the job's results failed on the batch's records
                if not may_be_record_error(err):
                    raise
                poison, computed = self._isolate(source, plan, err, trial_write=False)
        if self.dry_run:
            log.info(
                "dry run: batch %s computed %s result rows, %s dead letters, %s poison records; nothing "
                "written",
                batch_id,
                sum(len(w.rows) for w in computed.writes),
                len(computed.dead),
                len(poison),
            )
            return transaction.BatchOutcome(batch_id, read=computed.read)
        if plan.is_replay and not poison and not computed.dead and not any(w.rows for w in computed.writes):
            log.info("batch %s read nothing and its state released nothing: nothing to commit", batch_id)
            return None
        letters = self._poison_letters(source, poison)
        clock.lap("isolate")  # nothing unless a record failed the job's code
        faults.maybe_crash("before_db_commit", batch_id)
        if behind and self._goes_behind(plan, computed):
            phases, started = dict(clock.phases), clock.started  # the clock stays with this thread
            self.behind.hand_over(batch_id, lambda: self._land(plan, computed, letters, poison, phases, started))
            return None
        try:
            outcome = self._commit(plan, computed, letters, clock.started)
        except Exception as err:
            if not is_data_error(err):
                raise
            if poison and self._trial_write(plan, computed) is None:
                # the batch is fine without the poison records' dead letters: those are what the
                # database refuses
                raise poison_error(poison, f"its dead letter could not be written: {reason(err)}") from err
            try:
                more, computed = self._isolate(source, plan, err, trial_write=True, known=poison)
            except Exception as failed:
                if poison and is_data_error(failed):
                    raise poison_error(poison, f"its dead letter could not be written: {reason(failed)}") \
                        from failed
                raise
            poison += more
            letters += self._poison_letters(source, more)
            try:
                outcome = self._commit(plan, computed, letters, clock.started)
            except Exception as again:
                if poison and is_data_error(again):
                    raise poison_error(poison, f"its dead letter could not be written: {reason(again)}") \
                        from again
                raise
        clock.lap("commit")
        clock.split("commit", "write", outcome.write_s)
        faults.maybe_crash("after_db_commit", batch_id)
        _log_committed(outcome, poison, clock.phases)
        return outcome

    def _blame_in_state(self, source: Source, plan: transaction.BatchPlan, failure: Exception) -> Exception | None:
        """The transform of a query that keeps state failed on its batch.  The batch's state is the stream's:
        results computed from the batch's records outside the stream hold none of it, and Spark would find
        no state for the batch, so nothing but the stream may complete it.  What isolation can still do is
        name a record that alone reproduces the failure (POISON, its position); None: the failure itself
        ends the batch, and the restart's stream runs it again."""
        batch_id = plan.range.batch_id
        try:
            poison, _ = self._isolate(source, plan, failure, trial_write=False, in_transform=True)
        except PoisonRecordError as named:  # the job's policy is on_poison='fail'
            return named
        except Exception as err:
            if err is not failure:  # the job's code cannot run outside the stream (applyInPandasWithState)
                log.warning("batch %s: the record it fails on cannot be looked for outside the stream: %s",
                            batch_id, reason(err))
            return None
        if poison:
            return poison_error(poison, "the query keeps state, so its batch cannot be completed without the "
                                "record")
        log.warning("batch %s: no record reproduces the failure outside the stream%s, and a query that keeps "
                    "state completes a batch only inside it: the batch fails", batch_id, _unsearched(plan))
        return None

    def _goes_behind(self, plan: transaction.BatchPlan, computed: _Computed) -> bool:
        """Large fresh batches of a query without state; not a batch that moves a stored offset back."""
        return (self.behind is not None and not plan.restarted
                and sum(computed.read.values()) >= write_behind.MIN_RECORDS)

    def _land(self, plan: transaction.BatchPlan, computed: _Computed, letters: list[dict], poison: list[Poison],
              phases: dict[str, float], started: float) -> transaction.BatchOutcome | None:
        """The writer thread's commit of a batch handed over.  The batch's clock belongs to the stream thread
        and the listener: the commit's seconds go to the log line only."""
        began = time.perf_counter()
        try:
            outcome = self._commit(plan, computed, letters, started)
        except Exception as err:
            if not is_data_error(err):
                raise
            # the database refuses a record's results: isolate it as a synchronous commit would, on the
            # batch's records read again (its frame is gone); the next batch waits for this
            log.warning("batch %s: the database refused its commit (%s); applying it again from Kafka, "
                        "isolating the record(s) it refuses", plan.range.batch_id, reason(err))
            # This plain thread's own JVM thread (pinned-thread mode) carries no job group, so a stop does
            # not cancel the redo (see REDO_DESCRIPTION): keep it so, not an InheritableThread.
            context = SparkSession.active().sparkContext
            context.setJobDescription(REDO_DESCRIPTION.format(batch_id=plan.range.batch_id))
            try:
                return self._redo(plan.range.batch_id)
            finally:
                context.setLocalProperty("spark.job.description", None)
        faults.maybe_crash("after_db_commit", plan.range.batch_id)
        commit_s = time.perf_counter() - began
        _log_committed(outcome, poison, {**phases, "write_behind": round(outcome.write_s, 4),
                                         "commit_behind": round(commit_s - outcome.write_s, 4)})
        if self.after_commit is not None:
            self.after_commit(outcome)
        return outcome

    def _compute(self, frame: DataFrame, bounds: Bounds, tally: _Tally | None = None) -> _Computed:
        """Evaluate records: counts, dead letters, result rows.  Nothing is written."""
        tally = _tally(frame, bounds) if tally is None else tally
        good = frame.where(F.col("error").isNull())
        return _Computed(tally.read, tally.dead, self._writes(self.results(good)))

    def _commit(
        self, plan: transaction.BatchPlan, computed: _Computed, letters: list[dict], started_at: float
    ) -> transaction.BatchOutcome:
        """Commit the batch; ``letters`` are the dead letters of isolated poison records, which the
        computation left out: they count as read.  ``started_at``: when the driver began the batch."""
        read = dict(computed.read)
        for row in letters:
            tp = (row["topic"], row["partition"])
            read[tp] = read.get(tp, 0) + 1
        return transaction.commit(
            self.store, self.run, plan, read=read, dead_letters=computed.dead + letters, writes=computed.writes,
            started_at=started_at,
        )

    def _trial_write(self, plan: transaction.BatchPlan, computed: _Computed) -> Exception | None:
        """Write the rows in a transaction that is rolled back: does the database accept them?"""
        try:
            transaction.trial_write(
                self.store, self.run, plan, dead_letters=computed.dead, writes=computed.writes
            )
        except Exception as err:
            if not is_data_error(err):
                raise
            return err
        return None

    # -- isolation --------------------------------------------------------------------------------------
    def _raw_source(self, fresh: DataFrame, plan: transaction.BatchPlan, failure: Exception) -> Source:
        """The batch's fresh records read again from Kafka, with the job's transform applied to the chosen
        ones only: the stream's own output cannot be split, as Spark runs the transform for all of a
        batch before ``foreachBatch`` sees it."""
        if self.transform is None or self.read_raw is None:
            log.warning("batch %s: the sink has no transform to run again on chosen records (a transform that "
                        "reads a stream of its own cannot be), so the record it fails on is not looked for",
                        plan.range.batch_id)
            raise failure
        rows = self._raw_rows(plan)
        raw = fresh.sparkSession.createDataFrame(rows, RAW_SCHEMA)
        return Source(lambda condition: self.transform(raw.where(condition)),
                       {(r[0], r[1], r[2]): (r[3], r[4]) for r in rows})

    def _raw_rows(self, plan: transaction.BatchPlan) -> list[tuple]:
        return [
            row
            for topic, partition, first, end in PositionSpace(plan).ranges
            for row in self.read_raw(topic, partition, first, end)
        ]

    def _raw_frame(self, plan: transaction.BatchPlan) -> DataFrame:
        """The batch's fresh records read from Kafka again, with the source's columns."""
        return SparkSession.active().createDataFrame(self._raw_rows(plan), RAW_SCHEMA)

    def _isolate(
        self,
        source: Source,
        plan: transaction.BatchPlan,
        failure: Exception,
        *,
        trial_write: bool,
        known: Sequence[Poison] = (),
        in_transform: bool = False,
    ) -> tuple[list[Poison], _Computed]:
        """Find the records the failure comes from; return them and the batch computed without them.
        ``in_transform``: the failure came from the job's transform, so probing it is enough at first.

        Raises ``failure`` itself when it is not a record's fault, and PoisonRecordError when the
        policy says to fail on a poison record.
        """
        batch_id = plan.range.batch_id
        space = PositionSpace(plan)
        bounds = Bounds(plan, self.stateful)
        log.warning(
            "batch %s failed while %s (%s); isolating the record(s) it fails on among %s positions",
            batch_id,
            "committing" if trial_write else "computing",
            reason(failure),
            space.size,
        )
        started, original = time.monotonic(), failure
        found: list[Poison] = list(known)
        evaluations = 0

        def probe(condition: Column, full: bool = True) -> tuple[_Computed | None, Exception | None]:
            """Evaluate the job's code on the records ``condition`` selects (minus those found so far).
            ``full``: compute everything a commit needs (and try writing it); else only run the code."""
            nonlocal evaluations
            evaluations += 1
            if found:
                condition = condition & ~positions([(p.topic, p.partition, p.offset) for p in found])
            frame = source.select(condition).persist()
            try:
                if full:
                    computed = self._compute(frame, bounds)
                else:  # run every column of the transform (and of each result), keep nothing
                    computed = None
                    frame.write.format("noop").mode("overwrite").save()
                    for result in [] if in_transform else self.results(frame.where(F.col("error").isNull())):
                        result.frame.write.format("noop").mode("overwrite").save()
            except Exception as err:
                if not may_be_record_error(err):
                    raise
                return None, err
            finally:
                frame.unpersist()
            if trial_write and computed is not None:
                refused = self._trial_write(plan, computed)
                if refused is not None:
                    return None, refused
            return computed, None

        try:
            if probe(F.lit(False), full=trial_write)[1] is not None:
                raise NotIsolated("the job's code fails on no records at all: its code, not its data")
            while True:
                lo, hi, error, verified = 0, space.size, failure, False
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    _, left = probe(space.slice(lo, mid), full=trial_write)
                    if left is not None:
                        hi, error, verified = mid, left, True
                    else:
                        lo, verified = mid, False
                if not verified:
                    _, error = probe(space.slice(lo, hi), full=trial_write)
                if error is None:
                    if len(found) == len(known):
                        # nothing fails among the fresh records: the failure came from records of the batch
                        # that are committed already (a partly replayed batch), or did not happen again
                        computed, failure = probe(F.lit(True))
                        if computed is not None:
                            break
                    raise NotIsolated(f"no single record reproduces the failure{_unsearched(plan)}")
                topic, partition, offset = space.position(lo)
                cause = "the database refused this record's results" if trial_write else \
                    "the job's code failed on this record"
                record = Poison(topic, partition, offset, f"{cause}: {reason(error)}")
                found.append(record)
                log.warning("batch %s: record %s fails the job: %s", batch_id, record.position, record.reason)
                if self.on_poison == "fail":
                    raise poison_error([record], "the job's policy is on_poison='fail'")
                if len(found) - len(known) > MAX_POISON_PER_BATCH:
                    raise NotIsolated(
                        f"more than {MAX_POISON_PER_BATCH} records of the batch fail: its code, not its data"
                    )
                computed, failure = probe(F.lit(True))
                if computed is not None:
                    break
                in_transform = False  # what fails now may be the results
        except NotIsolated as why:
            log.warning("batch %s: %s after %s evaluations; failing the batch", batch_id, why, evaluations)
            raise original from None
        new = found[len(known):]
        log.warning(
            "batch %s: %s in %s evaluations (%.1fs)",
            batch_id,
            f"isolated {', '.join(p.position for p in new)}" if new else "the batch's fresh records compute "
            "without failing",
            evaluations,
            time.monotonic() - started,
        )
        return new, computed

    def _poison_letters(self, source: Source, poison: Sequence[Poison]) -> list[dict]:
        """Dead letters for isolated records: their raw key and value, taken without the job's code."""
        if not poison:
            return []
        reasons = {(p.topic, p.partition, p.offset): p.reason for p in poison}
        if source.raw is not None:
            rows = [{"topic": t, "partition": p, "offset": o, "key": source.raw[(t, p, o)][0],
                     "value": source.raw[(t, p, o)][1]} for (t, p, o) in reasons]
        else:
            try:
                rows = _collect(source.select(positions(list(reasons))).select(*PROVENANCE, "key", "value"))
            except Exception as err:
                raise poison_error(list(poison), f"its raw key and value could not be read: {reason(err)}") \
                    from err
        # one per record: a transform's output may hold several rows of one record
        by_position = {(row["topic"], row["partition"], row["offset"]): row for row in rows}
        return [_dead_letter({**row, "error": reasons[at]}) for at, row in by_position.items()]

    # -- result tables ----------------------------------------------------------------------------------
    def _writes(self, results: Sequence[Result]) -> list[transaction.Write]:
        """Collect every result frame as an Arrow table, which the database write takes as it is (no
        Python object per row).  They are independent Spark jobs over the persisted batch, so they run
        side by side: a micro-batch waits for the slowest, not for the sum (most of a small job is the
        driver planning it and the scheduler's round trips, which overlap)."""
        tables = [self._table(result) for result in results]  # DDL once, before any thread
        self._record_outputs()
        if len(results) > 1:
            # pinned threads: each job carries the stream thread's job group, so stopping the query
            # cancels them like any job of the batch
            collect = inheritable_thread_target(_arrow)
            with ThreadPoolExecutor(max_workers=len(results), thread_name_prefix="stream-results") as pool:
                rows = list(pool.map(collect, [result.frame for result in results]))
        else:
            rows = [_arrow(result.frame) for result in results]
        return [
            transaction.Write(table, batch_rows, tuple(result.key), tuple(result.increments))
            for table, batch_rows, result in zip(tables, rows, results, strict=True)
        ]

    def _record_outputs(self) -> None:
        """Name the tables this run writes (its result tables and the dead letters) on the run, for
        lineage, whenever a new one appears.  A failure costs the lineage, never the batch."""
        names = sorted({*self._tables, schema.dead_letters.name})
        if names == self._outputs:
            return
        try:
            self.store.record_outputs(self.run.run_id, names)
            self._outputs = names
        except Exception as err:
            log.warning("could not record the run's result tables (lineage): %r", err)

    def _table(self, result: Result) -> Table:
        """The SQL table for a result, created from the frame's Spark schema on first use."""
        table = self._tables.get(result.table)
        if table is None:
            table = table_for(result, self._metadata)
            if not self.dry_run:
                self.store.ensure_table(table)
            self._tables[result.table] = table
        return table


#: Batch clocks kept for the listener, which reads one just after its batch ends.
KEEP_CLOCKS = 8


class BatchClock:
    """Where one batch's time goes in the sink, in seconds per phase: ``plan`` (offsets log and stored
    offsets), ``read_parse`` (Spark reads the records and runs the job's transform, positions come back),
    ``results`` (the job's results, computed and collected), ``isolate`` (poison records), ``write`` (rows
    into the database), ``commit`` (the rest of the transaction), ``release`` (unpersist)."""

    def __init__(self):
        self.started = time.time()
        self._mark = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        """The time since the previous lap goes to ``phase``."""
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._mark, 4)
        self._mark = now

    def split(self, phase: str, part: str, seconds: float) -> None:
        """``seconds`` of ``phase`` were ``part``."""
        seconds = min(seconds, self.phases.get(phase, 0.0))
        self.phases[part] = round(seconds, 4)
        self.phases[phase] = round(self.phases[phase] - seconds, 4)


@dataclass(frozen=True)
class _Tally:
    read: dict[TopicPartition, int]
    dead: list[dict]
    #: lowest and highest offset per partition among all rows handed to the batch
    span: dict[TopicPartition, tuple[int, int]]


def _tally(frame: DataFrame, bounds: Bounds, table: pa.Table | None = None) -> _Tally:
    """Records per partition, the dead letters and each partition's offset span, from the frame's
    ``_positions`` (``table``, when taken already).  Counts and dead letters cover the rows the sink
    applies (``bounds``)."""
    table = _positions(frame) if table is None else table
    found = stats(table, "count", "min", "max")
    kept = table.filter(bounds.mask(table)) if bounds.needs_filter else table
    counts = stats(kept, "count") if bounds.needs_filter else found
    read = {tp: row["offset_count"] for tp, row in counts.items()}
    dead = kept.filter(pc.is_valid(kept["error"])).to_pylist()
    return _Tally(read, [_dead_letter(row) for row in _one_per_position(dead)], span(table, found))


def _passed(stored: Offsets, position: Offsets | None) -> bool:
    """The stored offsets are at or past ``position`` on each of its partitions; one never committed
    counts as past, as the gap check takes it (a batch applies it from its own start)."""
    return position is not None and all(stored.get(tp) is None or stored[tp] >= end
                                        for tp, end in position.items())


def _one_per_position(rows: Sequence[dict]) -> list[dict]:
    """One dead letter per record, with each of its rows' errors: a transform that makes several rows of a
    record (an explode, a join) may give a malformed one several error rows, and dead letters are keyed by
    position; the second would fail the commit, and then the record's isolation, as POISON."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        at = (row["topic"], row["partition"], row["offset"])
        error = str(row["error"])
        if at not in merged:
            merged[at] = {**row, "error": error}
        elif error not in merged[at]["error"].split("; "):
            merged[at]["error"] += "; " + error
    return list(merged.values())


def _positions(frame: DataFrame) -> pa.Table:
    """Each record's position, its raw key and value only when it is malformed, and its error: one Spark
    job without a shuffle.  Evaluating it runs the job's transform on every record of the batch, so a
    transform that fails on a record fails here."""
    bad = F.col("error").isNotNull()
    raw = (F.when(bad, F.col(c)).alias(c) for c in ("key", "value"))
    return _arrow(frame.select(*PROVENANCE, *raw, "error"))


def _log_committed(outcome: transaction.BatchOutcome, poison: Sequence[Poison], phases: dict[str, float]) -> None:
    if outcome.skipped_replay:  # a batch that read nothing, run again after it was committed
        log.info("batch %s read nothing and was committed already: skipped", outcome.batch_id)
        return
    log.info(
        "batch %s committed: read %s, dead %s%s, offsets %s; seconds %s",
        outcome.batch_id,
        sum(outcome.read.values()),
        sum(outcome.dead.values()),
        f" (poison {', '.join(p.position for p in poison)})" if poison else "",
        outcome.committed_offsets,
        phases,
    )


def _dead_letter(row: dict) -> dict:
    """A dead-letter row as the table takes it: raw bytes as they are, the reason as plain text."""
    error = plain_text(str(row["error"]))
    if len(error) > MAX_REASON_CHARS:
        error = error[: MAX_REASON_CHARS - 3] + "..."
    return {**row, "error": error}


def _collect(frame: DataFrame) -> list[dict]:
    """The frame's rows as dicts, through Arrow: several times faster than ``collect()``'s pickled Rows.
    Timestamps come back naive in UTC (the session time zone), as ``collect()`` would give them."""
    return _arrow(frame).to_pylist()


def _arrow(frame: DataFrame) -> pa.Table:
    table = frame.toArrow()
    for index, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type) and field.type.tz is not None:
            table = table.set_column(index, field.name, pc.cast(table.column(index), pa.timestamp(field.type.unit)))
    return table


def _unsearched(plan: transaction.BatchPlan) -> str:
    """For a batch replayed in part, that isolation searched its fresh records only: the failure may come
    from a record committed before the restart, which the batch reads again but never applies."""
    if not plan.replayed:
        return ""
    return (f" among the batch's records not yet committed (its {plan.replayed} records committed before the "
            "restart are not searched, and the failure may come from one of them)")
