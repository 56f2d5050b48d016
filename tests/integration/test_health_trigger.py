"""The health trigger under asyncio, against a real state database: it fires the right event, serialises
for the triggerer, and keeps polling while the job is healthy."""

from __future__ import annotations

import asyncio
import json
import time

from airflow_stream_provider.triggers.health import StreamHealthTrigger


def _trigger(**kwargs) -> StreamHealthTrigger:
    return StreamHealthTrigger(job_id="job", topics=["events"], state_conn_id="stream_state_default",
                               kafka_conn_id="stream_kafka_default", heartbeat_timeout=5, poll_interval=0.2,
                               **kwargs)


def test_serialises_to_its_own_classpath_and_json():
    classpath, kwargs = _trigger().serialize()
    assert classpath == "airflow_stream_provider.triggers.health.StreamHealthTrigger"
    assert StreamHealthTrigger(**json.loads(json.dumps(kwargs))).serialize() == (classpath, kwargs)


def test_fires_dead_for_a_driver_without_heartbeat(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.mark_query_started(ticket.run_id)
    state_store._update_run(ticket.run_id, heartbeat_at=time.time() - 60)
    event = asyncio.run(_trigger().run().asend(None))
    assert event.payload["status"] == "fired"
    assert event.payload["diagnosis"]["health"] == "DEAD"
    assert event.payload["diagnosis"]["run_id"] == ticket.run_id


def test_keeps_polling_while_healthy_then_fires_on_failure(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.mark_query_started(ticket.run_id)

    async def scenario():
        watcher = asyncio.ensure_future(_trigger().run().asend(None))
        for _ in range(5):  # healthy: no event for a while
            await asyncio.sleep(0.2)
            state_store.heartbeat(ticket.run_id)
            assert not watcher.done()
        state_store.finish_run(ticket.run_id, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                         error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
                         message="[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match")
        return await asyncio.wait_for(watcher, 10)

    event = asyncio.run(scenario())
    assert event.payload["diagnosis"]["failure_kind"] == "CHECKPOINT_INCOMPATIBLE"


def test_failure_kind_filter_ignores_other_failures(state_store):
    ticket = state_store.begin_run("job", 1, "1.0")
    state_store.finish_run(ticket.run_id, status="FAILED", exit_code=1, failure_kind="USER_CODE", message="bug")
    trigger = _trigger(fire_on=["FAILED"], failure_kinds=["CHECKPOINT_INCOMPATIBLE"])

    async def scenario():
        watcher = asyncio.ensure_future(trigger.run().asend(None))
        await asyncio.sleep(1.0)
        assert not watcher.done(), "a USER_CODE failure must not fire the checkpoint sensor"
        watcher.cancel()

    asyncio.run(scenario())
