"""Watch the stream job continuously, and act on what the watch finds.

The job's asset ``stream://<job_id>`` has an always-on watcher in the triggerer: every transition of a
run into DEAD, STUCK or FAILED becomes one asset event carrying the diagnosis, and this DAG runs on it
within seconds.  A persisting condition does not fire again.  Once an hour the DAG also runs without an
event, as a safety net, and takes the same decision (the Variable ``stream_health_sweep``: another cron
expression, or ``off``).

Each run diagnoses the job afresh (the reported event is evidence: a run queued behind another may find
the job already repaired), and the same task chooses what to do, as ``stream_job.next_step`` says (one
task run instead of two: about half a second less before a dead job's recovery starts): recover a dead,
stuck or failed job within the restart budget; reset an incompatible checkpoint when
``stream_reset_policy`` is ``auto``; fail loudly with the evidence where a person must decide (data loss,
a poison record); nothing for a healthy job, unless its driver lives but has gone silent (hung): then
``recover`` waits until the silence makes it STUCK.  The diagnosis is the XCom ``diagnosis`` of ``diagnose``.

Its tasks are retried (the Variable ``stream_health_retries``, 2 by default, 10 s apart): the watcher
reports a condition once, and reports a dead or failed run again only once the task that began its restart
has ended without launching it, so a ``recover`` or ``reset`` whose worker was lost before that, or that met
the database or the brokers away, would otherwise leave the job down until the hourly sweep.  A retry holds
the task's lease and diagnoses afresh; a failure no retry can fix (the restart budget spent, a decision a
person must take) fails at once.

The watcher needs the job id when this file is parsed, from the Variable ``stream_job_spec``; until it
is set, only the hourly sweep runs.
"""

from __future__ import annotations

import datetime as dt
import logging

from airflow.sdk import DAG, AssetOrTimeSchedule, CronTriggerTimetable, Variable, task
from airflow.sdk.exceptions import AirflowFailException
from stream_job import DAG_ARGS, WATCH, next_step, parse_time_variable, steps

from airflow_stream_provider.assets.stream import stream_job_asset
from airflow_stream_provider.diagnosis import Thresholds
from airflow_stream_provider.lifecycle.health import HealthProbe

log = logging.getLogger(__name__)
#: The safety net's cron (UTC): hourly, off the hour, unless the Variable ``stream_health_sweep`` gives
#: another, or ``off`` to run on the watcher's events alone.
SWEEP_CRON = Variable.get("stream_health_sweep", default=None) or "17 * * * *"
SWEEP = None if SWEEP_CRON.strip().lower() == "off" else CronTriggerTimetable(SWEEP_CRON, timezone="UTC")
SPEC = parse_time_variable("stream_job_spec")
WATCH_SETTINGS = parse_time_variable("stream_watch") or {}
WATCHED = stream_job_asset(SPEC["job_id"], **WATCH_SETTINGS) if SPEC else None
SCHEDULE = AssetOrTimeSchedule(timetable=SWEEP, assets=WATCHED) if WATCHED and SWEEP else WATCHED or SWEEP
RETRIES = {"retries": int(Variable.get("stream_health_retries", default=2)), "retry_delay": dt.timedelta(seconds=10)}

with DAG("stream_health", schedule=SCHEDULE, max_active_runs=1, doc_md=__doc__, default_args=RETRIES, **DAG_ARGS):

    @task.branch
    def diagnose(job_id: str, topics: list[str], triggering_asset_events=None, ti=None) -> str:
        """A fresh diagnosis, with the events that woke this run as evidence, and the step it leads to."""
        reported = [event.extra.get("payload", {}) for events in (triggering_asset_events or {}).values()
                    for event in events]
        for payload in reported:
            log.info("The watcher reported: %s", payload.get("message"))
        settings = {**{"heartbeat_timeout": 30.0, "stuck_after": 300.0}, **WATCH_SETTINGS}
        probe = HealthProbe.connect(job_id, topics, "stream_state_default", "stream_kafka_default",
                                    Thresholds(settings["heartbeat_timeout"], settings["stuck_after"]))
        try:
            found = probe.check().to_dict()
        finally:
            probe.close()
        errors = [p["message"] for p in reported if p.get("status") == "error"]
        if errors and found["run_id"] is None:  # the watcher could not place the job: say why, loudly
            raise AirflowFailException(f"job {job_id}: {errors[-1]}")
        found["reported"] = reported
        log.info("Diagnosis now: job %s: %s %s: %s", job_id, found["health"], found.get("failure_kind") or "",
                 "; ".join(found["evidence"]))
        ti.xcom_push(key="diagnosis", value=found)
        return next_step(found)

    decided = diagnose(**WATCH)
    decided >> steps(decided["diagnosis"])
