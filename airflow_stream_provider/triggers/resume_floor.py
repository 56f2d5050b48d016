"""A deferred task's trigger fires no sooner than ``RESUME_FLOOR_S`` after its task deferred.

Airflow 3.3 fails a task whose resumed attempt is already queued or running when the scheduler drains the
"success" its deferring process reported on exit (apache/airflow#72716; its guard covers a resume still
SCHEDULED only).  A trigger that fires at once (a batch already committed, a stop already done) lets the
resume overtake that report on a loaded scheduler: seen here, an upgrade's task failed 3 s after it
deferred, its trigger having fired after 1.1 s, and its ``on_kill`` ended the upgrade.  Holding the event
back a few seconds leaves the scheduler the time to drain the report first.

Not where the trigger runs in the process that deferred (``dag.test()`` runs it inline): no executor
reports anything there.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

#: A waiting task's own waits take longer (a driver's start, a batch's stop); a wait already decided costs
#: these seconds.
RESUME_FLOOR_S = 5.0


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Deferral:
    """When and in which process a task deferred, carried in its trigger's kwargs (``deferred_at``,
    ``deferred_in``)."""

    at: float
    process: str | None

    @classmethod
    def of(cls, deferred_at: float | None, deferred_in: str | None) -> Deferral:
        """The deferral a trigger's kwargs carry; without one, now and here (the task deferring)."""
        if deferred_at is None:
            return cls(time.time(), this_process())
        return cls(float(deferred_at), deferred_in)

    def kwargs(self) -> dict[str, Any]:
        return {"deferred_at": self.at, "deferred_in": self.process}

    async def hold_back(self) -> None:
        """Sleep until ``RESUME_FLOOR_S`` after the deferral, unless this is the process that deferred."""
        if self.process != this_process():
            await asyncio.sleep(max(0.0, self.at + RESUME_FLOOR_S - time.time()))
