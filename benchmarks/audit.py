"""Lost and duplicated records of one benchmark job, counted from its database against what Kafka
acknowledged to the producer.  Counted, not asserted: the report carries the numbers (they must be 0).

- lost: an acknowledged event missing from ``events``, a malformed record missing from the dead
  letters, or an offset range the ledger never covered;
- duplicated: a ledger range applied twice, an event counted twice in ``kpi_minute`` (its increments
  would show it even though ``events`` is keyed), a record dead-lettered twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, text

from airflow_stream_provider.state import schema


@dataclass
class Audit:
    produced: int
    lost: int
    duplicated: int

    def __iadd__(self, other: Audit) -> Audit:
        self.produced += other.produced
        self.lost += other.lost
        self.duplicated += other.duplicated
        return self

    def __str__(self) -> str:
        return f"{self.produced} records produced, {self.lost} lost, {self.duplicated} duplicated"


def audit(store, job_id: str, produced) -> Audit:
    with store.engine.connect() as conn:
        events = {row[0] for row in conn.execute(text("SELECT event_id FROM events"))}
        counted = conn.execute(text("SELECT COALESCE(SUM(event_count), 0) FROM kpi_minute")).scalar()
        dead = [(r.partition, r.offset) for r in conn.execute(
            select(schema.dead_letters.c.partition, schema.dead_letters.c.offset)
            .where(schema.dead_letters.c.job_id == job_id))]
        ledger = conn.execute(
            select(schema.batches.c.partition, schema.batches.c.start_offset, schema.batches.c.end_offset)
            .where(schema.batches.c.job_id == job_id)
            .order_by(schema.batches.c.partition, schema.batches.c.start_offset)).all()
    lost = len(set(produced.events) - events) + len(set(produced.malformed) - set(dead))
    duplicated = max(0, int(counted) - len(events)) + (len(dead) - len(set(dead)))
    position: dict[int, int] = {}
    for partition, start, end in ledger:
        at = position.get(partition, 0)
        duplicated += max(0, min(at, end) - start)  # overlap with what was already applied
        lost += max(0, start - at)  # a gap
        position[partition] = max(at, end)
    for partition, end in produced.end_offsets.items():
        lost += max(0, end - position.get(partition, 0))
    return Audit(produced.total, lost, duplicated)
