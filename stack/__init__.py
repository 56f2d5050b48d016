"""The real components the demo, the benchmarks and the tests start, one way for all three.

- ``broker``: a Kafka-protocol broker (Tansu) on a free loopback port;
- ``postgres``: a fresh database on the machine's PostgreSQL server;
- ``jobs``: the example job as separate Spark driver processes, and the exactly-once check;
- ``events``: producers of example events (some malformed) that remember what Kafka acknowledged;
- ``real_airflow`` and ``deployment``: Airflow's scheduler, triggerer, dag-processor and api-server as
  processes, and the example job deployed on them, driven through the REST API;
- ``outages`` and ``standalone``: a Kafka proxy and a PostgreSQL server that can be taken away, and a
  Spark standalone cluster.

It starts Spark and Airflow as processes and watches them from outside.  It never imports PySpark, and
Airflow only through the provider's own driver hook, so a test driver runs the spark-submit command that
production builds.
"""
