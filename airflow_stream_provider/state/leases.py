"""The job's lease: one Airflow task at a time starts, stops, restarts, resets or upgrades a job.

Epochs keep two drivers from both committing (invariant 3), but two tasks acting at once would still start
two drivers on one checkpoint: a submit from the deploy DAG beside a recover from the health DAG, in the
seconds before the first driver registers its run, or a stop beside a restart.  A task takes the job's lease
before it acts and holds it through its waits.  It is one row per job, taken by compare-and-set, and it
expires: a task that dies (killed while deferred, its worker lost) holds it no longer than the wait it was
in, plus a grace.  A task's retries and its resumes after a deferral are the same owner.  The lease also
names the driver its holder launched and waits on, so that whoever takes over from a holder that died can
end a launch it left starting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Float, String, Table, Text, case, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore

leases = Table(
    "stream_leases",
    schema.metadata,
    Column("job_id", String(100), primary_key=True),
    #: the task holding it: dag id / run id / task id / map index
    Column("owner", String(1000), nullable=False),
    #: what that task does to the job (submit, stop, restart, reset, recover, upgrade)
    Column("action", String(40), nullable=False),
    Column("until", Float, nullable=False),
    Column("taken_at", Float, nullable=False),
    #: the driver the holder launched and waits on (JSON: run_id, pid, host, submitted_at), if any
    Column("launch", Text),
)


@dataclass(frozen=True)
class Lease:
    job_id: str
    owner: str
    action: str
    #: when it runs out, by this host's clock
    until: float
    #: when the hold began, as stored (by the database's clock): the hold's identity, which a resumed task
    #: compares on another worker, whose clock may differ
    taken_at: float
    launch: dict[str, Any] | None = None
    #: the database's clock minus this host's (``state.clock``)
    offset: float = 0.0

    def describe(self, now: float) -> str:
        return (f"task {self.owner} ({self.action}, for {now - (self.taken_at - self.offset):.0f} s; its lease "
                f"runs out in {max(0.0, self.until - now):.0f} s)")


class LeaseLog:
    """Reads and writes ``stream_leases`` (created on first use: older state databases lack it)."""

    def __init__(self, store: StateStore):
        self.engine, self.clock = store.engine, store.clock
        leases.create(self.engine, checkfirst=True)
        schema.add_missing_columns(self.engine, [leases])

    def take(self, job_id: str, owner: str, action: str, until: float,
             launch: Mapping[str, Any] | None = None) -> Lease | None:
        """Hold ``job_id``'s lease for ``owner`` until ``until`` (taking it, or extending its own), waiting on
        ``launch``; returns None once held, else the lease another owner holds."""
        launched = json.dumps(dict(launch)) if launch else None
        until = self.clock.to_database(until)  # ``until`` is by this host's clock; another host judges it
        for _ in range(3):  # the row may be deleted or inserted between the two statements
            now = self.clock.now()
            with self.engine.begin() as conn:
                taken = conn.execute(
                    update(leases).where(leases.c.job_id == job_id, or_(leases.c.owner == owner, leases.c.until < now))
                    .values(owner=owner, action=action, until=until, launch=launched,
                            taken_at=case((leases.c.owner == owner, leases.c.taken_at), else_=now))).rowcount
            if taken:
                return None
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(leases).values(job_id=job_id, owner=owner, action=action, until=until,
                                                       taken_at=now, launch=launched))
                return None
            except IntegrityError:
                held = self.get(job_id)
                if held is not None and held.owner != owner and held.until >= time.time():
                    return held
        raise RuntimeError(f"job {job_id}: its lease changed hands three times while being taken")

    def release(self, job_id: str, owner: str) -> None:
        """Let go of the lease if ``owner`` holds it (one that expired and was taken since is not touched)."""
        with self.engine.begin() as conn:
            conn.execute(delete(leases).where(leases.c.job_id == job_id, leases.c.owner == owner))

    def get(self, job_id: str) -> Lease | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(leases).where(leases.c.job_id == job_id)).mappings().first()
        if row is None:
            return None
        offset = self.clock.offset()
        return Lease(**{**row, "until": row["until"] - offset, "offset": offset,
                        "launch": json.loads(row["launch"]) if row["launch"] else None})
