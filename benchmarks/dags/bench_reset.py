"""Manual reset-and-resume of the example job (the step ``stream_health`` takes for an incompatible
checkpoint when ``stream_reset_policy`` is ``auto``), as its own DAG so the benchmarks can time it on a
healthy job: graceful stop, archive the generation, start n+1 from the stored offsets."""

from __future__ import annotations

from airflow.sdk import DAG
from stream_job import DAG_ARGS, JOB

from airflow_stream_provider.operators.reset import ResetStreamingJobOperator

with DAG("bench_reset", schedule=None, doc_md=__doc__, **{**DAG_ARGS, "tags": ["benchmark"]}):
    ResetStreamingJobOperator(task_id="reset", reason="benchmark: reset-and-resume", **JOB)
