"""Stop a stream job gracefully."""

from __future__ import annotations

from typing import Any

from airflow_stream_provider.lifecycle.killed import end_stopped_upgrade
from airflow_stream_provider.operators.base import StreamJobOperator


class StopStreamingJobOperator(StreamJobOperator):
    """Set the stop marker, wait for the driver to finish its batch and exit 0; escalate to SIGTERM and
    then a kill only after ``stop_timeout``.  The job's standbys end first.  Stopping a job that is not running
    is a no-op that says so."""

    lease_action = "stop"
    launches = False

    def start(self, context) -> dict[str, Any]:
        # First: a standby would take over a run that the stop's escalation ends with a kill, and a recovery
        # would finish a restart (or an upgrade's task's retry, an upgrade) that stopped the job and launched
        # nothing.
        self.controller.end_standbys("the job is being stopped")
        if self.state.cancel_begun_restarts(self.job.job_id):
            self.log.info("Job %s: a restart begun and never launched will not be finished", self.job.job_id)
        end_stopped_upgrade(self.state.store, self.job.job_id, f"the job was stopped by task {self._lease_owner}",
                            self.log)
        run = self.live_run()
        if run is None:
            last = self.state.latest_run(self.job.job_id)
            detail = f"last run {last.run_id} is {last.status}" if last else "it never ran"
            self.log.info("Job %s is not running (%s): nothing to stop", self.job.job_id, detail)
            return {"job_id": self.job.job_id, "run_id": last and last.run_id, "outcome": "not running",
                    "detail": detail}
        return self.stop_then(context, run.run_id, "_stopped", {})

    def _stopped(self, context, result) -> dict[str, Any]:
        self.log.info("Job %s run %s %s after %ss (exit code %s)", result["job_id"], result["run_id"],
                      result["outcome"], result["seconds"], result["exit_code"])
        return result
