"""The state database's clock: the one clock every stored time is written and judged by.

A heartbeat is written by the driver's host and judged by a triggerer's, a worker's or a standby's; a lease
is taken on one worker and found expired on another.  Hosts' clocks disagree (an NTP that is not running, a
VM resumed from a pause), and a host 40 s ahead of the driver's would find every heartbeat 40 s old: dead by
the default 30 s timeout, restarted, and again after the restart.  So stored times are the state
database's: each process measures how far the database's clock is from its own (a query, about once a
minute, and again when the host's clock steps) and writes ``time.time()`` plus that.  What the state
package reads back it hands out in the reading host's terms (``in_host_terms``), so the rest of the code
compares stored times with ``time.time()``, and with what the host itself reports (a process's start).

SQLite is a file on one host, read and written by that host's processes only, with that host's clock: its
offset is zero and nothing is asked.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

#: how often the offset is measured again: clocks drift by milliseconds a minute, not more
REFRESH_S = 60.0
#: the host's clock moved against its monotonic clock by more than this (stepped): measure again at once
STEP_S = 1.0
#: after a failed measure (the database does not answer), the last offset serves this long before the next try
RETRY_S = 5.0

_DATABASE_NOW = {"postgresql": "SELECT extract(epoch FROM clock_timestamp())"}


class DatabaseClock:
    """``now()``: seconds since the epoch by the state database's clock, read off this host's clock."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._query = _DATABASE_NOW.get(engine.dialect.name)
        self._offset = 0.0
        self._next_measure = 0.0  # monotonic
        self._host_minus_monotonic: float | None = None
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() + self.offset()

    def offset(self) -> float:
        """The database's clock minus this host's (seconds; zero for SQLite)."""
        if self._query is None:
            return 0.0
        monotonic = time.monotonic()
        stepped = (self._host_minus_monotonic is not None
                   and abs(time.time() - monotonic - self._host_minus_monotonic) > STEP_S)
        if stepped or monotonic >= self._next_measure:
            with self._lock:
                if stepped or time.monotonic() >= self._next_measure:
                    self._measure()
        return self._offset

    def to_database(self, host_time: float) -> float:
        """A time by this host's clock (a lease's end, a window's start) in the database's terms."""
        return host_time + self.offset()

    def to_host(self, database_time: float) -> float:
        """A time by the database's clock (a wait's deadline) in this host's terms."""
        return database_time - self.offset()

    def _measure(self) -> None:
        try:
            with self._engine.connect() as conn:
                before = time.time()
                database = float(conn.execute(text(self._query)).scalar_one())
                after, after_monotonic = time.time(), time.monotonic()
        except SQLAlchemyError as err:  # the caller's own statement meets the outage; keep the last offset
            log.debug("could not read the state database's clock: %r", err)
            self._next_measure = time.monotonic() + RETRY_S
            return
        offset = database - (before + after) / 2  # the database read its clock about halfway through
        if abs(offset - self._offset) > STEP_S:
            log.info("the state database's clock is %+.1f s from this host's; stored times follow the database's",
                     offset)
        self._offset = offset
        self._host_minus_monotonic = after - after_monotonic
        self._next_measure = time.monotonic() + REFRESH_S


def in_host_terms(values: dict[str, Any], names: Iterable[str], offset: float) -> dict[str, Any]:
    """``values`` (a row read from the database) with its ``names`` times moved into this host's clock's terms
    (``offset``: ``DatabaseClock.offset``): the records the state package hands out are read against
    ``time.time()`` and against what this host reports, such as a process's start."""
    for name in names:
        if values.get(name) is not None:
            values[name] -= offset
    return values


_clocks: weakref.WeakKeyDictionary[Engine, DatabaseClock] = weakref.WeakKeyDictionary()
_clocks_lock = threading.Lock()


def clock_for(engine: Engine) -> DatabaseClock:
    """The clock of ``engine``'s database, one per engine: every table's access through it shares the measure."""
    with _clocks_lock:
        clock = _clocks.get(engine)
        if clock is None:
            clock = _clocks[engine] = DatabaseClock(engine)
        return clock
