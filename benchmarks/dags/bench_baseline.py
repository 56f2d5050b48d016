"""The baseline the benchmarks compare with: what a team does today without this provider.

The same job file and spec, run attached under the Spark provider's ``SparkSubmitOperator`` with
Airflow task retries.  A dead driver fails the task; Airflow retries it after ``retry_delay`` and the
job restarts from its checkpoint.  There is no health check, no stop marker and no reset: a checkpoint
the new code cannot read fails every retry until a person intervenes.

Configured by ``run_conf``: ``application``, ``spec`` (JSON string), ``conf``, ``env_vars``.  The retry
delay is 5 s here; Airflow's default is 300 s (``[core] default_task_retry_delay``).
"""

from __future__ import annotations

import datetime as dt

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG

RETRY_DELAY = dt.timedelta(seconds=5)

with DAG("bench_baseline", schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), catchup=False,
         render_template_as_native_obj=True, tags=["benchmark"],
         params={"application": "", "spec": "", "conf": {}, "env_vars": {}}):
    SparkSubmitOperator(
        task_id="spark_submit",
        application="{{ params.application }}",
        application_args=["--spec", "{{ params.spec }}"],
        conf="{{ params.conf }}",
        env_vars="{{ params.env_vars }}",
        conn_id="spark_default",
        name="baseline-{{ run_id }}",
        retries=30,  # enough for every kill of the benchmarks' longest series
        retry_delay=RETRY_DELAY,
        retry_exponential_backoff=False,
    )
