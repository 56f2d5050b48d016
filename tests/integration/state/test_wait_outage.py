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


def test_a_postgresql_connection_is_bounded_unless_its_url_says_otherwise(postgres_url):
    """Without them a read from a peer that vanished waits on the operating system's TCP retries (about 15
    minutes): a deferred task's trigger, or a driver's commit, hung that long."""
    from sqlalchemy.engine import make_url

    from airflow_stream_provider.state.dialect import POSTGRES_CONNECTION_BOUNDS, engine_for

    for url, connect_timeout in [(make_url(postgres_url), "15"),
                                 (make_url(postgres_url).update_query_dict({"connect_timeout": "3"}), "3")]:
        engine = engine_for(url)
        try:
            with engine.connect() as conn:
                parameters = conn.connection.dbapi_connection.info.get_parameters()
        finally:
            engine.dispose()
        assert parameters["connect_timeout"] == connect_timeout, parameters
        assert {k: parameters[k] for k in POSTGRES_CONNECTION_BOUNDS if k != "connect_timeout"} == {
            k: str(v) for k, v in POSTGRES_CONNECTION_BOUNDS.items() if k != "connect_timeout"}
