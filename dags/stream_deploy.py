"""Manual: submit the stream job (``stream_job.py`` says where its configuration comes from).

Param ``if_running``: ``fail`` (default) refuses a second driver, ``skip`` succeeds without one,
``replace`` stops the running one gracefully first.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param
from stream_job import DAG_ARGS, JOB

from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator

with DAG("stream_deploy", schedule=None, doc_md=__doc__, **DAG_ARGS,
         params={"if_running": Param("fail", enum=["fail", "skip", "replace"])}):
    SubmitStreamingJobOperator(task_id="submit", if_running="{{ params.if_running }}", **JOB)
