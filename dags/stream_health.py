"""Scheduled every 5 minutes: watch the stream job, and act on what the watch finds.

The sensor defers (no worker slot) for up to 4 minutes, looking every 2 seconds (one state-database
query and a process check in the triggerer), and fires when the job is DEAD, STUCK or FAILED;
a healthy job makes it time out softly, and the run ends skipped: nothing to do. Then:

* DATA_LOSS: fail loudly with the lost offset ranges; no automatic action can be right;
* CHECKPOINT_INCOMPATIBLE: reset to a new generation from the stored offsets when the Variable
  ``stream_reset_policy`` is ``auto``, otherwise fail saying how to decide;
* anything else (dead driver, stuck query, transient or user-code failure): recover, within the restart
  budget (RecoverStreamingJobOperator's table says what it does for each).
"""

from __future__ import annotations

import datetime as dt

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Variable, task
from airflow.sdk.exceptions import AirflowFailException
from stream_job import DAG_ARGS, JOB, WATCH

from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.reset import ResetStreamingJobOperator
from airflow_stream_provider.sensors.health import StreamHealthSensor

with DAG("stream_health", schedule=dt.timedelta(minutes=5), max_active_runs=1, doc_md=__doc__, **DAG_ARGS):
    health = StreamHealthSensor(task_id="health", timeout=dt.timedelta(minutes=4).total_seconds(),
                                soft_fail=True, poke_interval=2, **WATCH)

    @task.branch
    def choose(diagnosis: dict) -> str:
        kind = diagnosis.get("failure_kind")
        if diagnosis["health"] in ("HEALTHY", "STARTING", "STOPPED"):
            return "healthy"
        if kind in ("DATA_LOSS", "POISON"):
            return "needs_a_decision"
        if kind == "CHECKPOINT_INCOMPATIBLE":
            policy = Variable.get("stream_reset_policy", default="after_preflight")
            return "reset" if policy == "auto" else "needs_a_decision"
        return "recover"

    @task
    def needs_a_decision(diagnosis: dict) -> None:
        """Fail with the evidence (for data loss: the exact lost ranges) and what to do."""
        raise AirflowFailException(
            f"job {diagnosis['job_id']}: {diagnosis['health']}/{diagnosis.get('failure_kind')} "
            f"({diagnosis.get('error_class')}). Evidence: {'; '.join(diagnosis.get('evidence', []))}. "
            f"What to do: {diagnosis.get('advice')}")

    choice = choose(health.output)
    choice >> [
        EmptyOperator(task_id="healthy"),
        RecoverStreamingJobOperator(task_id="recover", **JOB),
        ResetStreamingJobOperator(task_id="reset", reason="checkpoint incompatible (stream_health)", **JOB),
        needs_a_decision(health.output),
    ]
