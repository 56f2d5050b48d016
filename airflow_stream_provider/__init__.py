"""airflow-stream-provider: keep PySpark Structured Streaming jobs on Kafka alive and exactly-once.

The package has two sides that meet only in the state database:

* ``airflow_stream_provider.runtime`` runs inside the Spark driver and executors (imports pyspark,
  never airflow);
* everything else runs inside Airflow (imports airflow, never pyspark).

Modules at the top level that both sides use (``spec``, ``failures``, ``state``) import neither.
This ``__init__`` must stay import-free for the same reason.
"""

from __future__ import annotations

__version__ = "0.1.0"
