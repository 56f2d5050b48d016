"""Submit a stream job and wait until its query runs."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.operators.base import StreamJobOperator

IF_RUNNING = ("fail", "skip", "replace")


class SubmitStreamingJobOperator(StreamJobOperator):
    """Start the job's driver detached from this task; succeed once the first heartbeat shows the query
    running.  With ``standby`` in the spec, a warm standby driver is started beside it.

    :param if_running: what to do when a run of the job is already alive: ``fail`` (default: a double
        start is usually a mistake), ``skip`` (return the live run), or ``replace`` (stop it gracefully,
        then start).  A forced second driver could not corrupt results anyway: the newer epoch fences the
        older run.
    """

    lease_action = "submit"

    template_fields = (*StreamJobOperator.template_fields, "if_running")

    def __init__(self, *, if_running: str = "fail", **kwargs):
        super().__init__(**kwargs)
        self.if_running = if_running

    def start(self, context) -> dict[str, Any]:
        if self.if_running not in IF_RUNNING:
            raise AirflowFailException(f"if_running={self.if_running!r} is not one of {', '.join(IF_RUNNING)}")
        live = self.live_run()
        if live is None:
            return self.launch_then(context, "_submitted", {})
        launched = self.launched_by_earlier_try(context)
        if launched and launched["run_id"] == live.run_id:
            # that try's launch succeeded and the task was lost before its success was recorded
            self.log.info("Job %s runs as %s, which an earlier try of this task launched: not launching "
                          "another", self.job.job_id, live.run_id)
            return self._submitted(context, launched)
        if self.if_running == "fail":
            raise AirflowFailException(
                f"job {self.job.job_id} already runs (run {live.run_id}, pid {live.pid} on "
                f"{live.host}, heartbeat at {live.heartbeat_at:.0f}). Stop it first, or set "
                f"if_running='skip' or 'replace'.")
        if self.if_running == "skip":
            self.log.info("Job %s already runs as %s: skipping submit", self.job.job_id, live.run_id)
            return {"job_id": self.job.job_id, "run_id": live.run_id, "epoch": live.epoch,
                    "generation": live.generation, "action": "skipped"}
        self.log.info("Replacing run %s of job %s", live.run_id, self.job.job_id)
        return self.stop_then(context, live.run_id, "_replaced", {})

    def _replaced(self, context, stopped) -> dict[str, Any]:
        return self.launch_then(context, "_submitted", {})

    def _submitted(self, context, launched) -> dict[str, Any]:
        return {**launched, "action": "submitted", "standby": self.controller.ensure_standby(self.application)}
