"""Reset a stream job to a new checkpoint generation that resumes from the stored offsets."""

from __future__ import annotations

from typing import Any

from airflow_stream_provider.operators.base import StreamJobOperator


class ResetStreamingJobOperator(StreamJobOperator):
    """Archive the current checkpoint generation (never delete it), validate the offsets stored with the
    results against Kafka, and start generation n+1 with them as ``startingOffsets``.

    :param allow_data_loss: accept stored offsets that fell out of Kafka's retention and resume at the
        earliest offsets Kafka still has; the lost ranges are reported in the result.
    """

    template_fields = (*StreamJobOperator.template_fields, "reason")

    def __init__(self, *, allow_data_loss: bool = False, reason: str = "manual reset", **kwargs):
        super().__init__(**kwargs)
        self.allow_data_loss = allow_data_loss
        self.reason = reason

    def execute(self, context) -> dict[str, Any]:
        return self.reset_and_resume(self.reason, allow_data_loss=self.allow_data_loss)
