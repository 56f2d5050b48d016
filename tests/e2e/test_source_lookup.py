"""Spark's lookup of installed Python data sources run beside the SparkContext's start
(``runtime.source_lookup``), on a real Spark driver: the lookup is done once the session is up, the
source's resolution then uses it instead of looking up again, and reading a Python data source works."""

from __future__ import annotations

import json
import subprocess
import textwrap

from stack.jobs import SPARK_BIN, spark_env

DRIVER = textwrap.dedent("""
    import json

    import psutil
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource, DataSourceReader

    from airflow_stream_provider.runtime import source_lookup


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


    def lookup_daemons():
        return sorted(p.pid for p in psutil.Process().children(recursive=True)
                      if p.cmdline()[1:4] == ["-m", "pyspark.daemon", "pyspark.sql.worker.lookup_data_sources"])


    def looked_up(jvm):
        manager = jvm.java.lang.Class.forName(source_lookup.MANAGER)
        field = manager.getDeclaredField("dataSourceBuilders")
        field.setAccessible(True)
        return field.get(manager.getField("MODULE$").get(None)).isDefined()


    SparkContext._ensure_initialized()
    jvm = SparkContext._jvm
    found = {"before": looked_up(jvm)}
    thread = source_lookup.start(jvm)
    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    thread.join(120)
    found.update(joined=not thread.is_alive(), after=looked_up(jvm), daemons=lookup_daemons())
    spark.dataSource.register(Numbers)
    found["rows"] = sorted(row.n for row in spark.read.format("numbers").load().collect())
    found["daemons_after_read"] = lookup_daemons()
    print("RESULT " + json.dumps(found))
    spark.stop()
""")


def test_the_lookup_is_done_beside_the_session_and_the_resolution_uses_it(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    done = subprocess.run([str(SPARK_BIN / "python"), str(script)], env=spark_env(), capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    found = json.loads(lines[0].removeprefix("RESULT "))
    assert found["before"] is False  # nothing looked up before the thread
    assert found["joined"] and found["after"] is True, done.stderr[-3000:]
    assert found["daemons"]  # the thread's lookup started Spark's lookup daemon (and forked its worker)
    assert found["rows"] == [0, 1, 2, 3, 4]
    assert found["daemons_after_read"] == found["daemons"]  # the resolution looked nothing up again
