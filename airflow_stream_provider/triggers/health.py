"""A trigger that watches a stream job's health without holding a worker slot.

It polls the state database and, where possible, the driver process, through blocking clients run in
a thread so the triggerer's event loop stays free.  No side effects: a trigger may run twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_stream_provider import diagnosis
from airflow_stream_provider.diagnosis import INTERRUPTED_RESTART, Health, Thresholds, check_conditions
from airflow_stream_provider.triggers import resume_floor

#: How long the state database may keep failing the health check (``waits.DATABASE_OUTAGE``) before the
#: watch ends with an error: long enough for its restart, short enough that a broken connection is seen.
OUTAGE_LIMIT_S = 120.0
#: What the health sensor waits for by default: the conditions that need a recovery.
FIRE_ON = (Health.DEAD.value, Health.STUCK.value, Health.FAILED.value, INTERRUPTED_RESTART)


class StreamHealthTrigger(BaseTrigger):
    """Fire once the job is in one of ``fire_on``: health values (``Health``) and the conditions beyond
    them (``diagnosis.CONDITIONS``).  With ``failure_kinds``, only a FAILED run of those kinds fires."""

    def __init__(self, *, job_id: str, topics: Sequence[str], state_conn_id: str, kafka_conn_id: str,
                 fire_on: Sequence[str] = FIRE_ON, failure_kinds: Sequence[str] | None = None,
                 heartbeat_timeout: float = 30.0, stuck_after: float = 300.0, poll_interval: float = 5.0,
                 deferred_at: float | None = None, deferred_in: str | None = None):
        super().__init__()
        check_conditions(fire_on)
        self.job_id = job_id
        self.topics = list(topics)
        self.state_conn_id = state_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.fire_on = list(fire_on)
        self.failure_kinds = list(failure_kinds) if failure_kinds else None
        self.heartbeat_timeout = heartbeat_timeout
        self.stuck_after = stuck_after
        self.poll_interval = poll_interval
        #: when and where the sensor deferred: its event is held back a few seconds (``resume_floor``)
        self.deferral = resume_floor.Deferral.of(deferred_at, deferred_in)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "job_id": self.job_id, "topics": self.topics, "state_conn_id": self.state_conn_id,
            "kafka_conn_id": self.kafka_conn_id, "fire_on": self.fire_on, "failure_kinds": self.failure_kinds,
            "heartbeat_timeout": self.heartbeat_timeout, "stuck_after": self.stuck_after,
            "poll_interval": self.poll_interval, **self.deferral.kwargs()})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_stream_provider.lifecycle.health import HealthProbe
        from airflow_stream_provider.lifecycle.waits import DATABASE_OUTAGE

        probe = HealthProbe.connect(self.job_id, self.topics, self.state_conn_id, self.kafka_conn_id,
                                    Thresholds(self.heartbeat_timeout, self.stuck_after))
        failing_since = None
        try:
            while True:
                try:
                    found = await asyncio.to_thread(probe.check)
                except DATABASE_OUTAGE as err:  # a database blip does not end the watch (as a run's wait)
                    now = time.monotonic()
                    failing_since = failing_since or now
                    if now - failing_since >= OUTAGE_LIMIT_S:
                        yield TriggerEvent({"status": "error", "message": (
                            f"health check of job {self.job_id} has failed for {now - failing_since:.0f}s: "
                            f"{err!r}. Check the state database and Kafka connections "
                            f"({self.state_conn_id!r}, {self.kafka_conn_id!r})")})
                        return
                    self.log.warning("Health check of job %s failed, trying again: %r", self.job_id, err)
                    await asyncio.sleep(self.poll_interval)
                    continue
                except Exception as err:
                    await self.deferral.hold_back()
                    yield TriggerEvent({"status": "error", "message": (
                        f"health check of job {self.job_id} failed: {err!r}. The job itself is untouched; the "
                        f"next check looks again. If this repeats, check the connections {self.state_conn_id!r} "
                        f"and {self.kafka_conn_id!r} and the triggerer's log")})
                    return
                failing_since = None
                if self.matches(found):
                    await self.deferral.hold_back()
                    yield TriggerEvent({"status": "fired", "message": found.summary(),
                                        "diagnosis": found.to_dict()})
                    return
                self.log.debug("Job %s is %s", self.job_id, found.health.value)
                await asyncio.sleep(self.poll_interval)
        finally:
            probe.close()

    def matches(self, found: diagnosis.Diagnosis) -> bool:
        if self.failure_kinds is not None:  # failures of these kinds, and nothing else
            return (Health.FAILED in self.fire_on and found.health == Health.FAILED
                    and found.failure_kind is not None and found.failure_kind.value in self.failure_kinds)
        return any(c in self.fire_on for c in found.conditions)  # a DEAD run owed a restart fires on either
