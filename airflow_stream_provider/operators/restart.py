"""Restart a stream job from its checkpoint."""

from __future__ import annotations

from typing import Any

from airflow_stream_provider.operators.base import StreamJobOperator


class RestartStreamingJobOperator(StreamJobOperator):
    """Stop the live run if any (gracefully), then start a new run on the same checkpoint generation."""

    lease_action = "restart"

    def start(self, context) -> dict[str, Any]:
        self.refuse_during_upgrade("restart")
        last = self.state.latest_run(self.job.job_id)
        return self.restart_then(context, "manual restart", last and last.run_id, "done", {})
