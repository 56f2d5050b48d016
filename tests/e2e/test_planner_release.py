"""The Python processes Spark starts to plan a Python data source, on a real Spark driver.

Letting go of the query start's planner daemons (``runtime.planner_workers``): the stream tests
(``test_runtime``) show the daemons gone once a query ran its first batch; this shows the other half of
the bargain, which no stream in the suite reaches: after the release, a Python data source is planned
again in the same driver, Spark starting new planner daemons for it.

Spark's lookup of installed Python data sources run beside the SparkContext's start
(``runtime.source_lookup``): the lookup is done once the session is up, and the source's resolution then
uses it instead of looking up again.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

from airflow_stream_provider.runtime.planner_workers import PLANNER_MODULES
from stack.jobs import SPARK_BIN, spark_env

#: A driver script's start: a Python data source of five numbers, and the helpers the scripts share.
PRELUDE = textwrap.dedent("""
    import json, time

    import psutil
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource, DataSourceReader

    from airflow_stream_provider.runtime import planner_workers, source_lookup


    class Numbers(DataSource):
        @classmethod
        def name(cls):
            return "numbers"

        def schema(self):
            return "n int"

        def reader(self, schema):
            return NumbersReader()


    class NumbersReader(DataSourceReader):
        def read(self, partition):
            yield from ((n,) for n in range(5))


    def children():  # (pid, command line) of this driver's processes, the JVM's and Spark's Python ones
        found = []
        for process in psutil.Process().children(recursive=True):
            try:
                found.append((process.pid, process.cmdline()))
            except psutil.NoSuchProcess:  # gone, or a zombie, since the listing
                continue
        return found


    def session():
        return SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()


    def read(spark):
        return sorted(row.n for row in spark.read.format("numbers").load().collect())
""")


def _run(tmp_path, body: str) -> dict:
    """Runs ``PRELUDE`` + ``body`` in the drivers' Python; returns what it printed after ``RESULT``."""
    script = tmp_path / "driver.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    done = subprocess.run([str(SPARK_BIN / "python"), str(script)], env=spark_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


#: Two reads of the source with a release after each.
RELEASE = """
    def planner_kinds():
        return sorted(kind for _, command in children() if (kind := planner_workers.planner_kind(command)))


    def settled(expect_none):
        deadline = time.monotonic() + 20
        while (kinds := planner_kinds()) and expect_none and time.monotonic() < deadline:
            time.sleep(0.2)
        return kinds


    spark = session()
    spark.dataSource.register(Numbers)
    found = {"first": read(spark), "before": planner_kinds()}
    found["released"] = planner_workers.release(spark)
    found["after"] = settled(expect_none=True)
    found["second"] = read(spark)
    found["again"] = planner_kinds()
    found["released_again"] = planner_workers.release(spark)
    print("RESULT " + json.dumps(found))
    spark.stop()
"""


def test_planning_after_the_release_starts_new_planner_daemons(tmp_path):
    found = _run(tmp_path, RELEASE)
    assert found["first"] == found["second"] == [0, 1, 2, 3, 4]
    # the first read planned in Python: one daemon per planner kind, each with the worker it forked
    assert set(found["before"]) == PLANNER_MODULES, found
    assert found["released"] == 3
    assert found["after"] == [], found
    # the second read created the source and planned its read again, on new daemons (the lookup of data
    # sources runs once per session); releasing those works as the first time did
    assert {"pyspark.sql.worker.create_data_source", "pyspark.sql.worker.plan_data_source_read"} <= \
        set(found["again"]), found
    assert found["released_again"] == 2


def test_release_outside_a_spark_driver_costs_memory_only(caplog):
    """A session that cannot be reached (here: none at all) is logged, not raised: the batch goes on."""
    from airflow_stream_provider.runtime import planner_workers

    assert planner_workers.release(object()) == 0
    assert "could not let go of Spark's planner daemons" in caplog.text


#: Spark's cached lookup read by reflection, before and after the lookup thread; then a read.
LOOKUP = """
    def lookup_processes():
        lookup = ["-m", "pyspark.daemon", "pyspark.sql.worker.lookup_data_sources"]
        return sorted(pid for pid, command in children() if command[1:4] == lookup)


    def looked_up(jvm):
        manager = jvm.java.lang.Class.forName(source_lookup.MANAGER)
        field = manager.getDeclaredField("dataSourceBuilders")
        field.setAccessible(True)
        return field.get(manager.getField("MODULE$").get(None)).isDefined()


    SparkContext._ensure_initialized()
    jvm = SparkContext._jvm
    found = {"before": looked_up(jvm)}
    thread = source_lookup.start(jvm)
    spark = session()
    thread.join(120)
    found.update(joined=not thread.is_alive(), after=looked_up(jvm), processes=lookup_processes())
    spark.dataSource.register(Numbers)
    found["rows"] = read(spark)
    found["processes_after_read"] = lookup_processes()
    print("RESULT " + json.dumps(found))
    spark.stop()
"""


def test_the_lookup_is_done_beside_the_session_and_the_resolution_uses_it(tmp_path):
    found = _run(tmp_path, LOOKUP)
    assert found["before"] is False  # nothing looked up before the thread
    assert found["joined"] and found["after"] is True, found
    assert found["processes"]  # the thread's lookup started Spark's lookup daemon and forked its worker
    assert found["rows"] == [0, 1, 2, 3, 4]
    assert found["processes_after_read"] == found["processes"]  # no lookup process started for the read
