"""Write-behind: a large batch's database commit runs while Spark reads the next batch.

Micro-batch execution runs a batch's reading and its ``foreachBatch`` in turn, so while the driver writes
a batch's results the JVM waits, and while Spark reads the next one the database does.  For a query that
keeps no state the sink overlaps the two: batch N's ``foreachBatch`` computes its results, marks the batch
(``WriteBehindMarks``), hands the transaction to one writer thread and returns; batch N+1 reads and parses
its records while N commits, and waits for N's commit before it plans against the stored offsets.  One
batch at most is in flight, and the transaction is the same one a synchronous commit makes.

What a killed driver leaves: Spark may have logged batch N as done (``commits/N``) while the database
does not hold it.  The mark says so; the next run applies N from Kafka before its query starts
(``TransactionalSink.catch_up``).  Without a mark, stored offsets behind the checkpoint stay
``[STREAM_OFFSET_GAP]``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from airflow_stream_provider import faults
from airflow_stream_provider.runtime.checkpoint_log import WriteBehindMarks

log = logging.getLogger(__name__)

#: Fewest fresh records for a batch's commit to go behind.  A smaller batch's write takes milliseconds:
#: overlapping it gains nothing and would only delay its results; a backlog's batches are the ones to
#: pipeline.
MIN_RECORDS = 20_000

#: The Spark jobs of a batch the database refused behind, applied again in the writer thread (Spark UI,
#: event log).  They run outside the query's job group: a graceful stop cancels that group, and Spark has
#: logged the batch as done, so the redo must finish.
REDO_DESCRIPTION = ("write-behind: batch {batch_id} applied again from Kafka, isolating the records the "
                    "database refuses")

#: How long the ``write_behind`` fault point waits for the next batch (Spark has then logged this one).
_FAULT_WAIT_S = 120


class WriteBehindUnapplied(RuntimeError):
    """``[STREAM_WRITE_BEHIND_UNAPPLIED]``: a batch handed to a writer, logged by Spark as done and not in the
    database, which this run cannot apply (it commits in line).  Found before the query starts; nothing is
    written.  A reset from the stored offsets reads the batch's records again."""


class WriteBehind:
    """One writer thread and the batch it commits.  ``hand_over`` from the stream thread after the batch
    is computed; ``settle`` before the next batch plans, and once the query stopped."""

    def __init__(self, marks: WriteBehindMarks):
        self.marks = marks
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="write-behind")
        self._in_flight: tuple[int, Future] | None = None
        self._next_batch = threading.Event()

    @property
    def in_flight(self) -> int | None:
        """The batch whose commit has not been settled yet."""
        return self._in_flight[0] if self._in_flight else None

    def hand_over(self, batch_id: int, commit: Callable[[], object]) -> None:
        """Mark the batch, then commit it in the writer thread.  The mark comes first: once this returns,
        Spark may log the batch as done."""
        assert self._in_flight is None, "settle the batch in flight first"
        self.marks.mark(batch_id)
        self._next_batch.clear()
        self._in_flight = (batch_id, self._pool.submit(self._commit, batch_id, commit))

    def next_batch_started(self) -> None:
        self._next_batch.set()

    def failure(self) -> BaseException | None:
        """What the batch in flight's commit raised, once it has; None while it runs or after it landed."""
        in_flight = self._in_flight  # the stream thread may settle it meanwhile
        if in_flight is None or not in_flight[1].done():
            return None
        return in_flight[1].exception()

    def settle(self) -> tuple[int, BaseException | None] | None:
        """Wait for the batch in flight: its id and what its commit raised (None once it landed, when its
        mark is gone too); None when nothing was in flight."""
        if self._in_flight is None:
            return None
        (batch_id, future), self._in_flight = self._in_flight, None
        error = future.exception()
        if error is None:
            self.clear(batch_id)
        return batch_id, error

    def clear(self, batch_id: int) -> None:
        """The batch is in the database: its mark can go."""
        clear_mark(self.marks, batch_id)

    def _commit(self, batch_id: int, commit: Callable[[], object]) -> object:
        if faults.armed("write_behind", batch_id):  # the moment a kill leaves Spark ahead of the database
            self._next_batch.wait(_FAULT_WAIT_S)
            faults.maybe_crash("write_behind", batch_id)
        return commit()


def clear_mark(marks: WriteBehindMarks, batch_id: int) -> None:
    """Remove a landed batch's mark.  A mark left behind costs the next run a look at the stored offsets,
    nothing more, so a failure to remove it is only logged."""
    try:
        marks.clear(batch_id)
    except Exception as err:
        log.warning("could not remove the write-behind mark of batch %s: %r", batch_id, err)
