"""The provider against a real Spark standalone cluster: master and worker on loopback, the driver
submitted through the provider with a ``spark://`` master (client deploy mode: the only one standalone
offers Python applications), executors on the worker.  SIGKILL the driver, recover, exactly-once."""

from __future__ import annotations

import signal

import pytest

from airflow_stream_provider.hooks.driver import StreamDriverHook
from stack.events import EventProducer
from stack.jobs import TEST_SPARK_CONF, check_exactly_once
from stack.standalone import StandaloneCluster
from tests.dags import provider_scenarios as dags
from tests.dagtest import airflow as airflow_stack
from tests.dagtest.dagruns import caught_up, deployed, run_dag


@pytest.fixture
def cluster(tmp_path):
    instance = StandaloneCluster(tmp_path / "spark-cluster").start()
    yield instance
    instance.stop()


def test_standalone_cluster_kill9_and_recover(stream, cluster, broker, monkeypatch, figures):
    monkeypatch.setenv(*airflow_stack.connection_env(
        "spark_default", conn_type="spark", host="spark://127.0.0.1", port=cluster.port,
        extra={"deploy-mode": "client", "spark-binary": "spark-submit"}))
    state, job_id = stream["state"], stream["job_id"]
    params = {**stream["params"], "conf": {**TEST_SPARK_CONF, "spark.executor.memory": "768m",
                                           "spark.cores.max": "2"}}
    producer = EventProducer(broker, stream["topic"])
    producer.send(2000)

    first = deployed(dags.deploy, params, state, job_id, producer)
    apps = cluster.state()["activeapps"]
    assert [a["name"] for a in apps] == [f"stream-{job_id}-1.0"], apps  # the executors run on the cluster

    producer.send(800)
    StreamDriverHook._signal(state.store.get_run(first["run_id"]), signal.SIGKILL)
    status, tasks = run_dag(dags.health, params)
    assert status == "success", tasks
    assert tasks["health"][1]["health"] == "DEAD" and tasks["recover"][1]["action"] == "restart", tasks
    assert state.store.get_run(first["run_id"]).status == "DEAD"

    producer.send(700)
    caught_up(state, job_id, producer)
    assert [a["name"] for a in cluster.state()["activeapps"]] == [f"stream-{job_id}-1.0"]
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(state.store, job_id, producer.produced)
    figures.record("standalone cluster: kill -9 -> recovered", applications=len(cluster.state()["completedapps"]),
                   **counts)
