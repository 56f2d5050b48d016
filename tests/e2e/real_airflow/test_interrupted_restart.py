"""A STUCK run's restart lost before its launch, on a real Airflow: the job is not left down, nor stuck.

Once the job has applied its first events, the test arms its one hang (``stuck_once_until_stopped.py``):
the batch of the events sent next hangs in the job's results, the driver alive and heartbeating, until its
run is asked to stop: STUCK.  The watcher reports it once, and ``stream_health``'s ``recover`` begins the
restart.
Its task process is then SIGKILLed (``STREAM_FAULT`` in the task's environment, once: a worker lost, an OOM
kill) at one of two points:

* ``restart_after_stop``: the restart's graceful stop has ended the query cleanly (STOPPED: the hang ends when the stop is asked for).  Nobody
  asked for that stop: the run is owed its restart at once.  Before, a STOPPED run made no event and
  branched to ``healthy``, and the job stayed down.
* ``restart_before_stop``: the stop has not reached the driver, which runs on, stuck.  Once Airflow says the
  task that began the restart has ended, the run is owed it.  Before, the run's one STUCK report was spent
  on the lost task, and the job stayed stuck.

Either way the watcher reports the restart owed and a second ``stream_health`` run finishes it (stopping
the stuck driver first where it still runs); the restart begun counts once.  The task has no retry here
(``stream_health_retries`` 0) and the hourly sweep is off: this is the watcher's way, for a task whose
retries are spent or a DAG of one's own without them; a retry would finish the restart as well
(``test_lost_reset.py`` shows a retry at work).
"""

from __future__ import annotations

import pytest

from stack.deployment import task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until
from tests.dagtest.dagruns import FIXTURE_JOBS

#: Seconds for the health DAG to finish a restart its lost task owed: STUCK after 20 s, the watcher's poll
#: (and Airflow's answer), a DAG run behind the failed one, the restart budget's backoff, the stuck run's
#: stop, a driver's cold start on 2 shared cores.  Generous.
REPAIR_TIMEOUT = 300
#: Where the first ``recover`` is lost -> the health its run has when the second one diagnoses it.
LOST_AT = {"restart_after_stop": "STOPPED", "restart_before_stop": "STUCK"}


@pytest.fixture(params=[
    # a STOPPED run owed its restart is reported by the watcher on a real Airflow in test_lost_upgrade.py, and
    # finished after a failed launch in test_provider_dags.py: this variant waits for ``make soak``
    pytest.param("restart_after_stop", marks=pytest.mark.soak),
    "restart_before_stop",
])
def lost_at(request) -> str:
    return request.param


@pytest.fixture
def deployment_options(tmp_path, lost_at) -> dict:
    # stuck_after well past a new driver's first batch on a loaded 2-core machine (4-10 s), so that only
    # the armed hang is STUCK, not the deployment's own start
    return {"watch": {"stuck_after": 20},
            "variables": {"stream_health_retries": "0",
                          "stream_job_application": str(FIXTURE_JOBS / "stuck_once_until_stopped.py")},
            "driver_env": {"STUCK_ONCE_ARM": str(tmp_path / "stuck-once-arm")},
            "airflow_env": task_lost_once(tmp_path, lost_at)}


def test_a_stuck_runs_restart_whose_task_is_lost_is_finished_by_stream_health(deployment, broker, topic, lost_at):
    producer = EventProducer(broker, topic, seed=11)
    producer.send(200)
    deployment.deploy(producer.produced)
    stuck = deployment.latest_run()

    (deployment.workdir / "stuck-once-arm").touch()
    producer.send(100)  # their batch hangs until the run is asked to stop: STUCK 20 s past the trigger interval
    # the hung batch commits as its run stops: the restart is done once another run is live
    restarted = wait_until(lambda: (run := deployment.latest_run()).run_id != stuck.run_id
                           and run.status == "RUNNING" and run, REPAIR_TIMEOUT, "the stuck run restarted")
    producer.send(50)
    deployment.wait_caught_up(producer.produced, timeout=REPAIR_TIMEOUT)
    assert deployment.latest_run().run_id == restarted.run_id, "the restarted run applies what comes next"

    stopped = deployment.store.get_run(stuck.run_id)
    assert stopped.status == "STOPPED" and stopped.stop_requested_at is not None, stopped
    restarts = deployment.store.restarts_since(deployment.job_id, 0)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in restarts] == [
        (stuck.run_id, restarted.run_id)], "the restart begun by the lost task, completed: one attempt"
    assert restarts[0]["task"].startswith("stream_health/") and restarts[0]["task"].endswith("/recover/-1")

    first, found = deployment.lost_then_finished()
    assert (first["health"], first["run_id"], first["interrupted_restart"]) == ("STUCK", stuck.run_id, None), first
    assert (found["health"], found["run_id"]) == (LOST_AT[lost_at], stuck.run_id), found
    assert found["interrupted_restart"]["reason"].startswith(f"job {deployment.job_id}: STUCK"), found
    assert [p["diagnosis"]["interrupted_restart"] is not None for p in found["reported"]] == [True], \
        "the second run was woken by the watcher's report of the restart owed"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)
