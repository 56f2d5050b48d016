"""Every operator and sensor links to its run's driver log and Spark UI, and the launching operators name
their datasets for OpenLineage, from a real state database (SQLite and PostgreSQL): the links Airflow
stores when a task try ends, none where there is no target, and lineage that names the run launched."""

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


def test_lineage_names_what_the_job_writes_and_the_links_follow_the_launch(state, monkeypatch):
    """OpenLineage asks at the task's start and again at its end, reading afresh each time: the end names
    the tables the job's newest writing run recorded (a run still starting is represented by the one
    before it), and the links computed after it name the run launched in between."""
    monkeypatch.setenv(*connection_env("stream_kafka_default", conn_type="stream_kafka", host="kafka-1", port=9092))
    spec = {"job_id": "orders", "version": "1", "checkpoint_root": "/ckpt", "kafka": {"topics": ["orders"]}}
    submit = SubmitStreamingJobOperator(task_id="submit", spec=spec, application="job.py")
    started = submit.get_openlineage_facets_on_start()
    assert [(d.namespace, d.name) for d in started.inputs] == [("kafka://kafka-1:9092", "orders")]
    assert started.outputs == [], "no driver has named its tables yet"

    earlier = state.begin_run("orders", 1, "1", log_path="/var/log/stream/orders-1.log")
    state.record_outputs(earlier.run_id, ["events", "dead_letters"])  # by its sink, at its first batch
    launched = state.begin_run("orders", 1, "2", log_path="/var/log/stream/orders-2.log")  # no batch yet
    done = submit.get_openlineage_facets_on_complete(None)
    assert sorted(d.name.rsplit(".", 1)[-1] for d in done.outputs) == ["dead_letters", "events"]
    state.record_outputs(launched.run_id, ["dead_letters", "events", "kpi_minute"])  # the new code's tables
    again = submit.get_openlineage_facets_on_complete(None)
    assert sorted(d.name.rsplit(".", 1)[-1] for d in again.outputs) == ["dead_letters", "events", "kpi_minute"]
    assert _links(submit)["Driver log"].endswith(f"/api/runs/{launched.run_id}/log")
    stop = StopStreamingJobOperator(task_id="stop", spec=spec)
    assert stop.get_openlineage_facets_on_complete(None).outputs == [], "a stop moves no data"
