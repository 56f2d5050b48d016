"""The one stream job the four example DAGs share, configured only through Airflow.

Connections: ``stream_state_default`` (state/results database), ``stream_kafka_default`` (brokers),
``spark_default`` (master and deploy mode) and, for ``hdfs://`` checkpoints, the WebHDFS connection
named by the Variable ``stream_checkpoint_conn_id``.

Variables:

* ``stream_job_spec`` (JSON): the job spec without brokers or database (the connections give those),
  e.g. ``{"job_id": "events", "version": "1.0", "checkpoint_root": "/data/checkpoints",
  "kafka": {"topics": ["events"]}}``;
* ``stream_job_application``: the job file to submit (``spark_jobs/events_job.py``);
* optional: ``stream_spark_conf`` (JSON, extra ``--conf``), ``stream_driver_env`` (JSON, driver
  environment), ``stream_driver_log_dir``, ``stream_checkpoint_conn_id``, ``stream_reset_policy``
  (``auto`` | ``after_preflight`` | ``never``).

This module holds no DAG: the DAG files import it (Airflow's BundleDagBag puts the bundle's folder
on ``sys.path``).
"""

from __future__ import annotations

import datetime as dt

#: Operator arguments, rendered when a task runs, so a Variable change applies to the next run.
JOB = {
    "spec": "{{ var.json.stream_job_spec }}",
    "application": "{{ var.value.stream_job_application }}",
    "conf": "{{ var.json.get('stream_spark_conf', {}) }}",
    "env_vars": "{{ var.json.get('stream_driver_env', {}) }}",
    "driver_log_dir": "{{ var.value.get('stream_driver_log_dir', '') or None }}",
    "checkpoint_conn_id": "{{ var.value.get('stream_checkpoint_conn_id', '') or None }}",
}
#: What the health sensor needs: the job id and its topics, from the same spec.
WATCH = {
    "job_id": "{{ var.json.stream_job_spec.job_id }}",
    "topics": "{{ var.json.stream_job_spec.kafka.topics }}",
}
#: A Jinja expression (not a template) so a DAG can combine it with its params.
RESET_POLICY = "var.value.get('stream_reset_policy', 'after_preflight')"
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
#: Native rendering: the spec renders to a dict, the topics to a list.
DAG_ARGS = {"start_date": START, "catchup": False, "render_template_as_native_obj": True,
            "tags": ["stream"]}
