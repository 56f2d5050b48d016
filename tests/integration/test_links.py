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


def test_lineage_names_what_the_task_launched_and_the_links_follow(state, monkeypatch):
    """OpenLineage asks at the task's start and again at its end: the end names the run launched in
    between (read afresh, not remembered from the start), and so do the links computed after it."""
    monkeypatch.setenv(*connection_env("stream_kafka_default", conn_type="stream_kafka", host="kafka-1", port=9092))
    spec = {"job_id": "orders", "version": "1", "checkpoint_root": "/ckpt", "kafka": {"topics": ["orders"]}}
    submit = SubmitStreamingJobOperator(task_id="submit", spec=spec, application="job.py")
    started = submit.get_openlineage_facets_on_start()
    assert [(d.namespace, d.name) for d in started.inputs] == [("kafka://kafka-1:9092", "orders")]
    assert started.outputs == [], "no driver has named its tables yet"

    ticket = state.begin_run("orders", 1, "1", log_path="/var/log/stream/orders.log")
    state.record_outputs(ticket.run_id, ["events", "dead_letters"])
    done = submit.get_openlineage_facets_on_complete(None)
    assert sorted(d.name.rsplit(".", 1)[-1] for d in done.outputs) == ["dead_letters", "events"]
    assert _links(submit)["Driver log"].endswith(f"/api/runs/{ticket.run_id}/log")
    stop = StopStreamingJobOperator(task_id="stop", spec=spec)
    assert stop.get_openlineage_facets_on_complete(None).outputs == [], "a stop moves no data"
