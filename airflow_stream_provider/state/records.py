"""Typed rows of the state database: what the rest of the provider reads instead of dicts."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields
from typing import Any

from airflow_stream_provider.state.clock import in_host_terms


class RunStatus(enum.StrEnum):
    """A run's status in ``stream_runs``.  The driver writes STARTING -> RUNNING -> STOPPING -> STOPPED or
    FAILED; DEAD is the Airflow side's finding for a driver that died without recording its end (kill -9,
    a lost machine).  A StrEnum: it compares equal to the text stored in the database."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    DEAD = "DEAD"

    @property
    def active(self) -> bool:
        return self in ACTIVE_STATUSES


#: a driver may still be working: it holds (or is taking) the job's epoch
ACTIVE_STATUSES = frozenset({RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING})
#: the run ended; nothing of it will change again
TERMINAL_STATUSES = frozenset({RunStatus.STOPPED, RunStatus.FAILED, RunStatus.DEAD})


#: the times of a run's row
RUN_TIMES = ("started_at", "heartbeat_at", "query_started_at", "last_batch_at", "stop_requested_at", "ended_at")


@dataclass(frozen=True)
class RunRecord:
    """One row of ``stream_runs``: a driver's life, as the driver and the Airflow side recorded it.  Its
    times (``RUN_TIMES``) are this host's clock's, however the database stores them (``state.clock``)."""

    run_id: str
    job_id: str
    epoch: int
    generation: int
    status: RunStatus
    version: str | None = None
    dry_run: bool = False
    host: str | None = None
    pid: int | None = None
    started_at: float | None = None
    heartbeat_at: float | None = None
    query_started_at: float | None = None
    last_batch_id: int | None = None
    last_batch_at: float | None = None
    last_progress: str | None = None
    stop_requested_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    failure_kind: str | None = None
    error_class: str | None = None
    termination_message: str | None = None
    #: where the driver's stdout/stderr go, when the launcher knows (local and client mode)
    log_path: str | None = None
    #: the submission handle on cluster masters (driver id, YARN application id, pod name)
    submission_id: str | None = None
    #: the driver's Spark UI, while it runs (None when the UI is off)
    ui_url: str | None = None
    #: the result tables the job's code writes (JSON list), recorded when its query starts
    outputs: str | None = None
    #: what was launched (job file and spec JSON), recorded once the query runs
    application: str | None = None
    spec: str | None = None

    @classmethod
    def from_row(cls, row: Any, offset: float) -> RunRecord:
        """From a row mapping of ``stream_runs`` (extra keys of a joined query are ignored); its times in this
        host's terms (``offset``: the database's clock minus this host's, ``state.clock``)."""
        values = in_host_terms({f.name: row[f.name] for f in fields(cls)}, RUN_TIMES, offset)
        values["status"] = RunStatus(values["status"])
        values["dry_run"] = bool(values["dry_run"])
        return cls(**values)

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_STATUSES

    @property
    def running_query(self) -> bool:
        """The driver is up and its query has started."""
        return bool(self.query_started_at) and self.active

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}
