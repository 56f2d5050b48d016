"""The runtime side: runs inside the Spark driver and executors.  Imports pyspark, never airflow."""

from airflow_stream_provider.runtime.harness import StreamHarness
from airflow_stream_provider.runtime.sink import Result

__all__ = ["Result", "StreamHarness"]
