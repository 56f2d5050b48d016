"""The soak's health DAG: the provider's own sensor and recover operator, with a restart budget sized
for a soak that kills the driver on purpose every half minute (50 restarts an hour, backoff of at most
4 s, reset after 20 healthy seconds).  A production budget (3 per 30 min) would rightly stop such a
storm.  Same params as ``provider_scenarios``."""

from __future__ import annotations

from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.sensors.health import StreamHealthSensor
from tests.dags.provider_scenarios import JOB, WATCH, _dag

with _dag("test_stream_soak_health") as soak_health:
    StreamHealthSensor(task_id="health", **WATCH) >> RecoverStreamingJobOperator(
        task_id="recover", max_restarts=50, restart_window=3600.0, backoff_base=0.5, backoff_max=4.0,
        healthy_reset=20.0, **JOB)
