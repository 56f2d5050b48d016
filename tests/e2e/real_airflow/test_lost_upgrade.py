"""An upgrade lost between the old run's stop and the new version's start, on a real Airflow: the job is not
left down.

The upgrade's task process is SIGKILLed right after its graceful stop of the old run (``STREAM_FAULT`` in
the task's environment, once: a worker lost, an OOM kill).  No trigger runs for a task that was not
deferred, so nothing undoes the upgrade: its record stays in STOPPING, and its lease names a task Airflow
has failed.  The watcher asks Airflow about the lease's holder, reports the restart owed
(INTERRUPTED_RESTART), and ``stream_health``'s ``recover`` takes the lease over, ends the upgrade as
``killed`` and restarts the code that ran before.  Before, a STOPPED run made no event, and the job stayed
down until a sweep or a person came by.
"""

from __future__ import annotations

import time

import pytest

from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from stack.deployment import task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until
from tests.dagtest.dagruns import FIXTURE_JOBS

#: Seconds for stream_health to bring the job back: the watcher's poll, a DAG run, a driver's cold start on
#: 2 shared cores.  Generous.
REPAIR_TIMEOUT = 240


@pytest.fixture
def deployment_options(tmp_path) -> dict:
    return {"airflow_env": task_lost_once(tmp_path, "upgrade_after_stop")}


def test_an_upgrade_whose_task_is_lost_after_its_stop_leaves_the_old_code_restarted(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=17)
    producer.send(600)
    deployment.deploy(producer.produced)
    old = deployment.latest_run()
    upgrade_run = deployment.airflow.trigger_dag("stream_upgrade", {
        "application": str(FIXTURE_JOBS / "filter_added.py"), "version": "1.1"})
    upgrades = UpgradeLog(deployment.store)

    def lost() -> bool:
        state = deployment.tasks("stream_upgrade", upgrade_run).get("upgrade", (None,))[0]
        return state == "failed"

    wait_until(lost, 300, "the upgrade's task to be lost after its stop")
    lost_at = time.time()
    assert deployment.store.get_run(old.run_id).status == "STOPPED"
    assert not any(r.version == "1.1" for r in deployment.runs()), "the new version was never launched"

    producer.send(300)  # for the restarted run to commit
    restarted = deployment.processing(REPAIR_TIMEOUT, other_than=old.run_id, after=lost_at)
    (repair,) = deployment.repairs(restarted["run_id"])
    restarted = deployment.store.get_run(restarted["run_id"])  # its launch is recorded once recover ends
    assert (restarted.version, restarted.application) == (old.version, old.application), restarted

    ended = upgrades.latest(deployment.job_id)
    assert (ended.phase, ended.result) == (UpgradePhase.DONE, "killed"), ended
    assert "ended without letting go" in ended.detail["killed"], ended.detail
    found = deployment.airflow.xcom("stream_health", repair["dag_run_id"], "diagnose", key="diagnosis")
    assert (found["run_id"], found["health"]) == (old.run_id, "STOPPED"), found
    assert found["interrupted_restart"]["upgrade_id"] == ended.upgrade_id, found

    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)
