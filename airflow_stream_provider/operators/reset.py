"""Reset a stream job to a new checkpoint generation that resumes from the stored offsets."""

from __future__ import annotations

from typing import Any

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
        return self.reset_then(context, self.reason, "done", {},
                               allow_data_loss=flag(self.allow_data_loss, "allow_data_loss"))
