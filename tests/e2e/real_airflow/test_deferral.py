"""Deferrable operators on a real Airflow: a submit that waits for its driver holds no worker slot, and a
health sensor waits in the triggerer until the driver dies."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from stack.deployment import StreamDeployment, dags_with, kill_driver
from stack.jobs import wait_until

#: A submit and a probe in a pool of one slot.  The probe returns once the submit's driver registered its
#: run, so it cannot end before the submit began; it ends before the submit does only if it got the slot
#: while the submit waited for its query to start, i.e. the deferred submit gave the slot back.  The
#: health sensor (deferrable, the default, outside the pool) then waits for the driver's death.
POOLED_DAG = '''
import time

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Variable
from stream_job import DAG_ARGS, JOB, WATCH

from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from airflow_stream_provider.sensors.health import StreamHealthSensor


def launched():
    job_id = Variable.get("stream_job_spec", deserialize_json=True)["job_id"]
    state, deadline = StreamStateHook(), time.monotonic() + 300
    while state.latest_run(job_id) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the submit registered no run within 300s")
        time.sleep(0.2)
    return "ran"


with DAG("stream_pooled", schedule=None, **DAG_ARGS):
    submit = SubmitStreamingJobOperator(task_id="submit", pool="one_slot", priority_weight=10, **JOB)
    submit >> StreamHealthSensor(task_id="health", fire_on=["DEAD"], poke_interval=1, **WATCH)
    PythonOperator(task_id="probe", pool="one_slot", priority_weight=1, python_callable=launched)
'''


@pytest.fixture
def pooled(broker, topic, job_id, tmp_path):
    # Without the example DAGs: their watcher would have stream_health restart the killed job, and the
    # sensor, which judges the job's latest run, could find the restarted one before the dead one.
    dags = dags_with(tmp_path, ("stream_job.py",), stream_pooled=POOLED_DAG)
    instance = StreamDeployment(tmp_path, broker, job_id, topic, dags_folder=dags, dag_ids=("stream_pooled",))
    try:
        yield instance.start()
    finally:
        instance.stop(graceful=False)  # the test is over: its deployment needs no clean shutdown


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_a_deferred_submit_leaves_its_pool_slot_to_another_task(pooled):
    pooled.airflow._request("POST", "/pools", ok=(200, 201, 409),  # 409: an earlier attempt made it
                            json={"name": "one_slot", "slots": 1, "include_deferred": False})
    run_id = pooled.airflow.trigger_dag("stream_pooled")
    # The health sensor found the job healthy and handed its wait to the triggerer; then the driver dies.
    wait_until(lambda: pooled.tasks("stream_pooled", run_id).get("health", (None,))[0] == "deferred", 300,
               "the health sensor to defer", interval=0.5,
               on_timeout=lambda: f"{pooled.tasks('stream_pooled', run_id)}\n{pooled.explain('stream_pooled', run_id)}")
    victim = pooled.latest_run()
    # "deferred" is recorded before the sensor's task process has exited; a trigger firing before the task
    # supervisor's next heartbeat (1 s here) has the resumed task failed (apache/airflow#66374, #72716).
    time.sleep(2)
    kill_driver(victim.pid)
    run = pooled.airflow.wait_dag_run("stream_pooled", run_id, 120)
    assert run["state"] == "success", pooled.explain("stream_pooled", run_id)
    tasks = pooled.tasks("stream_pooled", run_id)
    found = {ti["task_id"]: ti for ti in pooled.airflow.task_instances("stream_pooled", run_id)}
    submit, probe = found["submit"], found["probe"]
    assert tasks["submit"][1]["action"] == "submitted" and tasks["probe"][1] == "ran", tasks
    # The probe saw the submit's run registered, and ended in the one slot before the submit did.
    assert _at(probe["end_date"]) < _at(submit["end_date"]), (submit, probe)
    # While it waited in the triggerer, the driver's log went into the submit's task log.
    log = pooled.airflow.task_log("stream_pooled", run_id, "submit")
    assert "driver | $ spark-submit" in log, log[-3000:]
    # The trigger saw the death and the sensor's return names it, for a recovery downstream.
    diagnosis = tasks["health"][1]
    assert diagnosis["health"] == "DEAD" and diagnosis["run_id"] == victim.run_id, diagnosis
