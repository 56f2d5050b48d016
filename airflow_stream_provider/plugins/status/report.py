"""What the status page shows of one job, as plain JSON, read from the state database and Kafka.

Nothing here writes, and nothing carries a database URL or a password: runs' messages are masked, and the
spec (which holds the database URL) is never sent.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from airflow_stream_provider import diagnosis, standing
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.kafka_offsets import Offsets
from airflow_stream_provider.lifecycle import driver_log
from airflow_stream_provider.state import overview
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.store import StateStore

RECENT_RUNS = 10
#: ``scheme://user:password@host``: a credential inside any URL a message may quote.
_URL_CREDENTIALS = re.compile(r"(\w[\w+.-]*://[^/\s:@]+):[^@\s/]+@")


def masked(text: str | None, secrets: Sequence[str | None] = ()) -> str | None:
    if text is None:
        return None
    return driver_log.masked(_URL_CREDENTIALS.sub(r"\1:***@", text), secrets)


def job_report(store: StateStore, job_id: str, *, end_offsets: Callable[[list[str]], Offsets] | None,
               driver_alive: Callable[[RunRecord], bool | None], secrets: Sequence[str | None] = (),
               now: float | None = None) -> dict[str, Any]:
    """Health, current run, recent runs with their diagnoses, generations, offsets against Kafka, recent
    batches and dead letters of ``job_id``.  ``end_offsets(topics)`` reads Kafka's end offsets (None: not
    reachable from here, the page says so)."""
    now = time.time() if now is None else now
    runs = [r for r in store.recent_runs(job_id, RECENT_RUNS * 2) if not r.dry_run][:RECENT_RUNS]
    current = runs[0] if runs else None
    stored = store.stored_offsets(job_id)
    partitions, kafka_error = _partitions(stored, store.unapplied_from(job_id), _topics(current, stored),
                                          end_offsets)
    lag = None if kafka_error else sum(p["lag"] for p in partitions)
    alive = driver_alive(current) if current else None
    found = diagnosis.diagnose(job_id, current, driver_alive=alive, lag=lag, now=now)
    try:
        found, notes = standing.read(store, found, now)
    except SQLAlchemyError as err:  # an older release's database, a role that may not create: the rest shows
        notes = [f"what stands beside the health could not be read: {type(err).__name__}. An older release's "
                 "state database gains what it lacks when a task or the watcher of this release next uses it"]
    dead_total, dead_samples = overview.dead_letters(store, job_id)
    return {
        "job_id": job_id,
        "health": found.health.value,
        "failure_kind": found.failure_kind.value if found.failure_kind else None,
        "evidence": [masked(line, secrets) for line in found.evidence],
        "advice": masked(found.advice, secrets),
        "notes": [masked(line, secrets) for line in notes],
        "current": _current(current, alive, now, secrets),
        "runs": [_run(run, secrets) for run in runs],
        "generations": [{"generation": g["generation"], "state": "archived" if g["archived_at"] else "active",
                         "created_at": g["created_at"], "archived_at": g["archived_at"],
                         "path": g["archive_path"] or g["checkpoint_path"], "reason": masked(g["reason"], secrets)}
                        for g in store.generations(job_id)],
        "offsets": {"partitions": partitions, "lag": lag, "kafka_error": kafka_error},
        "batches": [b.to_dict() for b in overview.recent_batches(store, job_id)],
        "dead_letters": {"total": dead_total,
                         "samples": [{**s, "error": masked(s["error"], secrets)} for s in dead_samples]},
        "generated_at": now,
    }


def _topics(run: RunRecord | None, stored: Offsets) -> list[str]:
    topics = {topic for topic, _ in stored}
    if run is not None and run.spec:
        try:
            topics.update(json.loads(run.spec)["kafka"]["topics"])
        except (ValueError, KeyError, TypeError):
            pass
    return sorted(topics)


def _partitions(stored: Offsets, unapplied: Offsets, topics: list[str],
                end_offsets) -> tuple[list[dict[str, Any]], str | None]:
    """One row per partition: its stored offset, Kafka's end, and the lag from where its unapplied records
    begin (``StateStore.unapplied_from``: below a generation's start nothing waits)."""
    ends: Offsets = {}
    error = None
    if topics and end_offsets is not None:
        try:
            ends = end_offsets(topics)
        except Exception as err:  # the page still shows what the database holds
            error = f"Kafka's end offsets could not be read: {type(err).__name__}: {err}"
    elif end_offsets is None:
        error = "no Kafka connection is configured for the status page"
    rows = []
    for topic, partition in sorted(set(stored) | set(ends)):
        at, end = stored.get((topic, partition)), ends.get((topic, partition))
        begins = unapplied.get((topic, partition), 0)
        rows.append({"topic": topic, "partition": partition, "stored": at, "start": None if at is not None else begins,
                     "end": end, "lag": max(0, end - begins) if end is not None else 0})
    return rows, error


def _current(run: RunRecord | None, alive: bool | None, now: float, secrets) -> dict[str, Any] | None:
    if run is None:
        return None
    return {"run_id": run.run_id, "status": run.status, "version": run.version, "generation": run.generation,
            "epoch": run.epoch, "host": run.host, "pid": run.pid, "handle": run.submission_id,
            "process_alive": alive, "started_at": run.started_at,
            "heartbeat_age_s": round(now - run.heartbeat_at, 1) if run.heartbeat_at else None,
            "last_batch_id": run.last_batch_id, "log_path": run.log_path,
            "ui_url": run.ui_url if run.active else None}


def _run(run: RunRecord, secrets) -> dict[str, Any]:
    found = diagnosis.diagnose(run.job_id, run, driver_alive=None, lag=None)
    kind = FailureKind(run.failure_kind) if run.failure_kind in FailureKind.__members__ else None
    message = masked(run.termination_message, secrets)
    return {"run_id": run.run_id, "status": run.status, "version": run.version, "generation": run.generation,
            "epoch": run.epoch, "started_at": run.started_at, "ended_at": run.ended_at,
            "exit_code": run.exit_code, "failure_kind": run.failure_kind, "error_class": run.error_class,
            "message": message.splitlines()[0][:500] if message else None,
            "diagnosis": found.health.value, "advice": kind.facts.advice if kind else masked(found.advice, secrets)}
