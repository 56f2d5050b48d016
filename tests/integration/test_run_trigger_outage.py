"""The trigger a deferred step waits on, started while the state database does not answer: it waits for
the database within its deadline, as it does for an outage that begins later.  A triggerer picks a trigger
up again after its own restart, whatever the database's state then."""

from __future__ import annotations

import asyncio
import time

from airflow_stream_provider.lifecycle.waits import RunWait
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.triggers.run import StreamRunTrigger
from tests.dagtest import airflow as airflow_stack


def test_a_run_trigger_started_while_the_state_database_is_away_waits_for_it(tmp_path, monkeypatch):
    """It raised the database's error out of the trigger: the task failed with "Trigger failure" and no
    message of this provider's, and a stop it waited on never escalated.  Here the database cannot be
    opened (its directory does not exist yet), then can: the trigger fires once the run it waits on is up."""
    home = tmp_path / "state-not-there-yet"
    url = f"sqlite:///{home / 'state.db'}"
    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_away", conn_type="stream_state",
                                                     extra={"url": url}))
    wait = RunWait.within(60, run_id="r1", job_id="job", until="ready")
    trigger = StreamRunTrigger(wait=wait.to_dict(), state_conn_id="stream_state_away", kafka_conn_id="unused",
                               topics=["events"])

    async def scenario() -> tuple[dict, float]:
        events = trigger.run()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(3)
        assert not first.done(), f"fired while the database was away: {first.result().payload}"
        home.mkdir()
        store = StateStore.from_url(url)
        store.ensure_schema()
        store.begin_run("job", 1, "1.0", run_id="r1")
        store.mark_query_started("r1")
        back = time.monotonic()
        event = await asyncio.wait_for(first, 30)
        await events.aclose()
        store.dispose()
        return event.payload, time.monotonic() - back

    payload, seconds = asyncio.run(scenario())
    assert (payload["outcome"], payload["run_id"]) == ("ready", "r1"), payload
    assert seconds < 15
