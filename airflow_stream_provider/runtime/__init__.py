"""The runtime side: runs inside the Spark driver and executors.  Imports pyspark, never airflow.

The exports load on first use: Spark's Python workers unpickle the Kafka source from
``runtime.kafka_source`` in every worker, planner and source-runner process it starts, and importing
the harness there (SQLAlchemy, the state store, the sink) cost each of them half a second of a cold start.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_stream_provider.runtime.harness import StreamHarness
    from airflow_stream_provider.runtime.result_tables import Result

__all__ = ["Result", "StreamHarness"]
_EXPORTS = {"StreamHarness": "airflow_stream_provider.runtime.harness", "Result": "airflow_stream_provider.runtime.result_tables"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
