"""An upgrade's phases, recorded as it moves through them (like the Flink operator's reconciliation status):
a killed upgrade task resumes or rolls back on retry from what is recorded here, and ``status`` shows it."""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Float, String, Table, Text, func, insert, select, update

from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore


class UpgradePhase(enum.StrEnum):
    PREFLIGHT = "PREFLIGHT"
    STOPPING = "STOPPING"
    STARTING = "STARTING"
    VERIFYING = "VERIFYING"
    ROLLING_BACK = "ROLLING_BACK"
    DONE = "DONE"


#: The phases an upgrade leaves the job down in when its task dies: the old run stopped, the new version (or
#: the rollback's) not running yet.
LEAVES_THE_JOB_DOWN = (UpgradePhase.STOPPING, UpgradePhase.STARTING, UpgradePhase.ROLLING_BACK)

#: Longer than any one phase takes (its stop, its start, its verification: minutes each): an upgrade whose
#: record has not moved for this long lost its task.  It no longer keeps recoveries away, and the successor
#: it holds ends.
UPGRADE_STALE_S = 1800.0


upgrades = Table(
    "stream_upgrades",
    schema.metadata,
    Column("upgrade_id", String(64), primary_key=True),
    Column("job_id", String(100), nullable=False, index=True),
    Column("from_version", String(200)),
    Column("to_version", String(200)),
    Column("phase", String(20), nullable=False),
    #: how a finished upgrade ended: upgraded | aborted | rolled back | failed
    Column("result", String(20)),
    #: the upgrade's own state between phases (JSON): what a retry resumes from
    Column("detail", Text),
    Column("started_at", Float),
    Column("updated_at", Float),
)


@dataclass(frozen=True)
class UpgradeRecord:
    upgrade_id: str
    job_id: str
    from_version: str | None
    to_version: str | None
    phase: UpgradePhase
    result: str | None
    detail: dict[str, Any]
    started_at: float
    updated_at: float

    def stale(self, now: float) -> bool:
        """Its record has not moved for ``UPGRADE_STALE_S``: its task is gone."""
        return now - self.updated_at >= UPGRADE_STALE_S

    @property
    def task(self) -> str | None:
        """The task instance running the upgrade (a lease owner, ``lifecycle.holders.lease_owner``)."""
        return self.detail.get("task")

    @property
    def successor_id(self) -> str | None:
        """The prewarmed successor the upgrade holds, until it releases it."""
        return (self.detail.get("successor") or {}).get("standby_id")


class UpgradeLog:
    """Reads and writes ``stream_upgrades`` (created on first use: older state databases lack it)."""

    def __init__(self, store: StateStore):
        self.engine, self.clock = store.engine, store.clock
        upgrades.create(self.engine, checkfirst=True)

    def begin(self, job_id: str, from_version: str | None, to_version: str | None,
              detail: dict[str, Any]) -> str:
        upgrade_id, now = uuid.uuid4().hex, self.clock.now()
        with self.engine.begin() as conn:
            conn.execute(insert(upgrades).values(
                upgrade_id=upgrade_id, job_id=job_id, from_version=from_version, to_version=to_version,
                phase=UpgradePhase.PREFLIGHT.value, detail=json.dumps(detail), started_at=now, updated_at=now))
        return upgrade_id

    def move(self, upgrade_id: str, phase: UpgradePhase, detail: dict[str, Any],
             result: str | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(upgrades).where(upgrades.c.upgrade_id == upgrade_id).values(
                phase=phase.value, detail=json.dumps(detail), result=result, updated_at=self.clock.now()))

    def get(self, upgrade_id: str) -> UpgradeRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(upgrades).where(upgrades.c.upgrade_id == upgrade_id)).mappings().first()
        return _record(row, self.clock.offset()) if row else None

    def latest(self, job_id: str) -> UpgradeRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(upgrades).where(upgrades.c.job_id == job_id)
                               .order_by(upgrades.c.started_at.desc()).limit(1)).mappings().first()
        return _record(row, self.clock.offset()) if row else None

    def leaving_down(self, job_id: str | None = None) -> dict[str, UpgradeRecord]:
        """Each job's (or ``job_id``'s) latest upgrade where it is in a phase that leaves the job down
        (``LEAVES_THE_JOB_DOWN``): at work, or left there by a task that ended.  One query, for a watcher
        that polls every second."""
        ranked = select(upgrades, func.row_number().over(partition_by=upgrades.c.job_id,
                                                         order_by=upgrades.c.started_at.desc()).label("rank"))
        if job_id is not None:
            ranked = ranked.where(upgrades.c.job_id == job_id)
        latest = ranked.subquery()
        query = select(latest).where(latest.c.rank == 1,
                                     latest.c.phase.in_([p.value for p in LEAVES_THE_JOB_DOWN]))
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        offset = self.clock.offset()  # one offset for the whole result
        return {row["job_id"]: _record(row, offset) for row in rows}


def _record(row, offset: float) -> UpgradeRecord:
    """Its times in this host's terms (``offset``: ``state.clock``), as a run's."""
    return UpgradeRecord(row["upgrade_id"], row["job_id"], row["from_version"], row["to_version"],
                         UpgradePhase(row["phase"]), row["result"], json.loads(row["detail"] or "{}"),
                         row["started_at"] - offset, row["updated_at"] - offset)
