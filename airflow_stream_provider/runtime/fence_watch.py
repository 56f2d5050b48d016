"""Ends a fenced driver whose main loop cannot end it.

The harness's main loop reads the job's epoch with each heartbeat and ends a run that another run has taken
the job from (``StreamHarness._fenced``).  It cannot when it is held up itself: a query's stop waits for a
batch that never ends (a hung call in the job's ``results``: Spark's stop has no timeout by default and
cannot interrupt a Python callback), a start that hangs once the run is registered (a dependency that
never answers), or a call into a wedged JVM.  Such a driver neither heartbeats nor ends.  On its own host
the watcher finds it STUCK and the stop's signals end it.  A watcher on another host can neither see nor
signal the process: it finds the run DEAD by its silence, and the job restarts beside it.  The new run's
epoch refuses the old one's commits, but the old process would live on, holding its cores, its memory and
its Python workers, with the checkpoint it could still write to.

:class:`FenceWatch` reads the epoch on a thread of its own, from the moment the run takes it.  Once another
run holds it and the main loop has not ended within ``grace_s``, it records the run's end (when the
database answers) and ends the process as a kill -9 would: the sink and the checkpoint are made for that.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from airflow_stream_provider import failures
from airflow_stream_provider.state import store as state

log = logging.getLogger("airflow_stream_provider.fence_watch")


def fenced(run_id: str, held: int, current: int) -> str:
    """Why a run ends fenced, as its main loop and the watch both record it."""
    return (f"fenced: run {run_id} holds epoch {held} but the job's current epoch is {current} (a newer run "
            "took the job over)")


class FenceWatch:
    """Watches one run's epoch from a daemon thread; see the module's docstring.

    The main loop records the run's end holding :attr:`recording`, then says so (:meth:`ended`): the watch
    records under the same lock, so of the two ends one is written, and the process exits with its code.

    :param every_s: how often the epoch is read.
    :param grace_s: how long the main loop has to end a fenced run itself.
    :param exit: ends the process (``os._exit``; a test passes its own).
    """

    def __init__(self, store: state.StateStore, job_id: str, run_id: str, epoch: int, *, every_s: float,
                 grace_s: float, exit: Callable[[int], None] = os._exit):
        self.store, self.job_id, self.run_id, self.epoch = store, job_id, run_id, epoch
        self.every_s, self.grace_s = every_s, grace_s
        self._exit = exit
        #: held while either side records the run's end
        self.recording = threading.Lock()
        #: the exit code of the end the main loop recorded, once it has: the watch then records nothing
        self._ended_with: int | None = None
        self._thread = threading.Thread(target=self._run, name="fence-watch", daemon=True)

    @classmethod
    def for_run(cls, store: state.StateStore, job_id: str, run_id: str, epoch: int, *, heartbeat_s: float,
                heartbeat_timeout_s: float) -> FenceWatch:
        """The watch for a run: the main loop gets as long to end a fenced run as the watcher gives a silent
        driver (the heartbeat timeout), and the epoch is read a few times in that span, never more often
        than the heartbeat writes."""
        return cls(store, job_id, run_id, epoch, every_s=max(heartbeat_s, heartbeat_timeout_s / 3),
                   grace_s=heartbeat_timeout_s)

    def start(self) -> FenceWatch:
        self._thread.start()
        return self

    def ended(self, exit_code: int) -> None:
        """The main loop has recorded the run's end (call it holding :attr:`recording`): a process still
        alive ``grace_s`` after another run took the job (its Spark session hangs in its stop) exits with
        ``exit_code``, and nothing more is recorded."""
        self._ended_with = exit_code

    def _run(self) -> None:
        fenced_at: float | None = None
        while True:
            time.sleep(self.every_s)
            try:
                epoch = self.store.current_epoch(self.job_id)
            except Exception as err:  # no evidence either way: the main loop rides the database's outages out
                log.debug("fence watch: could not read the epoch: %r", err)
                continue
            if epoch is None or epoch == self.epoch:
                continue
            if fenced_at is None:
                fenced_at = time.monotonic()
                log.warning("run %s holds epoch %s but the job's current epoch is %s: the run ends within "
                            "%.0fs", self.run_id, self.epoch, epoch, self.grace_s)
            if time.monotonic() - fenced_at >= self.grace_s:
                self._end_process(epoch)
                return

    def _end_process(self, epoch: int) -> None:
        with self.recording:  # held to the exit: the main loop records nothing after this
            code = self._ended_with if self._ended_with is not None else failures.EXIT_CONCURRENT
            try:
                if self._ended_with is None:
                    self._record(epoch, code)
                else:
                    log.error("run %s ended (exit %s) and another run holds the job, but the process still "
                              "lives %.0fs later: it exits", self.run_id, code, self.grace_s)
                _flush_output()
            finally:  # whatever the record or the flush raised, the process ends
                self._exit(code)

    def _record(self, epoch: int, code: int) -> None:
        message = (f"{fenced(self.run_id, self.epoch, epoch)}, and its main loop did not end within "
                   f"{self.grace_s:.0f}s (held up in a stop or a Spark call): the process ends itself")
        log.error("%s", message)
        try:
            self.store.finish_run(self.run_id, status=state.FAILED, exit_code=code,
                                  failure_kind=failures.FailureKind.CONCURRENT.value, error_class=None,
                                  message=message)
        except Exception as err:
            log.error("could not record the end of run %s: %r", self.run_id, err)


def _flush_output() -> None:
    """``os._exit`` flushes nothing: what the driver logged and printed goes out first, as far as it can."""
    for target in (*logging.getLogger().handlers, sys.stdout, sys.stderr):
        try:
            target.flush()
        except Exception:  # a closed stream, a handler without one: nothing to flush there
            pass
