"""A lifecycle wait through a state database that stops answering: a PostgreSQL server of the test's own,
crashed (``pg_ctl stop -m immediate``) and started again while a launch waits for its run's query."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError

from airflow_stream_provider.lifecycle.waits import RunWait, RunWatch
from airflow_stream_provider.state.store import StateStore
from stack.outages import PostgresServer


@pytest.fixture
def server():
    server = PostgresServer().init()
    yield server
    server.destroy()


def test_a_launch_wait_rides_out_a_database_restart_until_its_deadline(server):
    """One failed read is not the launch's failure: the task would give up on (or an upgrade roll back) a
    driver that comes up fine.  Past the deadline the database's own error is raised."""
    store = StateStore.from_url(server.url)
    store.ensure_schema()
    try:
        ticket = store.begin_run("job", 1, "1.0")
        watch = RunWatch(RunWait.within(120, run_id=ticket.run_id, job_id="job", until="ready"), store.get_run,
                         lambda _run: None, lambda: False)
        assert watch.poll_through_outages() is None  # registered, its query not started yet

        server.crash()
        assert watch.poll_through_outages() is None
        with pytest.raises(OperationalError):
            watch.poll()  # what the wait rode out
        server.start()
        store.mark_query_started(ticket.run_id)
        assert watch.poll_through_outages() == "ready"

        server.crash()
        late = RunWatch(RunWait.within(-1, run_id=ticket.run_id, job_id="job", until="ready"), store.get_run,
                        lambda _run: None, lambda: False)
        with pytest.raises(OperationalError):
            late.poll_through_outages()
    finally:
        store.dispose()
