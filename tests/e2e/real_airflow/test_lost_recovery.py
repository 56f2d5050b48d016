"""A dead run's recovery lost before its launch, with no retry left, on a real Airflow: the job comes back.

The driver is SIGKILLed; the watcher reports the run DEAD, once, and ``stream_health``'s ``recover`` begins
the restart, then its task process is SIGKILLed before it launches anything (``STREAM_FAULT`` in the task's
environment, once: a worker lost, an OOM kill).  The task has no retry (``stream_health_retries`` 0: its
retries spent, or a DAG of one's own without them), and the hourly sweep is off.  Before, the run's one
report was spent on the lost task and the job stayed down.  Now the watcher asks Airflow about the task that
began the restart, and once it has ended reports the run again, as owed its restart: a second
``stream_health`` run finishes it.  The restart begun counts once.
"""

from __future__ import annotations

import time

import pytest

from stack.deployment import kill_driver, task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once

#: Seconds for the job to process again: the first recovery and its loss, the watcher's poll and Airflow's
#: answer, a second DAG run, a driver's cold start on 2 shared cores.  Generous.
REPAIR_TIMEOUT = 300


@pytest.fixture
def deployment_options(tmp_path) -> dict:
    return {"variables": {"stream_health_retries": "0"},
            "airflow_env": task_lost_once(tmp_path, "restart_after_stop")}


def test_a_dead_runs_recovery_lost_before_its_launch_is_reported_again_and_finished(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=29)
    producer.send(300)
    deployment.deploy(producer.produced)
    dead = deployment.latest_run()
    killed_at = time.time()
    kill_driver(dead.pid)
    producer.send(200)

    restarted = deployment.processing(REPAIR_TIMEOUT, other_than=dead.run_id, after=killed_at)
    restarts = deployment.store.restarts_since(deployment.job_id, 0)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts] == [(dead.run_id, restarted["run_id"])], \
        "the restart begun by the lost task, completed by the next recovery: one attempt"
    assert restarts[0]["task"].startswith("stream_health/") and restarts[0]["task"].endswith("/recover/-1")

    first, found = deployment.lost_then_finished()
    assert (first["health"], first["run_id"], first["interrupted_restart"]) == ("DEAD", dead.run_id, None), first
    assert (found["health"], found["run_id"]) == ("DEAD", dead.run_id), found
    assert found["interrupted_restart"]["failed_run_id"] == dead.run_id, found
    assert [p["diagnosis"]["interrupted_restart"] is not None for p in found["reported"]] == [True], \
        "the second run was woken by the watcher's new report: the restart owed"

    deployment.wait_caught_up(producer.produced)
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)

