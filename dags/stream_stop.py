"""Manual: stop the stream job gracefully (the running batch finishes; SIGTERM and a kill only after
the stop timeout)."""

from __future__ import annotations

from airflow.sdk import DAG
from stream_job import DAG_ARGS, JOB

from airflow_stream_provider.operators.stop import StopStreamingJobOperator

with DAG("stream_stop", schedule=None, doc_md=__doc__, **DAG_ARGS):
    StopStreamingJobOperator(task_id="stop", **JOB)
