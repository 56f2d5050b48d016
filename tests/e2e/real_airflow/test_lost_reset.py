"""A reset lost between its archive and its launch, on a real Airflow: its retry finishes it.

A person deploys version 2.0, which adds a stateful operator, over version 1.0's checkpoint
(``stream_deploy`` with ``if_running=replace``); Spark refuses it at its first batch of data
(CHECKPOINT_INCOMPATIBLE).  The watcher reports the failure once and ``stream_health`` branches to
``reset`` (``stream_reset_policy`` is ``auto``), whose task process is SIGKILLed right after it archived
generation 1 (``STREAM_FAULT`` in the task's environment, once: a worker lost, an OOM kill).  The job is
then down with nothing left to report: the failure persists, and the watcher reported it already.  Before
``stream_health``'s tasks had retries, it stayed down until the hourly sweep (turned off here); now the
task's retry, holding the same lease, starts generation 2 from the offsets stored with the results,
without archiving anything again.

A ``CheckpointIncompatibilitySensor``, deferred in the triggerer from before the new version's deploy,
ends with the refused run's diagnosis and Spark's error class.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stack.deployment import DAG_IDS, dags_with, task_lost_once
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until
from tests.dagtest.dagruns import FIXTURE_JOBS

#: Seconds for the job to process again after the lost reset: the retry's 10 s delay, the scheduler, a
#: driver's cold start on 2 shared cores.  Generous.
REPAIR_TIMEOUT = 240

#: A DAG beside the example ones: a person (or a release pipeline) watching the upgrade for Spark's verdict.
WATCH_DAG = '''
from airflow.sdk import DAG
from stream_job import DAG_ARGS, WATCH

from airflow_stream_provider.sensors.health import CheckpointIncompatibilitySensor

with DAG("stream_checkpoint_watch", schedule=None, **DAG_ARGS):
    CheckpointIncompatibilitySensor(task_id="incompatible", poke_interval=2, **WATCH)
'''


@pytest.fixture
def deployment_options(tmp_path) -> dict:
    return {"variables": {"stream_reset_policy": "auto"},
            "airflow_env": task_lost_once(tmp_path, "reset_after_archive"),
            "dags_folder": dags_with(tmp_path, stream_checkpoint_watch=WATCH_DAG),
            "dag_ids": (*DAG_IDS, "stream_checkpoint_watch")}


def test_a_reset_whose_task_is_lost_after_its_archive_is_finished_by_its_retry(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=23)
    airflow = deployment.airflow
    watching = airflow.trigger_dag("stream_checkpoint_watch")  # its task starts and defers beside the deploy
    producer.send(600)
    deployment.deploy(producer.produced)
    first = deployment.latest_run()
    wait_until(lambda: deployment.tasks("stream_checkpoint_watch", watching) == {"incompatible": ("deferred", None)},
               120, "the checkpoint sensor to wait in the triggerer", interval=0.5,
               on_timeout=lambda: deployment.explain("stream_checkpoint_watch", watching))
    airflow.set_variable("stream_job_application", str(FIXTURE_JOBS / "dedup_by_position.py"))
    airflow.set_variable("stream_job_spec", {**deployment.spec, "version": "2.0"})
    assert deployment.trigger("stream_deploy", if_running="replace")["submit"][0] == "success"
    producer.send(300)  # Spark checks the state at the first batch that reads some: 2.0 fails there
    replaced_at = time.time()

    finished = deployment.processing(REPAIR_TIMEOUT, other_than=first.run_id, after=replaced_at)
    runs = deployment.runs()
    refused = next(r for r in runs if r.version == "2.0" and r.generation == 1)
    assert (refused.status, refused.failure_kind) == ("FAILED", "CHECKPOINT_INCOMPATIBLE"), refused
    assert (finished["version"], finished["generation"]) == ("2.0", 2), finished
    assert airflow.wait_dag_run("stream_checkpoint_watch", watching, 60)["state"] == "success"
    verdict = airflow.xcom("stream_checkpoint_watch", watching, "incompatible")
    assert (verdict["run_id"], verdict["failure_kind"], verdict["error_class"]) == (
        refused.run_id, "CHECKPOINT_INCOMPATIBLE", "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY"), verdict

    (health,) = [r for r in deployment.health_runs()
                 if deployment.tasks("stream_health", r["dag_run_id"]).get("reset", (None,))[0] == "success"]
    (reset,) = [ti for ti in airflow.task_instances("stream_health", health["dag_run_id"]) if ti["task_id"] == "reset"]
    assert reset["try_number"] == 2, "the first try was killed after its archive; its retry finished the reset"
    lost, retry = (airflow.task_log("stream_health", health["dag_run_id"], "reset", n) for n in (1, 2))
    assert "Archived generation 1 of job" in lost, lost[-3000:]
    assert "by an earlier reset that did not start generation 2: starting it now" in retry, retry[-3000:]
    done = airflow.xcom("stream_health", health["dag_run_id"], "reset")
    assert (done["generation"], done["archived_generation"]) == (2, 1), done
    archive = Path(done["archive_path"])
    assert sorted(p.name for p in archive.parent.iterdir()) == [archive.name], "archived once, by the lost try"
    found = airflow.xcom("stream_health", health["dag_run_id"], "diagnose", key="diagnosis")
    assert (found["run_id"], found["failure_kind"]) == (refused.run_id, "CHECKPOINT_INCOMPATIBLE"), found
    (restart,) = deployment.store.restarts_since(deployment.job_id, 0)
    assert (restart["action"], restart["failed_run_id"], restart["new_run_id"]) == (
        "reset", refused.run_id, finished["run_id"]), "begun for the failed run before the archive, completed once"
    assert restart["task"] == f"stream_health/{health['dag_run_id']}/reset/-1", restart

    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)
