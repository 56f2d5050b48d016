"""Access to the state database shared by the runtime (writes) and the Airflow side (reads, requests).

``state`` is the one door to that database: no module outside it builds or runs a statement.  Every
statement goes through SQLAlchemy Core with bound parameters; what differs between SQLite and
PostgreSQL (engine settings, upserts) is in ``state.dialect``, and the batch commit in
``state.transaction``.  Times are written by the database's clock and handed out in the reading host's
terms (``state.clock``): hosts whose clocks disagree still agree on a heartbeat's age.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Float, Table, and_, func, inspect, literal, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.kafka_offsets import LostRange, Offsets
from airflow_stream_provider.spec import DATABASE_PASSWORD_ENV
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.clock import clock_for, in_host_terms
from airflow_stream_provider.state.dialect import engine_for
from airflow_stream_provider.state.records import ACTIVE_STATUSES, RunRecord, RunStatus

STARTING, RUNNING, STOPPING = RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING
STOPPED, FAILED, DEAD = RunStatus.STOPPED, RunStatus.FAILED, RunStatus.DEAD
#: the times of a restart's row
RESTART_TIMES = ("at", "cancelled_at")


def make_engine(url: str, password: str | None = None) -> Engine:
    """An engine for ``url``; the password comes from the argument or the driver's environment."""
    parsed = make_url(url)
    password = password if password is not None else os.environ.get(DATABASE_PASSWORD_ENV)
    if password and parsed.password is None and parsed.username:
        parsed = parsed.set(password=password)
    return engine_for(parsed)


@dataclass(frozen=True)
class RunTicket:
    run_id: str
    epoch: int


@dataclass(frozen=True)
class Heartbeat:
    stop_requested: bool
    #: the job's current epoch: another than the run's means a newer run took over
    job_epoch: int | None


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
    run: RunRecord | None
    #: what was already reported for that run
    reported: set[HealthReportKey]
    #: the job's newest restart record (``restarts_since``'s columns), None for a job never restarted: what
    #: tells a run a restart stopped and launched nothing after from a stop someone asked for
    last_restart: dict[str, Any] | None = None


