"""Where a driver's start goes: from the spawn of its JVM to its first committed batch, in phases.

A restart is down for exactly this long, so the harness logs it once, when the first batch committed::

    startup {"launch": 2.1, "python": 1.4, "state_database": 0.3, "spark_session": 3.2, ...}

and ``make bench`` reads that line to show what a cold start spends its time on.  The phases, in order:

* ``launch``: spark-submit's scripts, its launcher JVM and the driver JVM, up to the Python driver's
  start (measured from the JVM's process start: only when the Python driver's parent is a JVM);
* ``python``: the interpreter and the job file's imports (pyspark, the harness), up to the harness;
* ``state_database``: the spec's checks, the state tables, the run's registration and epoch;
* ``spark_session``: the SparkSession (SparkContext, its scheduler, the UI);
* ``source``: the generation's start (checkpoint and Kafka) and the job's transform planned;
* ``query_start``: the query's start (checkpoint metadata, listener, the source's Python runner, and the
  batches a killed run left to its writer, applied again first: ``TransactionalSink.catch_up``);
* ``first_batch``: from the started query to its first batch's database commit.
"""

from __future__ import annotations

import json
import logging
import os
import time

import psutil

from airflow_stream_provider import failures
from airflow_stream_provider.local_driver import process_started

log = logging.getLogger("airflow_stream_provider.harness")

class StartupError(Exception):
    """The job cannot start; carries the exit code and a message that says what to fix."""

    def __init__(self, kind: failures.FailureKind | None, message: str, exit_code: int | None = None):
        self.exit_code = exit_code if exit_code is not None else failures.exit_code_for(kind)
        #: what the run records: a configuration error (``EXIT_CONFIG``) is the job author's to fix, and a
        #: run recorded without a kind would be diagnosed UNKNOWN
        self.kind = kind if kind is not None else failures.kind_for_exit_code(self.exit_code)
        super().__init__(message)


PHASES = ("launch", "python", "state_database", "spark_session", "source", "query_start", "first_batch")


def _process_starts() -> tuple[float | None, float | None]:
    """(when the driver JVM started, when this Python process started); the first is None when this
    process does not run under a JVM (the harness run by plain Python, as some tests do)."""
    try:
        me = psutil.Process(os.getpid())
        parent = me.parent()
        jvm = process_started(parent) if parent is not None and "java" in (parent.name() or "") else None
        return jvm, process_started(me)
    except psutil.Error:
        return None, None


class StartupClock:
    """Marks the end of each phase; :meth:`report` logs them once, as seconds per phase."""

    def __init__(self):
        self.jvm_started, self.python_started = _process_starts()
        self._ends: dict[str, float] = {"python": time.time()}
        self.reported = False

    def done(self, phase: str) -> None:
        """``phase`` ended now (the first time only: a phase is not timed twice)."""
        self._ends.setdefault(phase, time.time())

    def committed(self) -> None:
        """A batch committed: the start ends with the first one the started query commits, which is when
        the phases are logged.  A commit before the query started (a killed run's write-behind batch,
        applied again by the catch-up) is part of ``query_start``."""
        if "query_start" in self._ends:
            self.done("first_batch")
            self.report()

    def skip(self) -> None:
        """Never report (a standby: its start is its warm-up; what counts is its takeover)."""
        self.reported = True

    def phases(self) -> dict[str, float]:
        """Seconds per phase that ended, in order; ``total`` from the earliest known start."""
        starts = {"launch": self.jvm_started, "python": self.python_started}
        ends = {"launch": self.python_started, **self._ends}
        found: dict[str, float] = {}
        previous = None
        for phase in PHASES:
            start = starts.get(phase, previous)
            end = ends.get(phase)
            if start is not None and end is not None:
                found[phase] = round(max(0.0, end - start), 3)
            previous = end if end is not None else previous
        first = self.jvm_started or self.python_started
        if first is not None and previous is not None:
            found["total"] = round(previous - first, 3)
        return found

    def report(self) -> None:
        """Log the phases once (after the first committed batch)."""
        if self.reported:
            return
        self.reported = True
        log.info("startup %s", json.dumps(self.phases()))
        uncompiled = _uncompiled_pyspark()
        if uncompiled:
            log.info("pyspark comes from %s, which holds no compiled modules: each Python process Spark starts "
                     "compiles pyspark again (about 0.6 s of CPU each, several per start). Run "
                     "'python -m airflow_stream_provider.runtime.precompile' once with this Python", uncompiled)


def _uncompiled_pyspark() -> str | None:
    """The zip pyspark was imported from when it holds only sources (``runtime.precompile`` compiles it)."""
    import pyspark

    where = getattr(pyspark, "__file__", "") or ""
    return where.split("/pyspark/__init__")[0] if ".zip/" in where and where.endswith(".py") else None
