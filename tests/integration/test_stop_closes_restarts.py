"""A stop someone asks for closes a restart that stopped the job and launched nothing, on both databases:
the next recovery must not start the job that person stopped.  The stop operator runs here for real
against the state database; the job is not running, so no driver is involved."""

from __future__ import annotations

from airflow_stream_provider import diagnosis
from airflow_stream_provider.diagnosis import Health, Thresholds
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.recovery import interrupted_restart

JOB = "orders"


def test_a_stop_closes_a_restart_that_stopped_the_job_and_launched_nothing(state_store):
    stuck = state_store.begin_run(JOB, 1, "1.0")
    state_store.mark_query_started(stuck.run_id)
    state_store.record_restart(JOB, "restart", "STUCK: no batch for 600s", stuck.run_id, None)  # begun
    state_store.request_stop(stuck.run_id)  # the restart's own stop, which ended the run; its launch failed
    state_store.finish_run(stuck.run_id, status="STOPPED", exit_code=0, message="stopped")
    found = diagnosis.diagnose(JOB, state_store.get_run(stuck.run_id), driver_alive=None, lag=0)
    assert interrupted_restart(found, state_store.restarts_since(JOB, 0)) is not None
    owed = _probe().check()  # what the health DAG, the recover task and the sensors see
    assert owed.health == Health.STOPPED and owed.interrupted_restart["reason"] == "STUCK: no batch for 600s"

    stopped = StopStreamingJobOperator(task_id="stop", spec={"job_id": JOB, "version": "1.0",
                                                             "kafka": {"topics": [JOB]}, "checkpoint_root": "/ck"})
    assert stopped.execute(context={})["outcome"] == "not running"
    history = state_store.restarts_since(JOB, 0)
    assert interrupted_restart(found, history) is None, history
    assert history[-1]["cancelled_at"] is not None and history[-1]["new_run_id"] is None
    assert _probe().check().interrupted_restart is None, "the stop someone asked for stands"


def _probe() -> HealthProbe:
    return HealthProbe.connect(JOB, [JOB], "stream_state_default", "stream_kafka_default", Thresholds())
