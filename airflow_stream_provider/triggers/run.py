"""The trigger a deferred lifecycle step waits on: one run reaching a point (its query runs, it committed a
batch, it ended), without holding a worker slot.

The decision is :class:`~airflow_stream_provider.lifecycle.waits.RunWatch`'s, the same one the blocking path uses;
this class only runs it in a thread of the triggerer's event loop.  No side effects while it waits: a
trigger may run twice.  A person killing the deferred task is the one exception (:meth:`on_kill`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.killed import KilledTask, undo
from airflow_stream_provider.lifecycle.waits import POLL_INTERVAL_S, RunWait
from airflow_stream_provider.triggers import resume_floor


class StreamRunTrigger(BaseTrigger):
    """Fire once ``wait`` is decided (or, without a wait, after ``pause_s``), with
    ``{"outcome": ..., "run_id": ..., "resume": resume}``.  A state database that does not answer is waited
    out until the wait's deadline; then, or on any other error, it fires ``{"outcome": "error", "message":
    ...}`` so the task fails with it instead of hanging.

    ``resume`` is the deferred flow's own state (the method to continue in and its arguments), carried in
    the event: ``dag.test()`` hands the resumed method the event alone, not the deferral's kwargs.
    ``killed`` is what the task leaves behind if a person kills it while it waits here
    (``lifecycle.killed``): Airflow then calls :meth:`on_kill`, never the operator's.
    """

    def __init__(self, *, wait: dict[str, Any] | None, state_conn_id: str, kafka_conn_id: str,
                 topics: list[str] | None = None, pause_s: float = 0.0, resume: dict[str, Any] | None = None,
                 killed: dict[str, Any] | None = None, resume_at: float | None = None,
                 deferred_at: float | None = None, deferred_in: str | None = None):
        super().__init__()
        self.wait = RunWait.from_dict(wait) if wait else None
        self.state_conn_id = state_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.topics = list(topics or [])
        self.pause_s = float(pause_s)
        #: when the pause ends (epoch seconds), fixed when the task defers: a triggerer that picks the trigger
        #: up again sleeps what is left, not the whole pause, which would outlast the lease held over it
        self.resume_at = float(resume_at) if resume_at is not None else time.time() + self.pause_s
        self.resume = resume or {}
        self.killed = KilledTask.from_dict(killed) if killed else None
        #: when and where the task deferred: its event is held back a few seconds (``resume_floor``)
        self.deferral = resume_floor.Deferral.of(deferred_at, deferred_in)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "wait": self.wait and self.wait.to_dict(), "state_conn_id": self.state_conn_id,
            "kafka_conn_id": self.kafka_conn_id, "topics": self.topics, "pause_s": self.pause_s,
            "resume": self.resume, "killed": self.killed and self.killed.to_dict(), "resume_at": self.resume_at,
            **self.deferral.kwargs()})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        if self.wait is None:
            await asyncio.sleep(max(0.0, self.resume_at - time.time()))
            await self.deferral.hold_back()
            yield TriggerEvent({"outcome": "paused", "run_id": None, "resume": self.resume})
            return
        async for event in self._watch():
            await self.deferral.hold_back()
            yield TriggerEvent({**event, "resume": self.resume})

    async def _watch(self) -> AsyncIterator[dict[str, Any]]:
        from airflow_stream_provider.lifecycle.controller import watch_for

        watch, close = await asyncio.to_thread(watch_for, self.wait, self.state_conn_id, self.kafka_conn_id,
                                               self.topics)
        try:
            while True:
                try:
                    outcome = await asyncio.to_thread(watch.poll_through_outages)
                except Exception as err:
                    yield {"outcome": "error", "run_id": self.wait.run_id,
                           "message": f"waiting on run {self.wait.run_id}: {err!r}"}
                    return
                for line in await asyncio.to_thread(watch.driver_log):
                    self.log.info("driver | %s", line)
                if outcome is not None:
                    yield {"outcome": outcome, "run_id": self.wait.run_id}
                    return
                await asyncio.sleep(POLL_INTERVAL_S)
        finally:
            close()

    async def on_kill(self) -> None:
        """A person marked the deferred task failed or succeeded, or cleared it: undo what its operator's
        ``on_kill`` would have (Airflow 3.3 on; a triggerer restart does not come here)."""
        if self.killed is None:
            return
        await asyncio.to_thread(self._undo)

    def _undo(self) -> None:
        state = StreamStateHook(self.state_conn_id)
        try:
            undo(state.store, self.killed, "its task was killed while deferred", self.log)
        finally:
            state.close()
