"""Warm standby drivers, as they register and wait: one row per standby driver lifetime.

A standby is not a run: it holds no epoch and commits nothing until it takes over, when it begins a run
under its own id (``StateStore.begin_run`` with the epoch it saw, so two standbys never both win).  Its
row says what the Airflow side needs: whether one is warm and waiting, on which host and pid, and how
it ended (took over, refused, stopped with the job, or found dead).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Column, Connection, Float, Integer, String, Table, Text, insert, select, update
from sqlalchemy.exc import IntegrityError

from airflow_stream_provider.state import schema
from airflow_stream_provider.state.clock import in_host_terms
from airflow_stream_provider.state.store import StateStore, plain_text


class StandbyStatus(enum.StrEnum):
    """WARMING -> WAITING -> TOOK_OVER | REFUSED | ENDED; DEAD is the finding for one that vanished."""

    WARMING = "WARMING"
    WAITING = "WAITING"
    TOOK_OVER = "TOOK_OVER"
    REFUSED = "REFUSED"
    ENDED = "ENDED"
    DEAD = "DEAD"

    @property
    def live(self) -> bool:
        return self in (StandbyStatus.WARMING, StandbyStatus.WAITING)


standbys = Table(
    "stream_standbys",
    schema.metadata,
    Column("standby_id", String(64), primary_key=True),
    Column("job_id", String(100), nullable=False, index=True),
    Column("version", String(200)),
    Column("generation", Integer),
    Column("host", String(255)),
    Column("pid", Integer),
    Column("log_path", Text),
    Column("status", String(20), nullable=False),
    Column("started_at", Float),
    #: warm-up done: from here a takeover costs a query start and one batch
    Column("ready_at", Float),
    Column("heartbeat_at", Float),
    Column("ended_at", Float),
    #: the run it replaced, and when it took the epoch
    Column("replaced_run_id", String(64)),
    Column("took_over_at", Float),
    #: why it took over, refused or ended
    Column("message", Text),
    #: "standby" (takes over a dead run of its version) or "successor" (an upgrade's new version, warmed
    #: up while the old one runs; it starts only when the upgrade releases it, on the generation and from
    #: the offsets the release names, holding the epoch the release saw)
    Column("role", String(20)),
    Column("release_generation", Integer),
    Column("release_offsets", Text),
    Column("release_epoch", Integer),
)

STANDBY = "standby"
SUCCESSOR = "successor"

#: the times of a standby's row
STANDBY_TIMES = ("started_at", "ready_at", "heartbeat_at", "ended_at", "took_over_at")


@dataclass(frozen=True)
class StandbyRecord:
    standby_id: str
    job_id: str
    status: StandbyStatus
    version: str | None = None
    generation: int | None = None
    host: str | None = None
    pid: int | None = None
    log_path: str | None = None
    started_at: float | None = None
    ready_at: float | None = None
    heartbeat_at: float | None = None
    ended_at: float | None = None
    replaced_run_id: str | None = None
    took_over_at: float | None = None
    message: str | None = None
    role: str | None = STANDBY
    release_generation: int | None = None
    release_offsets: str | None = None
    release_epoch: int | None = None

    @classmethod
    def from_row(cls, row: Any, offset: float) -> StandbyRecord:
        """Its times in this host's terms (``offset``: ``state.clock``), as a run's."""
        values = in_host_terms({f.name: row[f.name] for f in fields(cls)}, STANDBY_TIMES, offset)
        values["status"] = StandbyStatus(values["status"])
        return cls(**values)

    @property
    def successor(self) -> bool:
        return self.role == SUCCESSOR

    def describe(self) -> str:
        where = f"pid {self.pid} on {self.host}"
        name = f"{self.role or STANDBY} {self.standby_id}"
        if self.status == StandbyStatus.WAITING:
            return f"{name} (version {self.version}) is warm and waiting ({where})"
        if self.status == StandbyStatus.WARMING:
            return f"{name} (version {self.version}) is warming up ({where})"
        return f"{name} {self.status.value.lower().replace('_', ' ')}: {self.message or ''}"


class StandbyLog:
    """Reads and writes ``stream_standbys`` (created on first use: older state databases lack it)."""

    def __init__(self, store: StateStore):
        self.engine, self.clock = store.engine, store.clock
        standbys.create(self.engine, checkfirst=True)

    def register(self, standby_id: str, job_id: str, version: str, generation: int, *, host: str, pid: int,
                 log_path: str | None, role: str = STANDBY) -> bool:
        """Record a standby WARMING.  Its launcher records it first (under the launcher's process: the
        spark-submit), the driver again when it is up (under its own): that updates the row, unless the
        standby was ended in between (a stop of the job), which returns False."""
        now = self.clock.now()
        values = {"host": host, "pid": pid, "log_path": log_path, "started_at": now, "heartbeat_at": now}
        with self.engine.begin() as conn:
            updated = conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live())
                                   .values(**values)).rowcount
            if updated:
                return True
            if conn.execute(select(standbys.c.status).where(standbys.c.standby_id == standby_id)).first():
                return False
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(standbys).values(standby_id=standby_id, job_id=job_id, version=version,
                                                     generation=generation, status=StandbyStatus.WARMING.value,
                                                     role=role, **values))
        except IntegrityError:  # the launcher's row landed in between: take it over
            return self.register(standby_id, job_id, version, generation, host=host, pid=pid, log_path=log_path,
                                 role=role)
        return True

    def ready(self, standby_id: str) -> bool:
        """Record a warming standby WAITING; False when it was ended meanwhile (it stays ended)."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            result = conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live()).values(
                status=StandbyStatus.WAITING.value, ready_at=now, heartbeat_at=now))
        return result.rowcount == 1

    def heartbeat(self, standby_id: str) -> StandbyStatus | None:
        """Record that the standby is alive; return its status (ENDED once someone asked it to end)."""
        with self.engine.begin() as conn:
            conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live())
                         .values(heartbeat_at=self.clock.now()))
            status = conn.execute(select(standbys.c.status).where(standbys.c.standby_id == standby_id)).scalar()
        return StandbyStatus(status) if status else None

    def release(self, standby_id: str, generation: int, starting_offsets: str | None, epoch: int) -> bool:
        """Let a live successor start: on ``generation`` (from ``starting_offsets`` for a new one), taking
        over from ``epoch``.  False when it is no longer live."""
        with self.engine.begin() as conn:
            result = conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live()).values(
                release_generation=generation, release_offsets=starting_offsets, release_epoch=epoch))
        return result.rowcount == 1

    def took_over(self, conn: Connection, standby_id: str, replaced_run_id: str | None, why: str) -> bool:
        """Record that a live standby takes over, on ``conn``: the transaction that takes its epoch
        (``StateStore.begin_run(claim=...)``), so that a standby ended meanwhile (a stop of the job) takes
        nothing.  False when it is no longer live."""
        now = self.clock.now()
        result = conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live()).values(
            status=StandbyStatus.TOOK_OVER.value, replaced_run_id=replaced_run_id, took_over_at=now, ended_at=now,
            message=plain_text(why)[:4000]))
        return result.rowcount == 1

    def end(self, standby_id: str, status: StandbyStatus, why: str) -> bool:
        """End a live standby (REFUSED, ENDED or DEAD); False when it had already ended."""
        with self.engine.begin() as conn:
            result = conn.execute(update(standbys).where(standbys.c.standby_id == standby_id, _live()).values(
                status=status.value, ended_at=self.clock.now(), message=plain_text(why)[:4000]))
        return result.rowcount == 1

    def end_all(self, job_id: str, why: str) -> list[str]:
        """Ask every live standby of ``job_id`` to end (a graceful stop of the job): each sees it at its next
        poll and exits.  Returns their ids."""
        live = [s.standby_id for s in self.live(job_id)]
        return [standby_id for standby_id in live if self.end(standby_id, StandbyStatus.ENDED, why)]

    def get(self, standby_id: str) -> StandbyRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(standbys).where(standbys.c.standby_id == standby_id)).mappings().first()
        return StandbyRecord.from_row(row, self.clock.offset()) if row else None

    def live(self, job_id: str, role: str | None = None) -> list[StandbyRecord]:
        """The standbys of ``job_id`` recorded as warming or waiting, oldest first (some may have died
        without recording it: the caller checks their process or heartbeat); of ``role`` only if given."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(standbys).where(standbys.c.job_id == job_id, _live())
                                .order_by(standbys.c.started_at)).mappings().all()
        offset = self.clock.offset()  # one offset for the whole result
        found = [StandbyRecord.from_row(row, offset) for row in rows]
        return [s for s in found if role is None or (s.role or STANDBY) == role]

    def recent(self, job_id: str, limit: int = 10) -> list[StandbyRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(standbys).where(standbys.c.job_id == job_id)
                                .order_by(standbys.c.started_at.desc()).limit(limit)).mappings().all()
        offset = self.clock.offset()  # one offset for the whole result
        return [StandbyRecord.from_row(row, offset) for row in rows]

    def _update(self, standby_id: str, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(standbys).where(standbys.c.standby_id == standby_id).values(**values))


def _live():
    return standbys.c.status.in_([s.value for s in StandbyStatus if s.live])
