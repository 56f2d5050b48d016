"""Letting go of the query start's planner daemons (``runtime.planner_workers``) on a real Spark driver.

The stream tests (``test_runtime``) show the daemons gone once a query ran its first batch; this shows the
other half of the bargain, which no stream in the suite reaches: after the release, a Python data source
is planned again in the same driver, Spark starting new planner daemons for it.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

from airflow_stream_provider.runtime.planner_workers import PLANNER_MODULES
from stack.jobs import SPARK_BIN, spark_env

DRIVER = textwrap.dedent("""
    import json, time

    import psutil
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource, DataSourceReader

    from airflow_stream_provider.runtime import planner_workers


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


    def planner_kinds():
        kinds = []
        for process in psutil.Process().children(recursive=True):
            try:
                command = process.cmdline()
            except psutil.NoSuchProcess:
                continue
            if kind := planner_workers.planner_kind(command):
                kinds.append(kind)
        return sorted(kinds)


    def settled(expect_none):
        deadline = time.monotonic() + 20
        while (kinds := planner_kinds()) and expect_none and time.monotonic() < deadline:
            time.sleep(0.2)
        return kinds


    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    spark.dataSource.register(Numbers)
    read = lambda: sorted(row.n for row in spark.read.format("numbers").load().collect())
    found = {"first": read(), "before": planner_kinds()}
    found["released"] = planner_workers.release(spark)
    found["after"] = settled(expect_none=True)
    found["second"] = read()
    found["again"] = planner_kinds()
    found["released_again"] = planner_workers.release(spark)
    print("RESULT " + json.dumps(found))
    spark.stop()
""")


def test_planning_after_the_release_starts_new_planner_daemons(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    done = subprocess.run([str(SPARK_BIN / "python"), str(script)], env=spark_env(), capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found = json.loads(lines[-1].removeprefix("RESULT "))
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