class StateStore:
    """Typed operations on the state tables.  One instance per process; thread-safe via the pool."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.clock = clock_for(engine)

    @classmethod
    def from_url(cls, url: str, password: str | None = None) -> StateStore:
        return cls(make_engine(url, password))

    def now(self) -> float:
        """Now by the state database's clock (``state.clock``): what every stored time is written by."""
        return self.clock.now()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def ensure_schema(self) -> None:
        """Create the tables; add the columns this release defines to tables an older one created."""
        schema.metadata.create_all(self.engine)
        schema.add_missing_columns(self.engine)

    def has_schema(self) -> bool:
        """Does this database hold stream state at all (is it the job's state database)?"""
        return inspect(self.engine).has_table(schema.runs.name)

    def ensure_table(self, table: Table) -> None:
        """Create a result table the sink writes to, unless it exists (same database as the state).  One
        that exists must hold the result's key unique: the upsert's ``ON CONFLICT`` needs it, and a large
        batch's direct ``COPY`` (``bulk``) would otherwise store a key a second time without an error."""
        table.create(self.engine, checkfirst=True)
        key = [column.name for column in table.primary_key.columns]
        if key and not _unique_on(inspect(self.engine), table.name, set(key)):
            names = ", ".join(key)
            raise ResultTableError(
                f"result table {table.name!r} exists without a primary key or unique constraint on its key "
                f"({names}): each batch upserts its rows on that key. Add one (ALTER TABLE {table.name} ADD "
                f"PRIMARY KEY ({names})), or drop the table for the job to create it, then restart the job")

    def ping(self) -> None:
        """Open a connection and run a trivial query; raises the driver's error when that fails."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1")).scalar_one()

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
        expected_epoch: int | None = None,
        claim: Callable[[Connection], bool] | None = None,
    ) -> RunTicket | None:
        """Register a driver lifetime and take a new fencing epoch.

        The epoch bump and the run row are one transaction, so two drivers starting at once get
        different epochs and only the later one can commit.  A dry run (preflight) must not fence the
        live run: it reads the current epoch without taking a new one.  With ``expected_epoch`` (a
        standby taking over the run that held it) nothing is registered, and None returned, when the
        epoch has moved on: someone else took over first.  ``claim`` (a standby's on its own row) is
        written in the same transaction, after the epoch check: when it returns False (the standby was
        ended meanwhile) nothing is registered either, and None returned.
        """
        run_id = run_id or uuid.uuid4().hex
        now = self.now()
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
            if expected_epoch is not None and epoch != expected_epoch:
                return None
            _refuse_cancelled(conn, job_id, run_id)
            if claim is not None and not claim(conn):
                return None
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

    def cancel_launch(self, job_id: str, run_id: str, why: str) -> bool:
        """Keep the launch of ``run_id``, which its task no longer wants, from registering (``begin_run``
        refuses it): False where it registered first, and is to be stopped as a run.  Under the job's row
        lock, as ``begin_run`` checks it, so that one of the two comes first."""
        cancelled = schema.cancelled_launches
        with self.engine.begin() as conn:
            conn.execute(select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id).with_for_update())
            if conn.execute(select(schema.runs.c.run_id).where(schema.runs.c.run_id == run_id)).first():
                return False
            if not conn.execute(select(cancelled.c.run_id).where(cancelled.c.run_id == run_id)).first():
                conn.execute(cancelled.insert().values(run_id=run_id, job_id=job_id, cancelled_at=self.now(),
                                                       why=why[:2000]))
        return True

    def current_epoch(self, job_id: str) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id)).scalar()

    def mark_query_started(self, run_id: str) -> None:
        self._update_run(run_id, status=RUNNING, query_started_at=self.now(), heartbeat_at=self.now())

    def heartbeat(self, run_id: str) -> Heartbeat:
        """Record that the driver is alive; say whether a graceful stop was requested and which epoch the
        job holds now (one round trip: a driver whose epoch was taken learns it here)."""
        now = self.now()
        runs, jobs = schema.runs, schema.jobs
        with self.engine.begin() as conn:
            conn.execute(update(runs).where(runs.c.run_id == run_id).values(heartbeat_at=now))
            row = conn.execute(select(runs.c.stop_requested_at, jobs.c.epoch)
                               .join(jobs, jobs.c.job_id == runs.c.job_id).where(runs.c.run_id == run_id)).first()
        return Heartbeat(row is not None and row.stop_requested_at is not None, row.epoch if row else None)

    def record_progress(
        self, run_id: str, batch_id: int, progress: Mapping[str, Any] | None, committed: bool
    ) -> None:
        values: dict[str, Any] = {"heartbeat_at": self.now()}
        if progress is not None:  # a commit recorded without one (write-behind) keeps the listener's detail
            values["last_progress"] = json.dumps(progress)
        if committed:
            values.update(last_batch_id=batch_id, last_batch_at=self.now())
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
                .values(stop_requested_at=self.now())
            )
            return result.rowcount == 1

    def record_ui_url(self, run_id: str, ui_url: str | None) -> None:
        self._update_run(run_id, ui_url=ui_url)

    def record_outputs(self, run_id: str, tables: Sequence[str]) -> None:
        self._update_run(run_id, outputs=json.dumps(sorted(set(tables))))

    def record_launch(self, run_id: str, application: str, spec_json: str, submission_id: str | None = None) -> None:
        """What a run was launched with, once its query runs; ``submission_id``: the cluster manager's handle
        on a cluster-mode driver (the driver cannot know it), by which it is killed."""
        values = {"application": application, "spec": spec_json}
        if submission_id:
            values["submission_id"] = submission_id
        self._update_run(run_id, **values)

    def mark_dead(self, run_id: str, evidence: str) -> bool:
        """Record that an active run's driver is gone; a run that ended on its own keeps its record."""
        with self.engine.begin() as conn:
            result = conn.execute(
                update(schema.runs)
                .where(schema.runs.c.run_id == run_id, schema.runs.c.status.in_(ACTIVE_STATUSES))
                .values(status=DEAD, ended_at=self.now(), termination_message=evidence)
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
            ended_at=self.now(),
        )

    def _update_run(self, run_id: str, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(schema.runs).where(schema.runs.c.run_id == run_id).values(**values))

    def get_run(self, run_id: str) -> RunRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(schema.runs).where(schema.runs.c.run_id == run_id)).mappings().first()
        return RunRecord.from_row(row, self.clock.offset()) if row else None

    def latest_run(self, job_id: str, *, include_dry_runs: bool = False) -> RunRecord | None:
        query = select(schema.runs).where(schema.runs.c.job_id == job_id)
        if not include_dry_runs:
            query = query.where(schema.runs.c.dry_run.is_(False))
        with self.engine.connect() as conn:
            # By epoch, which the database hands out in order: the driver hosts' clocks may disagree.
            row = conn.execute(query.order_by(schema.runs.c.epoch.desc(), schema.runs.c.started_at.desc())
                               .limit(1)).mappings().first()
        return RunRecord.from_row(row, self.clock.offset()) if row else None

    def first_commit(self, job_id: str, run_id: str, after: float = 0.0) -> float | None:
        """When ``run_id`` first committed a batch after ``after`` (from the ledger): the moment a run that
        replaced another is processing again."""
        ledger, offset = schema.batches, self.clock.offset()
        with self.engine.connect() as conn:
            first = conn.execute(select(func.min(ledger.c.committed_at)).where(
                ledger.c.job_id == job_id, ledger.c.run_id == run_id, ledger.c.committed_at > after + offset)).scalar()
        return None if first is None else first - offset

    def result_tables(self, job_id: str) -> list[str]:
        """The tables the job's newest run that wrote anything wrote (its sink names them at its first
        batch, so a run still starting is represented by the one before it)."""
        runs = schema.runs
        query = (select(runs.c.outputs).where(runs.c.job_id == job_id, runs.c.dry_run.is_(False),
                                               runs.c.outputs.is_not(None))
                 .order_by(runs.c.epoch.desc()).limit(1))
        with self.engine.connect() as conn:
            outputs = conn.execute(query).scalar()
        return json.loads(outputs) if outputs else []

    def runs(self, job_id: str, *, include_dry_runs: bool = True) -> list[RunRecord]:
        """Every run of ``job_id``, oldest first."""
        query = select(schema.runs).where(schema.runs.c.job_id == job_id)
        if not include_dry_runs:
            query = query.where(schema.runs.c.dry_run.is_(False))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(schema.runs.c.started_at, schema.runs.c.epoch)).mappings().all()
        offset = self.clock.offset()  # one offset for the whole result
        return [RunRecord.from_row(row, offset) for row in rows]

    def recent_runs(self, job_id: str, limit: int) -> list[RunRecord]:
        """The ``limit`` newest runs of ``job_id`` by start time, newest first, dry runs included."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(schema.runs).where(schema.runs.c.job_id == job_id)
                                .order_by(schema.runs.c.started_at.desc()).limit(limit)).mappings().all()
        offset = self.clock.offset()  # one offset for the whole result
        return [RunRecord.from_row(row, offset) for row in rows]

    def watched_jobs(self) -> list[WatchedJob]:
        """Every job with its latest run and what the watcher already reported for that run: ONE query,
        however many jobs the database holds, so an always-on watcher costs one round trip per poll."""
        runs, reports, restarts = schema.runs, schema.health_reports, schema.restarts
        offset = self.clock.offset()  # before the query's connection: a measure takes one of its own
        ranked = (select(runs, func.row_number().over(partition_by=runs.c.job_id,
                                                      order_by=(runs.c.epoch.desc(), runs.c.started_at.desc()))
                                       .label("rank"))
                  .where(runs.c.dry_run.is_(False)).subquery())
        newest = select(*[c.label(f"restart_{c.name}") for c in restarts.c],
                        func.row_number().over(partition_by=restarts.c.job_id, order_by=restarts.c.id.desc())
                        .label("restart_rank")).subquery()
        query = (select(schema.jobs.c.job_id.label("watched_job_id"), ranked,
                        *[c for c in newest.c if c.name != "restart_rank"],
                        reports.c.health.label("reported_health"),
                        reports.c.failure_kind.label("reported_kind"))
                 .select_from(schema.jobs)
                 .outerjoin(ranked, and_(ranked.c.job_id == schema.jobs.c.job_id, ranked.c.rank == 1))
                 .outerjoin(newest, and_(newest.c.restart_job_id == schema.jobs.c.job_id,
                                         newest.c.restart_rank == 1))
                 .outerjoin(reports, and_(reports.c.job_id == schema.jobs.c.job_id,
                                          reports.c.run_id == ranked.c.run_id)))
        found: dict[str, WatchedJob] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(query).mappings():
                job_id = row["watched_job_id"]
                if job_id not in found:
                    run = RunRecord.from_row(row, offset) if row["run_id"] else None
                    restart = (in_host_terms({c.name: row[f"restart_{c.name}"] for c in restarts.c},
                                             RESTART_TIMES, offset)
                               if row["restart_id"] is not None else None)
                    found[job_id] = WatchedJob(job_id, run, set(), restart)
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
                    reported_at=self.now(), message=plain_text(message)[:4000]))
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
                        created_at=self.now(),
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

    def generations(self, job_id: str) -> list[dict[str, Any]]:
        """Every generation of ``job_id``, archived ones included, oldest first."""
        table = schema.generations
        with self.engine.connect() as conn:
            rows = conn.execute(select(table).where(table.c.job_id == job_id)
                                .order_by(table.c.generation)).mappings().all()
        return [dict(row) for row in rows]

    def current_generation(self, job_id: str) -> int:
        """The newest generation not archived; 1 for a job that never ran."""
        table = schema.generations
        with self.engine.connect() as conn:
            value = conn.execute(select(table.c.generation).where(table.c.job_id == job_id,
                                                                  table.c.archived_at.is_(None))
                                 .order_by(table.c.generation.desc()).limit(1)).scalar()
            if value is None:  # every generation archived: the next one
                value = (conn.execute(select(table.c.generation).where(table.c.job_id == job_id)
                                      .order_by(table.c.generation.desc()).limit(1)).scalar() or 0) + 1
        return value

    def mark_archived(self, job_id: str, generation: int, archive_path: str, reason: str) -> None:
        table = schema.generations
        with self.engine.begin() as conn:
            conn.execute(table.update().where(table.c.job_id == job_id, table.c.generation == generation)
                         .values(archived_at=self.now(), archive_path=archive_path, reason=reason))

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
        offsets begin again below the stored ones, and the old log's dead letters from there on are
        archived (``archive_dead_letters``)."""
        now = self.now()
        offsets, losses = schema.offsets, schema.accepted_losses
        with self.engine.begin() as conn:
            conn.execute(select(schema.jobs.c.epoch).where(schema.jobs.c.job_id == job_id).with_for_update())
            stored = self.stored_offsets(job_id, conn)
            for r in lost:
                tp = (r.topic, r.partition)
                conn.execute(losses.insert().values(
                    job_id=job_id, generation=generation, topic=r.topic, partition=r.partition,
                    start_offset=r.start, end_offset=r.end, resume_offset=resume.get(tp),
                    reason=f"{r.reason}; accepted: {plain_text(reason)}"[:4000], accepted_at=now))
                conn.execute(offsets.delete().where(offsets.c.job_id == job_id, offsets.c.topic == r.topic,
                                                    offsets.c.partition == r.partition))
                if tp not in resume or resume[tp] < stored.get(tp, 0):  # the log is gone, or went backwards
                    archive_dead_letters(conn, job_id, r.topic, r.partition, resume.get(tp), now)
                if tp in resume:
                    conn.execute(offsets.insert().values(job_id=job_id, topic=r.topic, partition=r.partition,
                                                         next_offset=resume[tp], generation=generation,
                                                         batch_id=None, updated_at=now))

    def accepted_losses(self, job_id: str) -> list[dict[str, Any]]:
        table = schema.accepted_losses
        with self.engine.connect() as conn:
            rows = conn.execute(select(table).where(table.c.job_id == job_id).order_by(table.c.id)).mappings()
            return [dict(r) for r in rows]

    def unapplied_from(self, job_id: str) -> Offsets:
        """Where each partition's records still to be applied begin: its stored offset, else where the
        newest generation began for it.  A partition no batch ever committed a record of has no stored
        offset, and what lies below that generation's start (from ``latest``, or a reset's resume point)
        was left unread on purpose: it is no lag, and no resume point.  A partition in neither begins at
        Kafka's earliest offset."""
        return {**self.recorded_start(job_id), **self.stored_offsets(job_id)}

    def stored_offsets(self, job_id: str, conn=None) -> Offsets:
        query = select(
            schema.offsets.c.topic, schema.offsets.c.partition, schema.offsets.c.next_offset
        ).where(schema.offsets.c.job_id == job_id)
        if conn is not None:
            return {(r.topic, r.partition): r.next_offset for r in conn.execute(query)}
        with self.engine.connect() as c:
            return {(r.topic, r.partition): r.next_offset for r in c.execute(query)}

    # -- restart history (the restart budget is counted from it) ---------------------------------------
    def record_restart(self, job_id: str, action: str, reason: str, failed_run_id: str | None,
                       new_run_id: str | None, task: str | None = None) -> None:
        """One restart of the job.  Without ``new_run_id``: a restart begun, before anything it does can fail
        (a STUCK run's stop); the new run's id then completes that row, so the attempt counts once, and a
        restart interrupted after its stop is seen as such (``recovery.interrupted_restart``).  A restart
        whose new run is recorded already is not recorded again (a task's retry recording its launch).
        ``task``: the task recording it, kept as the row's ``task`` where it begins the row (Airflow can later
        say that task ended without finishing it) and as ``finished_by`` where its launch completes it."""
        table = schema.restarts
        failed = table.c.failed_run_id.is_(None) if failed_run_id is None else table.c.failed_run_id == failed_run_id
        with self.engine.begin() as conn:
            if new_run_id is not None and conn.execute(
                    select(table.c.id).where(table.c.job_id == job_id, table.c.new_run_id == new_run_id)).first():
                return
            begun = None if new_run_id is None else conn.execute(
                select(func.max(table.c.id)).where(table.c.job_id == job_id, table.c.action == action, failed,
                                                   table.c.new_run_id.is_(None))).scalar()
            if begun is not None:
                conn.execute(update(table).where(table.c.id == begun).values(new_run_id=new_run_id,
                                                                             finished_by=task))
                return
            conn.execute(table.insert().values(job_id=job_id, at=self.now(), action=action, reason=reason[:2000],
                                               failed_run_id=failed_run_id, new_run_id=new_run_id, task=task,
                                               finished_by=task if new_run_id is not None else None))

    def cancel_begun_restarts(self, job_id: str) -> int:
        """A stop was asked for: the restarts begun and not launched are not to be finished (see
        ``record_restart``); how many there were."""
        table = schema.restarts
        with self.engine.begin() as conn:
            return conn.execute(update(table).where(table.c.job_id == job_id, table.c.new_run_id.is_(None),
                                                    table.c.cancelled_at.is_(None))
                                .values(cancelled_at=self.now())).rowcount

    def latest_restart(self, job_id: str, begun_by: str | None = None) -> dict[str, Any] | None:
        """The job's newest restart record, however old (``restarts_since`` looks back a window only); with
        ``begun_by``, the newest that task began."""
        table = schema.restarts
        query = select(table).where(table.c.job_id == job_id)
        if begun_by is not None:
            query = query.where(table.c.task == begun_by)
        with self.engine.connect() as conn:
            row = conn.execute(query.order_by(table.c.id.desc()).limit(1)).mappings().first()
        return in_host_terms(dict(row), RESTART_TIMES, self.clock.offset()) if row else None

    def restarts_since(self, job_id: str, since: float) -> list[dict[str, Any]]:
        """Restarts of the job, each with ``new_run_committed``: whether the run it started committed a
        batch, ``new_run_up_s``: how long its query ran, to its end or its last heartbeat (a restart
        that got somewhere is no part of a crash loop: ``budget.crash_loop_restarts``), and
        ``new_run_failed``: whether that run ended FAILED, by its own failure (``budget.backoff_restarts``)."""
        table, runs, offset = schema.restarts, schema.runs, self.clock.offset()
        up = func.coalesce(runs.c.ended_at, runs.c.heartbeat_at) - runs.c.query_started_at
        query = (select(table, runs.c.last_batch_id.is_not(None).label("new_run_committed"), up.label("new_run_up_s"),
                        # by itself: not fenced by another driver, nor failing a batch while asked to stop
                        and_(runs.c.status == FAILED.value, runs.c.stop_requested_at.is_(None),
                             func.coalesce(runs.c.failure_kind, "") != "CONCURRENT").label("new_run_failed"))
                 .select_from(table.outerjoin(runs, runs.c.run_id == table.c.new_run_id))
                 .where(table.c.job_id == job_id, table.c.at >= since + offset).order_by(table.c.at))
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [in_host_terms({**r, "new_run_committed": bool(r["new_run_committed"]),
                               "new_run_failed": bool(r["new_run_failed"]),
                               "new_run_up_s": max(0.0, float(r["new_run_up_s"] or 0.0))}, RESTART_TIMES, offset)
                for r in rows]

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


