"""A driver launched in cluster deploy mode (YARN, Kubernetes): the cluster manager's handle on it is the
only way to end it, and its run records it once its query runs, on both databases.

No cluster manager can run here: a standalone cluster takes no Python application in cluster mode.  The
controller is real, the state database is real; in the controller's tests the driver hook is a stand-in
that records what the controller asks the cluster manager to kill, and in the hook's own a ``yarn``
script on PATH stands for the YARN CLI."""

from __future__ import annotations

import os
import time
from pathlib import Path

from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.controller import StreamJobController
from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
from tests.dagtest import airflow as airflow_stack

HANDLE = "application_1764700000000_0042"


class ClusterManager:
    """What the controller asks of the driver hook for a cluster-mode driver, recorded."""

    def __init__(self):
        self.killed: list[str] = []

    def kill(self, run) -> str:
        assert run.submission_id, "a cluster-mode run can only be killed by its handle"
        return self.kill_submission(run.job_id, run.submission_id)

    def kill_submission(self, job_id: str, submission_id: str) -> str:
        self.killed.append(submission_id)
        return f"asked the cluster manager to kill {submission_id}"

    @staticmethod
    def is_alive(run):
        return None


def _controller(database_url: str) -> tuple[StreamJobController, ClusterManager]:
    spec = StreamJobSpec("orders", "1.0", KafkaSpec("127.0.0.1:9092", ("orders",)), "/tmp/ckpt", database_url)
    manager = ClusterManager()
    return StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(), driver=manager), manager


def _launch(controller: StreamJobController, run_id: str) -> dict:
    spec = controller.spec
    return {"job_id": spec.job_id, "run_id": run_id, "pid": None, "host": None, "log_path": None,
            "submission_id": HANDLE, "submitted_at": time.time(), "generation": 1, "version": spec.version,
            "application": "/jobs/orders.py", "spec": spec.to_json(), "checkpoint_path": spec.checkpoint_path}


def test_a_cluster_run_records_its_handle_once_its_query_runs(state_store, database_url):
    controller, _ = _controller(database_url)
    ticket = state_store.begin_run("orders", 1, "1.0")  # the driver registers: it cannot know its handle
    state_store.mark_query_started(ticket.run_id)
    ready = controller.finish_launch(_launch(controller, ticket.run_id), "ready", 60)
    assert ready["submission_id"] == HANDLE
    assert state_store.get_run(ticket.run_id).submission_id == HANDLE


def test_an_abandoned_cluster_launch_is_killed_by_its_handle_registered_or_not(state_store, database_url):
    controller, manager = _controller(database_url)
    controller.abandon(_launch(controller, "never-registered"), "the task was killed")
    ticket = state_store.begin_run("orders", 1, "1.0")  # registered, its query not started
    controller.abandon(_launch(controller, ticket.run_id), "the query did not start in time")
    assert manager.killed == [HANDLE, HANDLE]
    assert state_store.get_run(ticket.run_id).status.value == "DEAD"


def _yarn(tmp_path, monkeypatch, exit_code: int) -> Path:
    """A ``yarn`` command on PATH that records its arguments: the YARN CLI the kill runs (no YARN here)."""
    calls = tmp_path / "yarn-calls"
    script = tmp_path / "bin" / "yarn"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                      f'[ {exit_code} = 0 ] || echo "Application not found" >&2\nexit {exit_code}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    monkeypatch.setenv(*airflow_stack.connection_env("spark_yarn", conn_type="spark", host="yarn",
                                                     extra={"deploy-mode": "cluster"}))
    return calls


def test_a_yarn_driver_is_killed_through_the_yarn_cli(tmp_path, monkeypatch):
    calls = _yarn(tmp_path, monkeypatch, 0)
    said = StreamDriverHook("spark_yarn").kill_submission("orders", HANDLE)
    assert calls.read_text().split() == ["application", "-kill", HANDLE]
    assert said == f"killed {HANDLE} through its cluster manager"


def test_a_kill_the_cluster_manager_refuses_says_so(tmp_path, monkeypatch):
    _yarn(tmp_path, monkeypatch, 255)
    said = StreamDriverHook("spark_yarn").kill_submission("orders", HANDLE)
    assert said.startswith(f"could not kill {HANDLE}: yarn application -kill exited 255: Application not found")
