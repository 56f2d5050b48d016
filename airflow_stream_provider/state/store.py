"""Access to the state database shared by the runtime (writes) and the Airflow side (reads, requests).

Every statement goes through SQLAlchemy Core with bound parameters.  SQLite runs in WAL mode with
``BEGIN IMMEDIATE`` write transactions so the driver's heartbeats and the sink's commits serialise
instead of failing with "database is locked" halfway through.
"""

from __future__ import annotations

import enum
import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, create_engine, event, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.kafka_offsets import LostRange, Offsets
from airflow_stream_provider.spec import DATABASE_PASSWORD_ENV
from airflow_stream_provider.state import schema


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


STARTING, RUNNING, STOPPING = RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING
STOPPED, FAILED, DEAD = RunStatus.STOPPED, RunStatus.FAILED, RunStatus.DEAD
#: a driver may still be working: it holds (or is taking) the job's epoch
ACTIVE_STATUSES = frozenset({STARTING, RUNNING, STOPPING})
#: the run ended; nothing of it will change again
TERMINAL_STATUSES = frozenset({STOPPED, FAILED, DEAD})


def make_engine(url: str, password: str | None = None) -> Engine:
    """An engine for ``url``; the password comes from the argument or the driver's environment."""
    parsed = make_url(url)
    password = password if password is not None else os.environ.get(DATABASE_PASSWORD_ENV)
    if password and parsed.password is None and parsed.username:
        parsed = parsed.set(password=password)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, connect_args={"timeout": 60, "check_same_thread": False})
        _sqlite_immediate_transactions(engine)
        return engine
    return create_engine(parsed, pool_pre_ping=True, pool_size=2, max_overflow=2)


def _sqlite_immediate_transactions(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):  # pragma: no cover - exercised by every SQLite test
        dbapi_connection.isolation_level = None  # let SQLAlchemy's "begin" event issue BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection):  # pragma: no cover
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@dataclass(frozen=True)
class RunTicket:
    run_id: str
    epoch: int


@dataclass(frozen=True)
class HealthReportKey:
    """What makes a health report new: a run entering a health, with its failure kind ('' for none)."""

    run_id: str
    health: str
    failure_kind: str


@dataclass
class WatchedJob:
    job_id: str
    #: the latest run (not a dry run), None for a job that never ran
    run: dict[str, Any] | None
    #: what was already reported for that run
    reported: set[HealthReportKey]


