"""A StreamingQueryListener that reports progress and the termination reason to the state database.

Spark calls it on its listener-bus thread; a failing database write must never take the query down,
so every callback logs and swallows its own errors (the harness heartbeat reports liveness anyway).

A batch's progress crosses from the JVM as one JSON document.  PySpark's own listener bridge rebuilds
the progress object field by field over Py4J, a hundred-odd round trips per batch, each map iteration
ending in a Java exception that Py4J resolves by scanning the classpath: it cost the driver more CPU
than the batch's database write.
"""

from __future__ import annotations

import json
import logging

from pyspark.sql.streaming import StreamingQueryListener
from pyspark.sql.streaming.listener import JStreamingQueryListener

from airflow_stream_provider import failures
from airflow_stream_provider.state.store import StateStore

log = logging.getLogger(__name__)
#: What each batch's progress line in the driver log holds: where its time went (the benchmark reads it).
PROGRESS_LOGGED = ("batch_id", "input_rows", "duration_ms", "sink_s")


class StateListener(StreamingQueryListener):
    """Reports the events of the job's query, ``query_name``, only.  A listener hears every query of the
    session: a standby that took over may still be finishing its warm-up query, whose start, batches and
    end are no part of the run."""

    def __init__(self, store: StateStore, run_id: str, query_name: str):
        self.store = store
        self.run_id = run_id
        self.query_name = query_name
        #: the job query's id, from its start event (an end event carries no name)
        self.query_id: str | None = None
        #: batch id -> the sink's seconds per phase (``BatchClock.phases``), when it ran the batch
        self.sink_phases = lambda batch_id: None
        self.termination: dict | None = None
        #: Progress events seen: each one follows a fully completed batch (a graceful stop waits for one).
        self.batches_completed = 0
        #: Whether the query's start reached the state database (``record_start``).
        self.start_recorded = False

    def onQueryStarted(self, event) -> None:
        if event.name != self.query_name:
            return
        self.query_id = str(event.id)
        self._safely(self.record_start)

    def record_start(self) -> None:
        """The run RUNNING, with its query's start.  The driver's main loop calls it again while a write here
        failed (``start_pending``): a run left STARTING is never judged STUCK, a deploy's wait for a ready
        run times out on it, and a standby waits the whole start timeout before it takes over."""
        self.store.mark_query_started(self.run_id)
        self.start_recorded = True

    @property
    def start_pending(self) -> bool:
        """The query started and the state database has not recorded it yet."""
        return self.query_id is not None and not self.start_recorded

    @property
    def _jlistener(self):
        """The JVM's handle on this listener: PySpark's bridge, with progress taken as JSON."""
        if not hasattr(self, "_jlistenerobj"):
            from pyspark import SparkContext

            self._jlistenerobj = SparkContext._jvm.PythonStreamingQueryListenerWrapper(_JsonProgressBridge(self))
        return self._jlistenerobj

    def onQueryProgress(self, event) -> None:
        self.record_progress(json.loads(event.progress.json))

    def record_progress(self, progress: dict) -> None:
        """One batch's ``StreamingQueryProgress`` as Spark writes it in JSON (fields absent when unset)."""
        if progress.get("name") != self.query_name:
            return
        self.batches_completed += 1  # after the batch's state and commit log are written
        batch_id = progress["batchId"]
        summary = {
            "batch_id": batch_id,
            "timestamp": progress.get("timestamp"),
            "input_rows": progress.get("numInputRows"),
            "input_rows_per_second": progress.get("inputRowsPerSecond"),
            "processed_rows_per_second": progress.get("processedRowsPerSecond"),
            "duration_ms": dict(progress.get("durationMs") or {}),
            "sink_s": self.sink_phases(batch_id),
            "sources": [
                {"start": _json(s.get("startOffset")), "end": _json(s.get("endOffset")),
                 "latest": _json(s.get("latestOffset"))}
                for s in progress.get("sources") or []
            ],
        }
        # Only the sink marks a batch committed (it knows a replay from new work); this is progress detail.
        log.info("progress %s", json.dumps({k: summary[k] for k in PROGRESS_LOGGED}))
        self._safely(self.store.record_progress, self.run_id, batch_id, summary, False)

    def onQueryIdle(self, event) -> None:
        if str(event.id) == self.query_id:
            self._safely(self.store.heartbeat, self.run_id)

    def onQueryTerminated(self, event) -> None:
        if str(event.id) != self.query_id:
            return
        if event.exception:
            classification = failures.classify(event.exception, getattr(event, "errorClassOnException", None))
            self.termination = {"exception": event.exception, **classification.to_dict()}
            log.error("query terminated: %s (%s)", classification.kind.value, classification.evidence)

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.warning("could not record query event in the state database", exc_info=True)


class _JsonProgressBridge(JStreamingQueryListener):
    """What the JVM calls: progress in one Py4J call (``progress().json()``), the rarer events as PySpark
    converts them."""

    def onQueryProgress(self, jevent) -> None:
        try:
            progress = json.loads(jevent.progress().json())
        except Exception:
            log.warning("could not read a batch's progress from the JVM", exc_info=True)
            return
        self.pylistener.record_progress(progress)


def _json(value):
    if value is None or isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
