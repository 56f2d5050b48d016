"""The one stream job the four example DAGs share, configured only through Airflow.

Connections: ``stream_state_default`` (state/results database), ``stream_kafka_default`` (brokers),
``spark_default`` (master and deploy mode) and, for ``hdfs://`` checkpoints, the WebHDFS connection
named by the Variable ``stream_checkpoint_conn_id``.

Variables:

* ``stream_job_spec`` (JSON): the job spec without brokers or database (the connections give those),
  e.g. ``{"job_id": "events", "version": "1.0", "checkpoint_root": "/data/checkpoints",
  "kafka": {"topics": ["events"]}}``;
* ``stream_job_application``: the job file to submit (``spark_jobs/events_job.py``);
* optional: ``stream_spark_conf`` (JSON, extra ``--conf``), ``stream_driver_env`` (JSON, driver
  environment), ``stream_driver_log_dir``, ``stream_checkpoint_conn_id``, ``stream_reset_policy``
  (``auto`` | ``after_preflight`` | ``never``).

``stream_health`` also reads ``stream_job_spec`` when its file is parsed: the job's asset, and its
always-on watcher, need the job id then.  Optional ``stream_watch`` (JSON) sets the watcher's
``heartbeat_timeout``, ``stuck_after`` and ``poll_interval``; the operators judge the job by the same
``heartbeat_timeout`` and ``stuck_after``.

This module holds no DAG: the DAG files import it (Airflow's BundleDagBag puts the bundle's folder
on ``sys.path``).
"""

from __future__ import annotations

import datetime as dt

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import Variable, task
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.diagnosis import MISSING_STANDBY
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.reset import ResetStreamingJobOperator

#: Operator arguments, rendered when a task runs, so a Variable change applies to the next run.
JOB = {
    "spec": "{{ var.json.stream_job_spec }}",
    "application": "{{ var.value.stream_job_application }}",
    "conf": "{{ var.json.get('stream_spark_conf', {}) }}",
    "env_vars": "{{ var.json.get('stream_driver_env', {}) }}",
    "driver_log_dir": "{{ var.value.get('stream_driver_log_dir', '') or None }}",
    "checkpoint_conn_id": "{{ var.value.get('stream_checkpoint_conn_id', '') or None }}",
    # the watcher's thresholds: a recovery that judged the job by others would find HEALTHY the run the
    # watcher reported STUCK, do nothing, and the persisting condition would not be reported again
    "heartbeat_timeout": "{{ var.json.get('stream_watch', {}).get('heartbeat_timeout', 30.0) }}",
    "stuck_after": "{{ var.json.get('stream_watch', {}).get('stuck_after', 300.0) }}",
}
#: What the health sensor needs: the job id and its topics, from the same spec.
WATCH = {
    "job_id": "{{ var.json.stream_job_spec.job_id | tojson }}",  # native: a bare "2024" would be a number
    "topics": "{{ var.json.stream_job_spec.kafka.topics }}",
}
#: A Jinja expression (not a template) so a DAG can combine it with its params.
RESET_POLICY = "var.value.get('stream_reset_policy', 'after_preflight')"
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
#: Native rendering: the spec renders to a dict, the topics to a list.
DAG_ARGS = {"start_date": START, "catchup": False, "render_template_as_native_obj": True,
            "tags": ["stream"]}


def parse_time_variable(key: str):
    """A JSON Variable read while the DAG file is parsed; None when it is not set."""
    return Variable.get(key, default=None, deserialize_json=True)


def next_step(diagnosis: dict) -> str:
    """The task a diagnosis leads to (the branch's choice), in the DAG being defined:

    * DATA_LOSS, POISON: ``needs_a_decision``, which fails loudly with the lost offset ranges or the
      record;
    * CHECKPOINT_INCOMPATIBLE: ``reset`` to a new generation from the stored offsets when the Variable
      ``stream_reset_policy`` is ``auto``, otherwise ``needs_a_decision``, saying how to decide;
    * anything else that needs action (dead driver, stuck query, transient or user-code failure):
      ``recover``, within the restart budget;
    * a healthy job that wants a warm standby and has none (a standby took over, or died): ``recover``,
      which starts one;
    * a stopped or dead run that a restart stopped and started nothing after (its launch failed, its task
      was lost), or that an upgrade stopped whose task then ended without finishing it: ``recover``, which
      finishes the restart (with the code that ran before the upgrade);
    * a healthy run whose driver lives but has gone silent (hung, frozen): ``recover``, which looks again
      when the silence makes it STUCK.  A watcher on another host, which cannot see the process, reports
      it DEAD at once and never again;
    * a run that died or failed while it was being stopped: ``recover``, which leaves it stopped and says so
      (a reset or a restart would undo the stop);
    * a healthy, starting or stopped job: ``healthy``, nothing.
    """
    kind = diagnosis.get("failure_kind")
    if diagnosis.get("interrupted_restart"):  # down because a restart stopped it and launched nothing
        return "recover"
    if diagnosis["health"] == "HEALTHY" and (diagnosis.get("standby") == MISSING_STANDBY
                                             or diagnosis.get("stuck_at")):
        return "recover"
    if diagnosis["health"] in ("HEALTHY", "STARTING", "STOPPED"):
        return "healthy"
    if diagnosis.get("stop_requested_at"):  # ended as it was being stopped: recover says why it leaves it
        return "recover"
    if kind in ("DATA_LOSS", "POISON"):
        return "needs_a_decision"
    if kind == "CHECKPOINT_INCOMPATIBLE":
        policy = Variable.get("stream_reset_policy", default="after_preflight")
        return "reset" if policy == "auto" else "needs_a_decision"
    return "recover"


def steps(diagnosis) -> list:
    """The tasks ``next_step`` chooses among, for a diagnosis (an XCom of it), in the DAG being defined."""

    @task
    def needs_a_decision(diagnosis: dict) -> None:
        """Fail with the evidence (for data loss: the exact lost ranges) and what to do."""
        raise AirflowFailException(
            f"job {diagnosis['job_id']}: {diagnosis['health']}/{diagnosis.get('failure_kind')} "
            f"({diagnosis.get('error_class')}). Evidence: {'; '.join(diagnosis.get('evidence', []))}. "
            f"What to do: {diagnosis.get('advice')}")

    return [
        EmptyOperator(task_id="healthy"),
        # a checkpoint the code cannot use is reset here only where ``next_step`` would reset it too: a retried
        # or cleared recover diagnoses afresh, and may find the run it restarted refused since
        RecoverStreamingJobOperator(task_id="recover", **JOB, on_incompatible=(
            "{{ 'reset' if var.value.get('stream_reset_policy', 'after_preflight') == 'auto' else 'fail' }}")),
        ResetStreamingJobOperator(task_id="reset", reason="checkpoint incompatible (stream_health)", **JOB),
        needs_a_decision(diagnosis),
    ]


def act_on(diagnosis) -> None:
    """A ``choose`` branch on a diagnosis made by another task (an XCom of it), then ``steps``.  A task that
    diagnoses can be the branch itself (``stream_health``'s ``diagnose``), one task run fewer."""

    @task.branch
    def choose(diagnosis: dict) -> str:
        return next_step(diagnosis)

    choose(diagnosis) >> steps(diagnosis)
