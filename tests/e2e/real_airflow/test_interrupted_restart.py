"""A restart lost between its stop and its launch, on a real Airflow: the job is not left down.

The job's trigger interval is ten minutes, so once events arrive after its first batch the query sits idle
with a lag: STUCK.  ``stream_health`` restarts it; the restart's graceful stop ends the idle query cleanly
(STOPPED), and its task process is then SIGKILLed before it launches anything (``STREAM_FAULT`` in the
task's environment, once: a worker lost, an OOM kill).  Nobody asked for that stop: the watcher reports the
restart owed, and ``stream_health`` finishes it.  Before, a STOPPED run made no event and branched to
``healthy``, and the job stayed down.  The task has no retry here (``stream_health_retries`` 0): this is
the watcher's way, for a task whose retries are spent or a DAG of one's own without them; a retry would
finish the restart as well (``test_lost_reset.py`` shows a retry at work).
"""

from __future__ import annotations

import pytest

from stack.deployment import task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until

#: Seconds for the health DAG to finish a restart its lost task owed: the watcher's poll, a DAG run behind
#: the failed one, the restart budget's backoff, a driver's cold start on 2 shared cores.  Generous.
REPAIR_TIMEOUT = 300


@pytest.fixture
def deployment_options(tmp_path) -> dict:
    return {"spec": {"trigger_interval": "10 minutes"}, "watch": {"stuck_after": 8},
            "variables": {"stream_health_retries": "0"},
            "airflow_env": task_lost_once(tmp_path, "restart_after_stop")}


def test_a_restart_whose_task_is_lost_after_its_stop_is_finished_by_stream_health(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=11)
    producer.send(200)
    deployment.deploy(producer.produced)
    stuck = deployment.latest_run()

    producer.send(100)  # read at the next trigger, ten minutes away: STUCK after 8 s
    deployment.wait_caught_up(producer.produced, timeout=REPAIR_TIMEOUT)
    restarted = deployment.latest_run()
    assert restarted.run_id != stuck.run_id and restarted.status == "RUNNING", restarted

    stopped = deployment.store.get_run(stuck.run_id)
    assert stopped.status == "STOPPED" and stopped.stop_requested_at is not None, stopped
    restarts = deployment.store.restarts_since(deployment.job_id, 0)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts] == [
        (stuck.run_id, restarted.run_id)], "the restart begun by the lost task, completed: one attempt"

    runs = wait_until(lambda: deployment.ended_recovers(2), 60, "both stream_health runs' recover tasks ended")
    (lost, finished) = runs
    assert lost[1] == "failed", "the first recover task was killed between its stop and its launch"
    assert finished[1] == "success", deployment.explain("stream_health", finished[0])
    found = deployment.airflow.xcom("stream_health", finished[0], "diagnose", key="diagnosis")
    assert found["health"] == "STOPPED" and found["run_id"] == stuck.run_id, found
    assert found["interrupted_restart"]["reason"].startswith(f"job {deployment.job_id}: STUCK"), found
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)

