"""A STUCK run's recovery lost before its stop, with no retry left, on a real Airflow: the job comes back.

The job's trigger interval is ten minutes, so once events arrive after its first batch the query sits idle
with a lag: STUCK.  The watcher reports it once, and ``stream_health``'s ``recover`` begins the restart; its
task process is then SIGKILLed before its stop reaches the driver (``STREAM_FAULT`` in the task's
environment, once: a worker lost, an OOM kill).  The driver runs on, stuck.  The task has no retry
(``stream_health_retries`` 0) and the hourly sweep is off.  Before, the run's one STUCK report was spent on
the lost task and the job stayed stuck.  Now the watcher asks Airflow about the task that began the restart,
and once it has ended reports the run again, as owed its restart: a second ``stream_health`` run stops the
stuck driver and finishes the restart.  The restart begun counts once.
"""

from __future__ import annotations

import pytest

from stack.deployment import task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until

#: Seconds for the job to process again: STUCK after 8 s, the first recovery and its loss, the watcher's
#: poll and Airflow's answer, a second DAG run, the stuck run's stop, a cold start on 2 shared cores.
REPAIR_TIMEOUT = 300


@pytest.fixture
def deployment_options(tmp_path) -> dict:
    return {"spec": {"trigger_interval": "10 minutes"}, "watch": {"stuck_after": 8},
            "variables": {"stream_health_retries": "0"},
            "airflow_env": task_lost_once(tmp_path, "restart_before_stop")}


def test_a_stuck_runs_recovery_lost_before_its_stop_is_reported_again_and_finished(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=37)
    producer.send(200)
    deployment.deploy(producer.produced)
    stuck = deployment.latest_run()

    producer.send(100)  # read at the next trigger, ten minutes away: STUCK after 8 s
    deployment.wait_caught_up(producer.produced, timeout=REPAIR_TIMEOUT)
    restarted = deployment.latest_run()
    assert restarted.run_id != stuck.run_id and restarted.status == "RUNNING", restarted
    stopped = deployment.store.get_run(stuck.run_id)
    assert stopped.status == "STOPPED" and stopped.stop_requested_at is not None, \
        ("the second recovery stopped the stuck run", stopped)
    restarts = deployment.store.restarts_since(deployment.job_id, 0)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts] == [(stuck.run_id, restarted.run_id)], \
        "the restart begun by the lost task, completed by the next recovery: one attempt"
    assert restarts[0]["task"].startswith("stream_health/") and restarts[0]["task"].endswith("/recover/-1")

    lost, finished = wait_until(lambda: deployment.ended_recovers(2), 60, "both stream_health runs' recover tasks ended")
    assert lost[1] == "failed", "the first recover task was killed between its begin and its stop"
    assert finished[1] == "success", deployment.explain("stream_health", finished[0])
    first = deployment.airflow.xcom("stream_health", lost[0], "diagnose", key="diagnosis")
    assert (first["health"], first["run_id"], first["interrupted_restart"]) == ("STUCK", stuck.run_id, None), first
    found = deployment.airflow.xcom("stream_health", finished[0], "diagnose", key="diagnosis")
    assert (found["health"], found["run_id"]) == ("STUCK", stuck.run_id), found
    assert found["interrupted_restart"]["failed_run_id"] == stuck.run_id, found
    assert [p["diagnosis"]["interrupted_restart"] is not None for p in found["reported"]] == [True], \
        "the second run was woken by the watcher's new report: the restart owed"

    check_exactly_once(deployment.store, deployment.job_id, producer.produced)
