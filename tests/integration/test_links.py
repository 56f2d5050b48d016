"""Every operator and sensor links to its run's driver log and Spark UI, from a real state database
(SQLite and PostgreSQL): the links Airflow stores when a task try ends, and none where there is no target."""

from __future__ import annotations

import logging

import pytest

from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from airflow_stream_provider.sensors.health import StreamHealthSensor
from tests.dagtest.airflow import connection_env

BASE = "http://airflow.example:8080/ui-root/"


@pytest.fixture
def state(store, database_url, monkeypatch):
    monkeypatch.setenv(*connection_env("stream_state_default", conn_type="stream_state",
                                       extra={"url": database_url}))
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", BASE)
    return store


def _links(operator) -> dict[str, str]:
    return {link.name: link.get_link(operator, ti_key=None) for link in operator.operator_extra_links}


def _submit(task_id="submit"):
    return SubmitStreamingJobOperator(task_id=task_id, spec={"job_id": "orders"}, application="job.py")


def test_a_running_driver_links_to_its_log_and_its_spark_ui(state):
    ticket = state.begin_run("orders", 1, "1.0", log_path="/var/log/stream/orders-1.log")
    state.record_ui_url(ticket.run_id, "http://worker-7:4041")
    state.mark_query_started(ticket.run_id)

    for operator in (_submit(), StreamHealthSensor(task_id="watch", job_id="orders", topics=["orders"])):
        assert _links(operator) == {
            "Driver log": f"http://airflow.example:8080/ui-root/stream-status/api/runs/{ticket.run_id}/log",
            "Spark UI": "http://worker-7:4041"}


def test_an_ended_run_keeps_its_log_link_but_not_its_dead_ui(state):
    ticket = state.begin_run("orders", 1, "1.0", log_path="/var/log/stream/orders-1.log")
    state.record_ui_url(ticket.run_id, "http://worker-7:4041")
    state.finish_run(ticket.run_id, status="STOPPED", exit_code=0)

    found = _links(StopStreamingJobOperator(task_id="stop", spec={"job_id": "orders"}))
    assert found["Driver log"].endswith(f"/stream-status/api/runs/{ticket.run_id}/log")
    assert found["Spark UI"] == ""


def test_no_link_without_a_target(state):
    assert _links(_submit()) == {"Driver log": "", "Spark UI": ""}, "the job never ran"
    state.begin_run("orders", 1, "1.0", log_path=None)  # a cluster-mode driver; its UI is off
    assert _links(_submit("again")) == {"Driver log": "", "Spark UI": ""}


def test_an_unreadable_state_database_costs_the_links_not_the_task(monkeypatch, caplog):
    monkeypatch.setenv(*connection_env("stream_state_default", conn_type="stream_state",
                                       extra={"url": "postgresql://stream@127.0.0.1:9/none"}))
    with caplog.at_level(logging.WARNING, logger="airflow_stream_provider.links"):
        assert _links(_submit()) == {"Driver log": "", "Spark UI": ""}
    assert "cannot be read" in caplog.text
