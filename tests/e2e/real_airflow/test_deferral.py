"""Deferrable operators on a real Airflow: a submit that waits for its driver holds no worker slot."""

from __future__ import annotations

from datetime import datetime

import pytest

from stack.deployment import StreamDeployment
from stack.jobs import REPO

#: A submit and a probe in a pool of one slot.  The probe returns once the submit's driver registered its
#: run, so it cannot end before the submit began; it ends before the submit does only if it got the slot
#: while the submit waited for its query to start, i.e. the deferred submit gave the slot back.
POOLED_DAG = '''
import time

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Variable
from stream_job import DAG_ARGS, JOB

from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator


def launched():
    job_id = Variable.get("stream_job_spec", deserialize_json=True)["job_id"]
    state, deadline = StreamStateHook(), time.monotonic() + 300
    while state.latest_run(job_id) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the submit registered no run within 300s")
        time.sleep(0.2)
    return "ran"


with DAG("stream_pooled", schedule=None, **DAG_ARGS):
    SubmitStreamingJobOperator(task_id="submit", pool="one_slot", priority_weight=10, **JOB)
    PythonOperator(task_id="probe", pool="one_slot", priority_weight=1, python_callable=launched)
'''


@pytest.fixture
def pooled(broker, topic, job_id, tmp_path):
    dags = tmp_path / "dags"
    dags.mkdir()
    for source in (REPO / "dags").glob("*.py"):
        (dags / source.name).symlink_to(source)
    (dags / "stream_pooled.py").write_text(POOLED_DAG)
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
    tasks = pooled.trigger("stream_pooled")
    state, run_id = tasks["_run"]
    assert state == "success", pooled.explain("stream_pooled", run_id)
    found = {ti["task_id"]: ti for ti in pooled.airflow.task_instances("stream_pooled", run_id)}
    submit, probe = found["submit"], found["probe"]
    assert tasks["submit"][1]["action"] == "submitted" and tasks["probe"][1] == "ran", tasks
    # The probe saw the submit's run registered, and ended in the one slot before the submit did.
    assert _at(probe["end_date"]) < _at(submit["end_date"]), (submit, probe)
    # While it waited in the triggerer, the driver's log went into the submit's task log.
    log = pooled.airflow.task_log("stream_pooled", run_id, "submit")
    assert "driver | $ spark-submit" in log, log[-3000:]