class StateStore:
    """Typed operations on the state tables.  One instance per process; thread-safe via the pool."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @classmethod
    def from_url(cls, url: str, password: str | None = None) -> StateStore:
        return cls(make_engine(url, password))

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def ensure_schema(self) -> None:
        schema.metadata.create_all(self.engine)

    def dispose(self) -> None:
        self.engine.dispose()

    # -- runs and fencing --------------------------------------------------------------------------
    def begin_run(
        self,
        job_id: str,
        generation: int,
        version: str,
        *,
        run_id: str | None = None,
        dry_run: bool = False,
        host: str | None = None,
        pid: int | None = None,
        log_path: str | None = None,
    ) -> RunTicket:
        """Register a driver lifetime and take a new fencing epoch.

        The epoch bump and the run row are one transaction, so two drivers starting at once get
        different epochs and only the later one can commit.  A dry run (preflight) must not fence the
        live run: it reads the current epoch without taking a new one.
        """
        run_id = run_id or uuid.uuid4().hex
        now = time.time()
        with self.engine.begin() as conn:
            row = conn.execute(
                select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id).with_for_update()
            ).first()
            if row is None:
                conn.execute(
                    schema.jobs.insert().values(
                        job_id=job_id, epoch=0, generation=generation, version=version, updated_at=now
                    )
                )
                epoch = 0
            else:
                epoch = row.epoch
            if not dry_run:
                epoch += 1
                conn.execute(
                    update(schema.jobs)
                    .where(schema.jobs.c.job_id == job_id)
                    .values(epoch=epoch, generation=generation, version=version, updated_at=now)
                )
            conn.execute(
                schema.runs.insert().values(
                    run_id=run_id,
                    job_id=job_id,
                    epoch=epoch,
                    generation=generation,
                    version=version,
                    dry_run=dry_run,
                    host=host,
                    pid=pid,
                    status=STARTING,
                    started_at=now,
                    heartbeat_at=now,
                    log_path=log_path,
                )
            )
        return RunTicket(run_id, epoch)

    def current_epoch(self, job_id: str) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id)).scalar()

    def mark_query_started(self, run_id: str) -> None:
        self._update_run(run_id, status=RUNNING, query_started_at=time.time(), heartbeat_at=time.time())

    def heartbeat(self, run_id: str) -> bool:
        """Record that the driver is alive; return True when a graceful stop was requested."""
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(update(schema.runs).where(schema.runs.c.run_id == run_id).values(heartbeat_at=now))
            return (
                conn.execute(
                    select(schema.runs.c.stop_requested_at).where(schema.runs.c.run_id == run_id)
                ).scalar()
                is not None
            )

    def record_progress(
        self, run_id: str, batch_id: int, progress: Mapping[str, Any] | None, committed: bool
    ) -> None:
        values: dict[str, Any] = {"heartbeat_at": time.time(), "last_progress": json.dumps(progress or {})}
        if committed:
            values.update(last_batch_id=batch_id, last_batch_at=time.time())
        self._update_run(run_id, **values)

    def request_stop(self, run_id: str) -> bool:
        """Ask a run to stop gracefully.  Returns False when it had already been asked or has ended."""
        with self.engine.begin() as conn:
            result = conn.execute(
                update(schema.runs)
                .where(
                    schema.runs.c.run_id == run_id,
                    schema.runs.c.stop_requested_at.is_(None),
                    schema.runs.c.status.in_(ACTIVE_STATUSES),
                )
                .values(stop_requested_at=time.time())
            )
            return result.rowcount == 1

    def record_launch(self, run_id: str, application: str, spec_json: str) -> None:
        self._update_run(run_id, application=application, spec=spec_json)

    def mark_dead(self, run_id: str, evidence: str) -> bool:
        """Record that an active run's driver is gone; a run that ended on its own keeps its record."""
        with self.engine.begin() as conn:
            result = conn.execute(
                update(schema.runs)
                .where(schema.runs.c.run_id == run_id, schema.runs.c.status.in_(ACTIVE_STATUSES))
                .values(status=DEAD, ended_at=time.time(), termination_message=evidence)
            )
            return result.rowcount == 1

    def set_status(self, run_id: str, status: str) -> None:
        self._update_run(run_id, status=status)

    def finish_run(
        self,
        run_id: str,
        *,
        status: str,
        exit_code: int,
        failure_kind: str | None = None,
        error_class: str | None = None,
        message: str | None = None,
    ) -> None:
        self._update_run(
            run_id,
            status=status,
            exit_code=exit_code,
            failure_kind=failure_kind,
            error_class=error_class,
            termination_message=plain_text(message) if message else message,
            ended_at=time.time(),
        )

    def _update_run(self, run_id: str, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(schema.runs).where(schema.runs.c.run_id == run_id).values(**values))

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(schema.runs).where(schema.runs.c.run_id == run_id)).mappings().first()
            return dict(row) if row else None

    def latest_run(self, job_id: str, *, include_dry_runs: bool = False) -> dict[str, Any] | None:
        query = select(schema.runs).where(schema.runs.c.job_id == job_id)
        if not include_dry_runs:
            query = query.where(schema.runs.c.dry_run.is_(False))
        with self.engine.connect() as conn:
            # By epoch, which the database hands out in order: the driver hosts' clocks may disagree.
            row = conn.execute(query.order_by(schema.runs.c.epoch.desc(), schema.runs.c.started_at.desc())
                               .limit(1)).mappings().first()
            return dict(row) if row else None

    def watched_jobs(self) -> list[WatchedJob]:
        """Every job with its latest run and what the watcher already reported for that run: ONE query,
        however many jobs the database holds, so an always-on watcher costs one round trip per poll."""
        runs, reports = schema.runs, schema.health_reports
        ranked = (select(runs, func.row_number().over(partition_by=runs.c.job_id,
                                                      order_by=(runs.c.epoch.desc(), runs.c.started_at.desc()))
                                       .label("rank"))
                  .where(runs.c.dry_run.is_(False)).subquery())
        query = (select(schema.jobs.c.job_id.label("watched_job_id"), ranked,
                        reports.c.health.label("reported_health"),
                        reports.c.failure_kind.label("reported_kind"))
                 .select_from(schema.jobs)
                 .outerjoin(ranked, and_(ranked.c.job_id == schema.jobs.c.job_id, ranked.c.rank == 1))
                 .outerjoin(reports, and_(reports.c.job_id == schema.jobs.c.job_id,
                                          reports.c.run_id == ranked.c.run_id)))
        found: dict[str, WatchedJob] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(query).mappings():
                job_id = row["watched_job_id"]
                if job_id not in found:
                    run = {c.name: row[c.name] for c in runs.columns} if row["run_id"] else None
                    found[job_id] = WatchedJob(job_id, run, set())
                if row["reported_health"]:
                    found[job_id].reported.add(HealthReportKey(row["run_id"], row["reported_health"],
                                                               row["reported_kind"]))
        return list(found.values())

    def record_health_report(self, job_id: str, key: HealthReportKey, message: str) -> bool:
        """Remember that ``key`` was reported; False when it already was (two watchers raced)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(schema.health_reports.insert().values(
                    job_id=job_id, run_id=key.run_id, health=key.health, failure_kind=key.failure_kind,
                    reported_at=time.time(), message=plain_text(message)[:4000]))
        except IntegrityError:
            return False
        return True

    def forget_health_report(self, job_id: str, key: HealthReportKey) -> None:
        """The run left the condition: entering it again is a new transition, to be reported again."""
        table = schema.health_reports
        with self.engine.begin() as conn:
            conn.execute(table.delete().where(table.c.job_id == job_id, table.c.run_id == key.run_id,
                                              table.c.health == key.health, table.c.failure_kind == key.failure_kind))

    # -- generations -------------------------------------------------------------------------------
    def ensure_generation(
        self, job_id: str, generation: int, checkpoint_path: str, starting_offsets: str | None
    ) -> dict[str, Any]:
        """Register a generation the first time a driver uses it; later calls return it unchanged."""
        with self.engine.begin() as conn:
            row = self._generation(conn, job_id, generation)
            if row is None:
                conn.execute(
                    schema.generations.insert().values(
                        job_id=job_id,
                        generation=generation,
                        checkpoint_path=checkpoint_path,
                        starting_offsets=starting_offsets,
                        created_at=time.time(),
                    )
                )
                row = self._generation(conn, job_id, generation)
            return dict(row)

    def get_generation(self, job_id: str, generation: int) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = self._generation(conn, job_id, generation)
            return dict(row) if row else None

    @staticmethod
    def _generation(conn, job_id: str, generation: int):
        return (
            conn.execute(
                select(schema.generations).where(
                    schema.generations.c.job_id == job_id, schema.generations.c.generation == generation
                )
            )
            .mappings()
            .first()
        )

    def recorded_start(self, job_id: str) -> Offsets:
        """Where the newest generation that recorded a start began (its batch 0): what a reset resumes
        from for partitions no batch ever committed, instead of the spec's earliest/latest default."""
        table = schema.generations
        with self.engine.connect() as conn:
            text = conn.execute(select(table.c.starting_offsets)
                                .where(table.c.job_id == job_id, table.c.starting_offsets.is_not(None))
                                .order_by(table.c.generation.desc()).limit(1)).scalar()
        return kafka_offsets.from_spark_json(text) if text else {}

    # -- offsets -----------------------------------------------------------------------------------
    def accept_loss(self, job_id: str, generation: int, lost: Sequence[LostRange], resume: Offsets,
                    reason: str) -> None:
        """Record ranges given up with ``allow_data_loss`` and move the stored offsets to ``resume`` (where
        ``generation`` starts) in ONE transaction: the stored offsets then still equal what the ledger
        applied plus what was knowingly skipped.  A partition missing from ``resume`` no longer exists in
        Kafka: its stored offset is removed.  Moving back is allowed here only: a recreated topic's
        offsets begin again below the stored ones."""
        now = time.time()
        offsets, losses = schema.offsets, schema.accepted_losses
        with self.engine.begin() as conn:
            conn.execute(select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id).with_for_update())
            for r in lost:
                tp = (r.topic, r.partition)
                conn.execute(losses.insert().values(
                    job_id=job_id, generation=generation, topic=r.topic, partition=r.partition,
                    start_offset=r.start, end_offset=r.end, resume_offset=resume.get(tp),
                    reason=f"{r.reason}; accepted: {plain_text(reason)}"[:4000], accepted_at=now))
                conn.execute(offsets.delete().where(offsets.c.job_id == job_id, offsets.c.topic == r.topic,
                                                    offsets.c.partition == r.partition))
                if tp in resume:
                    conn.execute(offsets.insert().values(job_id=job_id, topic=r.topic, partition=r.partition,
                                                         next_offset=resume[tp], generation=generation,
                                                         batch_id=None, updated_at=now))

    def accepted_losses(self, job_id: str) -> list[dict[str, Any]]:
        table = schema.accepted_losses
        with self.engine.connect() as conn:
            rows = conn.execute(select(table).where(table.c.job_id == job_id).order_by(table.c.id)).mappings()
            return [dict(r) for r in rows]

    def stored_offsets(self, job_id: str, conn=None) -> Offsets:
        query = select(
            schema.offsets.c.topic, schema.offsets.c.partition, schema.offsets.c.next_offset
        ).where(schema.offsets.c.job_id == job_id)
        if conn is not None:
            return {(r.topic, r.partition): r.next_offset for r in conn.execute(query)}
        with self.engine.connect() as c:
            return {(r.topic, r.partition): r.next_offset for r in c.execute(query)}

    def count(self, table, **where: Any) -> int:
        query = select(func.count()).select_from(table)
        for column, value in where.items():
            query = query.where(table.c[column] == value)
        with self.engine.connect() as conn:
            return conn.execute(query).scalar_one()


def plain_text(text: str) -> str:
    """``text`` as a text column takes it: PostgreSQL's text cannot hold NUL, and a failure's or a dead
    letter's text may quote a record's raw bytes."""
    return text.replace("\x00", "\\x00")
