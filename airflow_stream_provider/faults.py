"""Deterministic crash points for fault-injection tests, on both sides (pure: no pyspark, no airflow).

``STREAM_FAULT=<point>[:<batch_id>]`` (batch ``*`` or none for any) makes the process die at that point
exactly as if it had been SIGKILLed: no cleanup, no termination record, no ``finally``.  Not an
exception: even a ``BaseException`` still runs every ``finally`` and the task runner's own handlers,
which a killed process never does.  Unset in production: one env lookup.

* Driver points (``DRIVER_POINTS``) kill the driver's process group: the launcher starts every driver
  in its own group, so the JVM, the Python driver and its workers go together, and nothing else.
* Task points (``TASK_POINTS``) kill only the Airflow task process (an OOM kill, a lost worker); a
  driver it started lives on.  Tests that use one run the task in a child process (``dag.test()`` runs
  tasks in the calling process).
"""

from __future__ import annotations

import os
import signal

ENV = "STREAM_FAULT"
#: ``STREAM_FAULT_ONCE=<path>``: the point fires in the first process that reaches it only, which creates
#: the file.  A real Airflow runs each task in a new process: the loss of one task, not of every later one.
ONCE_ENV = "STREAM_FAULT_ONCE"
DRIVER_POINTS = ("batch_start", "before_db_commit", "after_db_commit", "write_behind", "during_stop")
TASK_POINTS = ("reset_after_archive", "restart_before_stop", "restart_after_stop", "upgrade_after_stop")


def armed(point: str, batch_id: int | None = None) -> bool:
    """Is the process set to die at this point (for a point that must first wait for its moment)?"""
    wanted = os.environ.get(ENV)
    if not wanted:
        return False
    name, _, batch = wanted.partition(":")
    return name == point and batch in ("", "*", str(batch_id))


def maybe_crash(point: str, batch_id: int | None = None) -> None:
    if not armed(point, batch_id) or not _first_time():
        return
    if point in TASK_POINTS:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _first_time() -> bool:
    marker = os.environ.get(ONCE_ENV)
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
