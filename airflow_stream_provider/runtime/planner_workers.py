"""Let go of the Python processes Spark used to start the query, once its first batch reaches ``foreachBatch``.

Starting a query on the Python Kafka source runs three planner steps in Python: looking up data
sources, creating the source, planning its read.  Spark forks one worker for each from a daemon per
step and, with worker reuse (its default), keeps each worker idle until a minute after its last use:
about 180 MB of RSS (51 + 51 + 79 MB measured) that a driver started on a backlog carries through the
batches that drain it, the ones that need the memory most.  The query is planned by then; a later
batch does not use them.

Ending those idle workers is what Spark's own reaper does a minute later.  Spark checks an idle worker
before handing it out again and discards a dead one ("process from idle queue is dead, discarding"),
forking a new one from the daemon, so a job that plans a Python data source again later still works.
The daemons stay: Spark cannot restart a planner daemon that died (its next use fails with "Stream
closed"), and each holds only the interpreter (about 37 MB).

Only the planner workers' forks are ended: the streaming source's runner (offsets, partitions) and the
workers that read records serve every batch.
"""

from __future__ import annotations

import logging

import psutil

log = logging.getLogger(__name__)

#: Spark's Python worker modules for a data source's planning (Spark 4's ``pyspark.sql.worker``).
PLANNER_MODULES = frozenset({
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.plan_data_source_read",
})


def driver_jvm() -> psutil.Process | None:
    """The driver's JVM: this process's parent under spark-submit, its child when pyspark launched the
    JVM itself (a job run by plain Python)."""
    me = psutil.Process()
    parent = me.parent()
    if parent is not None and "java" in parent.name():
        return parent
    return next((child for child in me.children() if "java" in child.name()), None)


def planner_daemons(jvm: psutil.Process) -> list[psutil.Process]:
    """The JVM's planner daemons: ``python -m pyspark.daemon <planner module>``."""
    found = []
    for child in jvm.children():
        try:
            command = child.cmdline()
        except psutil.Error:  # gone between the listing and the look
            continue
        if command[1:3] == ["-m", "pyspark.daemon"] and command[3:4] and command[3] in PLANNER_MODULES:
            found.append(child)
    return found


def release_idle() -> int:
    """End the planner daemons' workers; returns how many.  Never raises: a failure costs memory only."""
    freed = 0
    try:
        jvm = driver_jvm()
        for daemon in planner_daemons(jvm) if jvm is not None else []:
            for worker in daemon.children():
                worker.kill()  # SIGKILL, as the daemon ends a worker when Spark's reaper asks it to
                freed += 1
    except psutil.Error as err:
        log.warning("could not let go of Spark's idle planner workers (memory only): %r", err)
    if freed:
        log.info("let go of %s idle planner worker(s) of the query's start", freed)
    return freed
