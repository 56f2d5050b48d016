"""What a lifecycle step waits for, and how one poll decides it: shared by the trigger (deferrable
operators, in the triggerer) and the blocking path (``deferrable=False``), so both wait the same way.

A wait is plain data (:class:`RunWait`), so it travels through a deferral; its deadline is absolute, so a
task resumed after a worker crash keeps the original bound instead of starting the clock again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from sqlalchemy.exc import InterfaceError, OperationalError

from airflow_stream_provider import local_driver
from airflow_stream_provider.lifecycle.driver_log import DriverLogFollower
from airflow_stream_provider.state.records import RunRecord

#: How one wait ended.
#: ready: the query runs; batch: the run committed a batch (past ``min_batch_id``); ended: the driver is
#: gone (its row says so, or its process); idle: the query runs and Kafka holds nothing beyond the stored
#: offsets for ``IDLE_CONFIRM_S`` (no batch is coming); timeout: none of these by the deadline.
Outcome = Literal["ready", "batch", "ended", "idle", "timeout"]
#: Caught up (no Kafka record beyond the stored offsets) for this long: no batch is coming, so waiting
#: for one would only wait out the timeout.
IDLE_CONFIRM_S = 5.0
#: How often the idle check asks Kafka (each ask opens a consumer): a few times per confirmation window.
CAUGHT_UP_EVERY_S = 1.5
POLL_INTERVAL_S = 0.5
#: What a state database that does not answer raises (a restart, a failover, a locked SQLite file): a wait
#: rides it out until its deadline.
DATABASE_OUTAGE = (OperationalError, InterfaceError)


log = logging.getLogger(__name__)


def outage_line(err: BaseException) -> str:
    """A state-database error for a log line: its first line (SQLAlchemy's go on with the statement and
    its parameters)."""
    lines = str(err).splitlines()
    return lines[0][:300] if lines else type(err).__name__


@dataclass(frozen=True)
class RunWait:
    """Wait on run ``run_id`` until ``until`` happens (or it ends, or ``deadline``, a wall-clock time by the
    state database's clock: the worker that sets it and the triggerer that checks it may disagree).

    ``until``: ``ready`` (its query started), ``batch`` (it committed a batch with id >= ``min_batch_id``),
    or ``ended``.  ``idle``: also finish, as ``idle``, once the running query has nothing to read.
    ``pid``/``host``/``log_path``: the process started for it and the host it runs on, watched before the
    driver registers its row; the pid is checked only on that host.
    ``settle_s``: with ``ready``, once the query runs, wait up to this long more for the run's first batch to
    be over (committed, the run gone, or nothing to read) before ``ready``: a task resumed on a worker
    meanwhile would take CPU from the driver's first batch, the last step of a restart.
    """

    run_id: str
    job_id: str
    until: Literal["ready", "batch", "ended"]
    deadline: float
    idle: bool = False
    min_batch_id: int = 0
    pid: int | None = None
    host: str | None = None
    started_at: float | None = None
    log_path: str | None = None
    settle_s: float = 0.0

    @classmethod
    def within(cls, timeout: float, now: float | None = None, **fields: Any) -> RunWait:
        """A wait of ``timeout`` seconds from ``now`` (the state database's clock; this host's by default)."""
        return cls(deadline=(time.time() if now is None else now) + float(timeout), **fields)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunWait:
        return cls(**data)


class RunWatch:
    """Polls one wait: ``poll()`` returns its outcome once decided, else None.  Blocking; the trigger runs
    it in a thread.  ``caught_up()`` says whether Kafka holds nothing beyond the job's stored offsets.
    ``driver_log()`` hands out the new lines of the run's driver log, with ``secrets`` masked."""

    def __init__(self, wait: RunWait, get_run: Callable[[str], RunRecord | None],
                 driver_alive: Callable[[RunRecord], bool | None], caught_up: Callable[[], bool],
                 secrets: Sequence[str] = (), now: Callable[[], float] | None = None):
        self.wait = wait
        self._now = now or time.time  # the clock ``wait.deadline`` is by: the state database's, or this host's
        self._get_run, self._driver_alive, self._caught_up = get_run, driver_alive, caught_up
        self._idle_since: float | None = None
        self._ready_at: float | None = None  # when the query was first seen running
        self._nothing_to_read = False  # and whether Kafka held nothing for it then
        self._asked_at: float | None = None
        self._gone_polls = 0
        self._secrets = secrets
        self._log: DriverLogFollower | None = None
        self._outage_since: float | None = None
        self.run: RunRecord | None = None

    def poll(self) -> Outcome | None:
        wait = self.wait
        run = self.run = self._get_run(wait.run_id)
        if run is not None:
            if wait.until == "ready" and (run.running_query or self._ready_at is not None) and self._settled(run):
                return "ready"
            if wait.until == "batch" and run.last_batch_id is not None and run.last_batch_id >= wait.min_batch_id:
                return "batch"
        # A settling launch whose query ran worked, however its first batch ends: it is ``ready``.
        settling = self._ready_at is not None
        if self._gone(run):
            # Once more: let the driver finish writing its termination record before it is read.
            self._gone_polls += 1
            if self._gone_polls > 1 or (run is not None and not run.active):
                return "ready" if settling else "ended"
        elif wait.idle and run is not None and run.running_query and self._idle_confirmed():
            return "idle"
        if self._now() >= wait.deadline:
            return "ready" if settling else "timeout"
        return None

    def poll_through_outages(self) -> Outcome | None:
        """``poll``, riding out a state database that does not answer until the wait's deadline: a failed read
        is neither the run's end nor its launch's failure (either would have a task give up on a healthy
        driver, or roll an upgrade back).  Past the deadline the database's error is raised."""
        try:
            outcome = self.poll()
        except DATABASE_OUTAGE as err:
            if self._now() >= self.wait.deadline:
                raise
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                log.warning("Waiting on run %s: the state database does not answer (%s); trying again until "
                            "the wait's deadline", self.wait.run_id, outage_line(err))
            return None
        if self._outage_since is not None:
            log.info("Waiting on run %s: the state database answers again after %.0fs", self.wait.run_id,
                     time.monotonic() - self._outage_since)
            self._outage_since = None
        return outcome

    def _settled(self, run: RunRecord) -> bool:
        """The query ran (``ready``) and, with ``settle_s``, its first batch is over, no batch is coming (Kafka
        held nothing beyond the stored offsets when the query started: asked once), or the settling time is
        up.  A run gone meanwhile, or the wait's deadline, ends it in ``poll``."""
        if not self.wait.settle_s:
            return True
        now = time.monotonic()
        if self._ready_at is None:
            self._ready_at, self._nothing_to_read = now, self._caught_up()
        return self._nothing_to_read or run.last_batch_id is not None or now - self._ready_at >= self.wait.settle_s

    def _gone(self, run: RunRecord | None) -> bool:
        if run is not None and not run.active:
            return self._driver_alive(run) is not True
        if run is not None and self._driver_alive(run) is False:
            return True
        return local_driver.launch_alive(self.wait.pid, self.wait.host, self.wait.started_at) is False

    def _idle_confirmed(self) -> bool:
        now = time.monotonic()
        if self._asked_at is None or now - self._asked_at >= CAUGHT_UP_EVERY_S:
            self._asked_at = now
            if not self._caught_up():
                self._idle_since = None
                return False
            self._idle_since = self._idle_since or now
        return self._idle_since is not None and now - self._idle_since >= IDLE_CONFIRM_S

    def driver_log(self) -> list[str]:
        """The driver log's lines added since the last call: from its start while a launch waits for its
        query, from where it stood when the wait began otherwise.  None where the log is not on this host."""
        if self._log is None:
            path = self.wait.log_path or (self.run.log_path if self.run else None)
            if not path:
                return []
            self._log = DriverLogFollower(path, from_start=self.wait.until == "ready", secrets=self._secrets)
        return self._log.new_lines()

    def block(self, show: Callable[[str], None] | None = None) -> Outcome:
        """Poll until decided (the blocking path of ``deferrable=False``), handing ``show`` each new line
        of the driver log."""
        while True:
            outcome = self.poll_through_outages()
            for line in self.driver_log() if show else ():
                show(line)
            if outcome is not None:
                return outcome
            time.sleep(POLL_INTERVAL_S)


def pause(seconds: float) -> None:
    """A backoff on the blocking path (``deferrable=False``)."""
    if seconds > 0:
        time.sleep(seconds)
