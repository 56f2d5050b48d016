"""A StreamingQueryListener that reports progress and the termination reason to the state database.

Spark calls it on its listener-bus thread; a failing database write must never take the query down,
so every callback logs and swallows its own errors (the harness heartbeat reports liveness anyway).
"""

from __future__ import annotations

import json
import logging

from pyspark.sql.streaming import StreamingQueryListener

from airflow_stream_provider import failures
from airflow_stream_provider.state.store import StateStore

log = logging.getLogger(__name__)
#: What each batch's progress line in the driver log holds: where its time went (the benchmark reads it).
PROGRESS_LOGGED = ("batch_id", "input_rows", "duration_ms", "sink_s")


class StateListener(StreamingQueryListener):
    def __init__(self, store: StateStore, run_id: str):
        self.store = store
        self.run_id = run_id
        #: batch id -> the sink's seconds per phase (``BatchClock.phases``), when it ran the batch
        self.sink_phases = lambda batch_id: None
        self.termination: dict | None = None
        #: Progress events seen: each one follows a fully completed batch (a graceful stop waits for one).
        self.batches_completed = 0

    def onQueryStarted(self, event) -> None:
        self._safely(self.store.mark_query_started, self.run_id)

    def onQueryProgress(self, event) -> None:
        progress = event.progress
        self.batches_completed += 1  # after the batch's state and commit log are written
        summary = {
            "batch_id": progress.batchId,
            "timestamp": progress.timestamp,
            "input_rows": progress.numInputRows,
            "input_rows_per_second": progress.inputRowsPerSecond,
            "processed_rows_per_second": progress.processedRowsPerSecond,
            "duration_ms": dict(progress.durationMs or {}),
            "sink_s": self.sink_phases(progress.batchId),
            "sources": [
                {"start": _json(s.startOffset), "end": _json(s.endOffset), "latest": _json(s.latestOffset)}
                for s in progress.sources
            ],
        }
        # Only the sink marks a batch committed (it knows a replay from new work); this is progress detail.
        log.info("progress %s", json.dumps({k: summary[k] for k in PROGRESS_LOGGED}))
        self._safely(self.store.record_progress, self.run_id, progress.batchId, summary, False)

    def onQueryIdle(self, event) -> None:
        self._safely(self.store.heartbeat, self.run_id)

    def onQueryTerminated(self, event) -> None:
        if event.exception:
            classification = failures.classify(event.exception, getattr(event, "errorClassOnException", None))
            self.termination = {"exception": event.exception, **classification.to_dict()}
            log.error("query terminated: %s (%s)", classification.kind.value, classification.evidence)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.warning("could not record query event in the state database", exc_info=True)


def _json(value):
    if value is None or isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
