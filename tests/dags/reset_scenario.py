"""A DAG that only resets the job (archive the generation, start the next one from the stored offsets),
for tests that kill the reset task itself.  Same params as ``provider_scenarios``."""

from __future__ import annotations

from airflow_stream_provider.operators.reset import ResetStreamingJobOperator
from tests.dags.provider_scenarios import JOB, _dag

with _dag("test_stream_reset") as reset:
    ResetStreamingJobOperator(task_id="reset", reason="{{ params.reason }}", **JOB)
