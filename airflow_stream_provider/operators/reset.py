"""Reset a stream job to a new checkpoint generation that resumes from the stored offsets."""

from __future__ import annotations

from typing import Any

from airflow_stream_provider.diagnosis import clock
from airflow_stream_provider.operators.base import StreamJobOperator, flag


class ResetStreamingJobOperator(StreamJobOperator):
    """Archive the current checkpoint generation (never delete it), validate the offsets stored with the
    results against Kafka, and start generation n+1 with them as ``startingOffsets``.

    :param allow_data_loss: accept stored offsets Kafka no longer holds (out of retention, a recreated
        topic, a partition gone) and resume where Kafka still has data.  Each lost range is recorded in
        ``stream_accepted_losses`` with the reason, in the transaction that moves the stored offsets past
        it, and reported in the result.
    :param reason: why the reset was made, recorded with the archived generation.
    """

    lease_action = "reset"

    template_fields = (*StreamJobOperator.template_fields, "reason", "allow_data_loss")

    def __init__(self, *, allow_data_loss: bool = False, reason: str = "manual reset", **kwargs):
        super().__init__(**kwargs)
        self.allow_data_loss = allow_data_loss
        self.reason = reason

    def start(self, context) -> dict[str, Any]:
        self.refuse_during_upgrade("reset")
        finished = self._finished_by_another()
        if finished is not None:
            return finished
        return self.reset_then(context, self.reason, "done", {},
                               allow_data_loss=flag(self.allow_data_loss, "allow_data_loss"))

    def _finished_by_another(self) -> dict[str, Any] | None:
        """This task's earlier try began the reset and ended before its launch (lost, or its launch refused),
        and a recovery (``stream_health``) has carried it on since: another would archive the generation that
        recovery started.  Or a stop someone asked for closed it since, which a reset would undo.  Its result,
        with nothing done; else None."""
        mine = self.state.store.latest_restart(self.job.job_id, begun_by=self._lease_owner)
        if mine is None or mine["action"] != "reset":
            return None
        began = f"job {self.job.job_id}: the reset this task began at {clock(mine['at'])}"
        if mine["new_run_id"] is None and mine.get("cancelled_at"):
            why = (f"{began} was closed by a stop asked for at {clock(mine['cancelled_at'])}: not undoing that "
                   "stop. Run a new reset to reset the job")
        elif mine["new_run_id"] is None or mine.get("finished_by") in (None, self._lease_owner):
            return None  # still owed to this task; or this task launched it itself (a clear runs anew)
        else:
            why = (f"{began} was carried on by task {mine['finished_by']}, which launched run "
                   f"{mine['new_run_id']}: nothing more to do here. Run a new reset to reset again")
        self.log.info("%s", why)
        return {"action": "none", "why": why, "run_id": mine["new_run_id"]}