def archive_dead_letters(conn, job_id: str, topic: str, partition: int, from_offset: int | None,
                         now: float) -> None:
    """Move a gone log's dead letters of one partition, from ``from_offset`` on (None: all of them), to
    ``dead_letters_archive``.  Called in the transaction that records the loss:
    the new log numbers its records from there again, and one of them dead-lettered at a position an old
    dead letter holds would otherwise collide with it and stop the job."""
    live, archive = schema.dead_letters, schema.dead_letters_archive
    where = [live.c.job_id == job_id, live.c.topic == topic, live.c.partition == partition]
    if from_offset is not None:
        where.append(live.c.offset >= from_offset)
    kept = [c.name for c in live.columns]
    conn.execute(archive.insert().from_select(
        [*kept, "archived_at"], select(*live.columns, literal(now, Float)).where(*where)))
    conn.execute(live.delete().where(*where))


class LaunchCancelled(RuntimeError):
    """The run's launch was cancelled before it registered (``StateStore.cancel_launch``)."""


def _refuse_cancelled(conn: Connection, job_id: str, run_id: str) -> None:
    cancelled = schema.cancelled_launches
    row = conn.execute(select(cancelled.c.cancelled_at, cancelled.c.why)
                       .where(cancelled.c.run_id == run_id)).first()
    if row is not None:
        raise LaunchCancelled(
            f"run {run_id} of job {job_id} was cancelled before it registered ({row.why}): the task that launched "
            "it no longer waits on it, and a run started since may hold the job. This driver exits without "
            "taking the job's epoch; nothing needs doing")


class ResultTableError(ValueError):
    """A result table the database holds cannot take the job's results: a configuration to fix, not a
    record's fault."""


def _unique_on(inspector, table: str, key: set[str]) -> bool:
    """Whether ``table`` holds exactly ``key``'s columns unique: its primary key, a unique constraint or a
    unique index, as ``ON CONFLICT (key)`` infers its arbiter (a superset or a subset would not do)."""
    if set(inspector.get_pk_constraint(table).get("constrained_columns") or ()) == key:
        return True
    uniques = [u["column_names"] for u in inspector.get_unique_constraints(table)]
    uniques += [i["column_names"] for i in inspector.get_indexes(table) if i.get("unique")]
    return any(set(columns) == key for columns in uniques)
