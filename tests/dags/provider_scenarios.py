"""DAGs for the provider's end-to-end tests.  Each test passes the job through ``run_conf`` (the DAG
params), the way a person triggers a DAG with a config: nothing about a job is fixed in this file."""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG

from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.reset import ResetStreamingJobOperator
from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from airflow_stream_provider.sensors.health import CheckpointIncompatibilitySensor
from tests.dagtest.observed import ObservedHealthSensor

JOB = {
    "spec": "{{ params.spec }}",
    "application": "{{ params.application }}",
    "conf": "{{ params.conf }}",
    "env_vars": "{{ params.env_vars }}",
    "driver_log_dir": "{{ params.driver_log_dir }}",
    "ready_timeout": "{{ params.ready_timeout }}",
    "heartbeat_timeout": "{{ params.heartbeat_timeout }}",
    "stop_timeout": "{{ params.stop_timeout }}",
    "stuck_after": "{{ params.stuck_after }}",
}
WATCH = {"job_id": "{{ params.spec.job_id }}", "topics": "{{ params.spec.kafka.topics }}", "poke_interval": 1,
         "timeout": 600, "heartbeat_timeout": "{{ params.heartbeat_timeout }}",
         "stuck_after": "{{ params.stuck_after }}"}
PARAMS = {"spec": {}, "application": "", "conf": {}, "env_vars": {}, "driver_log_dir": "", "ready_timeout": 240,
          "heartbeat_timeout": 15, "stop_timeout": 90, "stuck_after": 300, "if_running": "fail",
          "max_restarts": 3, "reason": "test", "reset_policy": "after_preflight", "preflight_timeout": 240,
          "allow_data_loss": False}


def _dag(dag_id: str) -> DAG:
    return DAG(dag_id, schedule=None, start_date=dt.datetime(2026, 1, 1), catchup=False, params=PARAMS,
               render_template_as_native_obj=True, tags=["stream-tests"])


with _dag("test_stream_deploy") as deploy:
    SubmitStreamingJobOperator(task_id="submit", if_running="{{ params.if_running }}", **JOB)

with _dag("test_stream_health") as health:
    ObservedHealthSensor(task_id="health", **WATCH) >> RecoverStreamingJobOperator(
        task_id="recover", max_restarts="{{ params.max_restarts }}", backoff_base=0.2, **JOB)

with _dag("test_stream_recover") as recover:  # what stream_health's branch leads to, on its own
    RecoverStreamingJobOperator(task_id="recover", max_restarts="{{ params.max_restarts }}", backoff_base=0.2,
                                kill_grace=3, **JOB)

with _dag("test_stream_watch") as watch:
    ObservedHealthSensor(task_id="health", **WATCH)

with _dag("test_stream_incompatible") as incompatible:
    CheckpointIncompatibilitySensor(task_id="checkpoint", **WATCH) >> ResetStreamingJobOperator(
        task_id="reset", reason="{{ params.reason }}", **JOB)

with _dag("test_stream_reset") as reset:
    ResetStreamingJobOperator(task_id="reset", reason="{{ params.reason }}",
                              allow_data_loss="{{ params.allow_data_loss }}", **JOB)

with _dag("test_stream_stop") as stop:
    StopStreamingJobOperator(task_id="stop", **JOB)

with _dag("test_stream_upgrade") as upgrade:
    UpgradeStreamingJobOperator(task_id="upgrade", reset_policy="{{ params.reset_policy }}",
                                preflight_timeout="{{ params.preflight_timeout }}",
                                prewarm="{{ params.prewarm | default(false) }}", **JOB)
