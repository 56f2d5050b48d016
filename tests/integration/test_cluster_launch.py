"""A driver launched in cluster deploy mode (YARN, Kubernetes): the cluster manager's handle on it is the
only way to end it, and its run records it once its query runs, on both databases.

No cluster manager can run here: a standalone cluster takes no Python application in cluster mode.  The
controller is real, the state database is real; in the controller's tests the driver hook is a stand-in
that records what the controller asks the cluster manager to kill, and in the hook's own a ``yarn``
script on PATH stands for the YARN CLI, and a stand-in Kubernetes client for the API server."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import pytest

from airflow_stream_provider import recovery
from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import Health
from airflow_stream_provider.hooks.driver import Kill, StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.controller import StreamJobController, StreamJobError
from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
from tests.dagtest import airflow as airflow_stack

HANDLE = "application_1764700000000_0042"


class ClusterManager:
    """What the controller asks of the driver hook for a cluster-mode driver, recorded."""

    def __init__(self):
        self.killed: list[str] = []

    def kill(self, run) -> Kill:
        assert run.submission_id, "a cluster-mode run can only be killed by its handle"
        return self.kill_submission(run.job_id, run.submission_id)

    def kill_submission(self, job_id: str, submission_id: str) -> Kill:
        self.killed.append(submission_id)
        return Kill(True, f"the cluster manager killed {submission_id}")

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
    assert said == Kill(True, f"killed {HANDLE} through its cluster manager")


def test_a_kill_the_cluster_manager_refuses_says_so(tmp_path, monkeypatch):
    _yarn(tmp_path, monkeypatch, 255)
    said = StreamDriverHook("spark_yarn").kill_submission("orders", HANDLE)
    assert not said.done
    assert said.message.startswith(f"could not kill {HANDLE}: yarn application -kill exited 255: Application not found")


def _registered(store, database_url, *, heartbeat_age: float = 0.0) -> tuple[StreamJobController, str]:
    """A cluster run whose query runs, under a controller whose driver hook is the real one on ``spark_yarn``."""
    controller, _ = _controller(database_url)
    controller.driver = StreamDriverHook("spark_yarn")
    ticket = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(ticket.run_id)
    controller.finish_launch(_launch(controller, ticket.run_id), "ready", 60)
    store._update_run(ticket.run_id, heartbeat_at=time.time() - heartbeat_age)
    return controller, ticket.run_id


def test_a_run_whose_kill_the_cluster_manager_refuses_is_not_recorded_dead(state_store, database_url, tmp_path,
                                                                            monkeypatch):
    """Recorded DEAD, a driver that lives on would have a second one started beside it by the next recovery.
    It is left as it is: live while it heartbeats; silent, it is found DEAD (not stopping) and restarted."""
    _yarn(tmp_path, monkeypatch, 255)
    controller, run_id = _registered(state_store, database_url)
    controller.abandon(_launch(controller, run_id), "the query did not start in time")
    run = state_store.get_run(run_id)
    assert run.active and run.stop_requested_at is None, run
    assert controller.probe.check().health == Health.HEALTHY

    state_store._update_run(run_id, heartbeat_at=time.time() - 600)  # it was gone after all
    found = controller.probe.check()
    assert found.health == Health.DEAD and found.stop_requested_at is None, found
    decided = recovery.decide_recovery(found, on_incompatible="fail", budget=RestartBudget(), history=[],
                                       now=time.time())
    assert decided.action == "restart", decided

    ok = tmp_path / "ok"
    ok.mkdir()
    _yarn(ok, monkeypatch, 0)  # the cluster manager answers
    live = state_store.begin_run("orders", 1, "1.0").run_id
    controller.abandon(_launch(controller, live), "the query did not start in time")
    assert state_store.get_run(live).status.value == "DEAD"


def test_a_stop_whose_kill_is_refused_fails_without_starting_anything(state_store, database_url, tmp_path,
                                                                      monkeypatch):
    _yarn(tmp_path, monkeypatch, 255)
    controller, run_id = _registered(state_store, database_url)
    with pytest.raises(StreamJobError, match=r"did not stop: .*could not kill .*Nothing was started beside it"):
        controller.stop_step(run_id, "kill", 1)
    assert state_store.get_run(run_id).active

    silent, _ = _registered(state_store, database_url, heartbeat_age=600)  # gone by its heartbeat: no error
    latest = state_store.latest_run("orders").run_id
    assert silent.stop_step(latest, "kill", 1).run_id == latest


class _ApiException(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _kubernetes(monkeypatch, answer: _ApiException | None) -> list[tuple[str, str]]:
    """The Kubernetes client the Spark provider uses (``airflow.providers.cncf.kubernetes.kube_client``),
    standing in for an API server: neither the cncf provider nor a cluster can run here."""
    deleted: list[tuple[str, str]] = []

    class Client:
        def delete_namespaced_pod(self, pod, namespace, body):
            deleted.append((pod, namespace))
            if answer is not None:
                raise answer

    kube_client = types.SimpleNamespace(get_kube_client=Client, ApiException=_ApiException)
    package = types.ModuleType("airflow.providers.cncf.kubernetes")
    package.kube_client = kube_client
    kubernetes = types.SimpleNamespace(client=types.SimpleNamespace(V1DeleteOptions=dict))
    monkeypatch.setitem(sys.modules, "airflow.providers.cncf", types.ModuleType("airflow.providers.cncf"))
    monkeypatch.setitem(sys.modules, "airflow.providers.cncf.kubernetes", package)
    monkeypatch.setitem(sys.modules, "kubernetes", kubernetes)
    from airflow.providers.apache.spark.hooks import spark_submit

    monkeypatch.setattr(spark_submit, "kube_client", kube_client, raising=False)
    monkeypatch.setenv(*airflow_stack.connection_env("spark_k8s", conn_type="spark", host="k8s://https://k8s",
                                                     port=443, extra={"deploy-mode": "cluster",
                                                                      "namespace": "streams"}))
    return deleted


@pytest.mark.parametrize(("answer", "done"), [(None, True), (_ApiException(404, "Not Found"), True),
                                              (_ApiException(403, "Forbidden"), False),
                                              (OSError("Invalid kube-config file"), False)])
def test_a_kubernetes_driver_pod_is_deleted_and_a_refusal_says_so(monkeypatch, answer, done):
    deleted = _kubernetes(monkeypatch, answer)
    said = StreamDriverHook("spark_k8s").kill_submission("orders", "orders-driver")
    assert deleted == [("orders-driver", "streams")]
    assert said.done is done, said
    if not done:
        assert said.message.endswith("; kill it with kubectl"), said
    if isinstance(answer, _ApiException) and not done:
        assert said.message == ("could not delete driver pod orders-driver: Kubernetes answered 403 Forbidden; "
                                "kill it with kubectl")
