"""Read-only summaries of a job for the status page: the jobs there are, the ledger's recent batches and
the dead letters.  Runs, generations and stored offsets come from :class:`StateStore` itself."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select

from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore


@dataclass(frozen=True)
class BatchSummary:
    """One committed batch, over all its partitions."""

    generation: int
    batch_id: int
    rows_read: int
    rows_applied: int
    rows_dead: int
    committed_at: float | None
    #: from the driver beginning the batch to its commit (None in ledgers of older releases)
    latency_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def job_ids(store: StateStore) -> list[str]:
    """Every job the database knows, in name order."""
    with store.engine.connect() as conn:
        return list(conn.execute(select(schema.jobs.c.job_id).order_by(schema.jobs.c.job_id)).scalars())


def recent_batches(store: StateStore, job_id: str, limit: int = 60) -> list[BatchSummary]:
    """The ``limit`` newest committed batches of ``job_id``, oldest first (for a chart)."""
    ledger = schema.batches
    query = (select(ledger.c.generation, ledger.c.batch_id, func.sum(ledger.c.rows_read).label("rows_read"),
                    func.sum(ledger.c.rows_applied).label("rows_applied"),
                    func.sum(ledger.c.rows_dead).label("rows_dead"),
                    func.max(ledger.c.committed_at).label("committed_at"),
                    func.min(ledger.c.started_at).label("started_at"))
             .where(ledger.c.job_id == job_id)
             .group_by(ledger.c.generation, ledger.c.batch_id)
             .order_by(ledger.c.generation.desc(), ledger.c.batch_id.desc()).limit(limit))
    with store.engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
    return [BatchSummary(r["generation"], r["batch_id"], int(r["rows_read"]), int(r["rows_applied"]),
                         int(r["rows_dead"]), r["committed_at"], _latency(r)) for r in reversed(rows)]


def _latency(row) -> float | None:
    if row["started_at"] is None or row["committed_at"] is None:
        return None
    return round(row["committed_at"] - row["started_at"], 3)


def dead_letters(store: StateStore, job_id: str, samples: int = 5) -> tuple[int, list[dict[str, Any]]]:
    """How many records of ``job_id`` were dead-lettered, and the newest ``samples`` of them (position,
    reason and the first bytes of the value)."""
    table = schema.dead_letters
    with store.engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(table).where(table.c.job_id == job_id)).scalar_one()
        rows = conn.execute(select(table.c.topic, table.c.partition, table.c.offset, table.c.error,
                                   table.c.value, table.c.recorded_at)
                            .where(table.c.job_id == job_id)
                            .order_by(table.c.recorded_at.desc(), table.c.offset.desc()).limit(samples)).mappings()
        found = [{"topic": r["topic"], "partition": r["partition"], "offset": r["offset"], "error": r["error"],
                  "value": _preview(r["value"]), "recorded_at": r["recorded_at"]} for r in rows]
    return total, found


def _preview(value: bytes | None, limit: int = 120) -> str | None:
    if value is None:
        return None
    text = bytes(value[:limit]).decode(errors="replace")
    return text + ("…" if len(value) > limit else "")
