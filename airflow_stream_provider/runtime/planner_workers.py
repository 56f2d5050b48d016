"""Let go of the Python processes Spark used to start the query, once its first batch reaches ``foreachBatch``.

Starting a query on the Python Kafka source runs three planner steps in Python: looking up data
sources, creating the source, planning its read.  For each, Spark starts a daemon (``python -m
pyspark.daemon <module>``, about 37 MB) and forks a worker from it, which it keeps idle until a minute
after its last use (51 + 51 + 79 MB measured); the daemons stay for the driver's life.  About 0.3 GB of
RSS that a driver started on a backlog carries through the batches that drain it, the ones that need
the memory most.  The query is planned by then; a later batch does not use them.

Spark keeps one worker factory per Python worker kind (``SparkEnv.pythonWorkers``) and creates one when
a kind is asked for that it does not hold.  Taking the planner kinds' factories out and stopping them
(Spark's own ``PythonWorkerFactory.stop``, as when the driver ends) ends each daemon with its workers;
a job that plans a Python data source again later gets new ones.  Ending only the processes would not
do: the factory would keep the dead daemon and fail its next use ("Stream closed").

The map is private to Spark, reached by reflection, and is otherwise changed under the SparkEnv's lock
by tasks and planning asking for workers: this runs on the stream's own thread inside its first
``foreachBatch``, before the batch's jobs start, when the query plans nothing and no other query runs
(a standby's warm-up query defers it).  Only the planner kinds go: the streaming source's runner
(offsets, partitions) and the workers that read records serve every batch.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Spark's Python worker modules for a data source's planning (Spark 4's ``pyspark.sql.worker``).
PLANNER_MODULES = frozenset({
    "pyspark.sql.worker.lookup_data_sources",
    "pyspark.sql.worker.create_data_source",
    "pyspark.sql.worker.plan_data_source_read",
})


def planner_kind(command: list[str]) -> str | None:
    """The planner kind a Python process of Spark's runs, from its command line (a daemon's workers keep the
    daemon's), or None: ``python -m pyspark.daemon <module>``."""
    module = command[3] if command[1:3] == ["-m", "pyspark.daemon"] and command[3:4] else None
    return module if module in PLANNER_MODULES else None


def release(spark) -> int:
    """Stop the planner kinds' worker factories (their daemons and idle workers); returns how many.
    Never raises: a failure costs memory only."""
    stopped = []
    try:
        jvm = spark.sparkContext._jvm
        # Reflection on the field, not calls on SparkEnv: py4j resolves a call against all of a class's
        # methods, and SparkEnv's refer to classes this Spark does not ship (the gateway's reply is lost).
        field = jvm.java.lang.Class.forName("org.apache.spark.SparkEnv").getDeclaredField("pythonWorkers")
        field.setAccessible(True)
        factories = field.get(spark.sparkContext._jsc.sc().env())
        keys = factories.keys().toList().iterator()
        while keys.hasNext():
            key = keys.next()
            if key.workerModule() in PLANNER_MODULES:
                factories.remove(key).get().stop()
                stopped.append(key.workerModule())
    except Exception as err:  # a Spark without the field, a py4j error: memory only
        log.warning("could not let go of Spark's planner daemons of the query's start (memory only): %r", err)
    if stopped:
        log.info("let go of the query start's planner daemons and their idle workers: %s", ", ".join(sorted(stopped)))
    return len(stopped)
