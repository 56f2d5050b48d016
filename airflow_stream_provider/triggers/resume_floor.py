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

#: A waiting task's own waits take longer (a driver's start, a batch's stop); a wait already decided costs
#: these seconds.
RESUME_FLOOR_S = 5.0


def this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def hold_back(deferred_at: float, deferred_in: str | None) -> None:
    """Sleep until ``RESUME_FLOOR_S`` after ``deferred_at`` (epoch seconds, when the task deferred), unless
    this is the process that deferred (``deferred_in``)."""
    if deferred_in != this_process():
        await asyncio.sleep(max(0.0, deferred_at + RESUME_FLOOR_S - time.time()))
