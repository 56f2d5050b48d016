"""Stored times follow the state database's clock (``state.clock``): hosts whose clocks disagree still agree
on a heartbeat's age, on when a lease runs out, on when a wait is over and on whether a pid is still the
driver's.

Each test moves one "host's" clock 120 s ahead by patching ``time.time`` in this process after the other
"host" wrote: a skewed system clock cannot be set here without root, and setting it would move every other
process on this shared machine.  The two hosts are two state stores on engines of their own, as two
processes have.  PostgreSQL is the database several hosts share; SQLite is a file on one host, whose clock
is the database's.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from airflow_stream_provider import diagnosis, local_driver
from airflow_stream_provider.diagnosis import Health
from airflow_stream_provider.lifecycle.controller import watch_for
from airflow_stream_provider.lifecycle.waits import RunWait
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.store import StateStore
from tests.dagtest import airflow as airflow_stack

AHEAD_S = 120.0


def clock_ahead(monkeypatch, seconds: float = AHEAD_S) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def host(url: str) -> StateStore:
    store = StateStore.from_url(url)
    store.ensure_schema()
    return store


def test_a_heartbeat_is_judged_fresh_by_a_host_whose_clock_runs_ahead(postgres_url, monkeypatch):
    """A watcher on a host 120 s ahead of the driver's: the heartbeat the driver just wrote is fresh, not 120 s
    old (a driver on another host is judged by its heartbeat alone: DEAD past 30 s, and restarted)."""
    driver_host = host(postgres_url)
    ticket = driver_host.begin_run("job", 0, "1.0", host="driver-host", pid=4242)
    driver_host.mark_query_started(ticket.run_id)
    driver_host.heartbeat(ticket.run_id)

    clock_ahead(monkeypatch)
    watcher_host = host(postgres_url)
    run = watcher_host.latest_run("job")
    assert local_driver.run_alive(run) is None  # another host's driver: its heartbeat is the only evidence
    found = diagnosis.diagnose("job", run, driver_alive=None, lag=None)
    assert found.health == Health.HEALTHY, found.evidence
    assert time.time() - run.heartbeat_at < 5
    assert watcher_host.clock.offset() == pytest.approx(-AHEAD_S, abs=1.0)

    # The driver's own host stepped too (an NTP step): its clock measures again at once, so what it writes
    # next is still by the database's clock.
    assert driver_host.clock.offset() == pytest.approx(-AHEAD_S, abs=1.0)
    driver_host.heartbeat(ticket.run_id)
    assert abs(watcher_host.latest_run("job").heartbeat_at - time.time()) < 5


def test_a_host_whose_clock_runs_ahead_does_not_take_a_lease_that_has_not_run_out(postgres_url, monkeypatch):
    """A recover on a host 120 s ahead must not find the submit's one-minute lease run out and act beside it."""
    assert LeaseLog(host(postgres_url)).take("job", "deploy/r1/submit/-1", "submit", time.time() + 60) is None

    clock_ahead(monkeypatch)
    held = LeaseLog(host(postgres_url)).take("job", "health/r7/recover/-1", "recover", time.time() + 60)
    assert held is not None and held.owner == "deploy/r1/submit/-1"
    assert 50 < held.until - time.time() <= 60, held  # a minute left, by this host's clock as well
    assert "for 0 s" in held.describe(time.time())


def test_a_wait_set_on_a_worker_is_not_over_early_on_a_triggerer_whose_clock_runs_ahead(postgres_url, broker,
                                                                                         monkeypatch):
    """A launch wait of a minute, set on a worker and deferred to a triggerer 120 s ahead: the triggerer's
    watch (``watch_for``, what ``RunTrigger`` polls) does not find it over at once; a wait whose minute is
    over by the database's clock is."""
    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_default", conn_type="stream_state",
                                                     extra={"url": postgres_url}))
    monkeypatch.setenv(*airflow_stack.connection_env("stream_kafka_default", conn_type="stream_kafka",
                                                     host="127.0.0.1", port=broker.port))
    worker = host(postgres_url)
    starting = worker.begin_run("job", 0, "1.0", host="driver-host", pid=4242)  # its query not started yet
    waits = {"a minute": RunWait.within(60, worker.clock.now(), run_id=starting.run_id, job_id="job", until="ready"),
             "over": RunWait.within(-1, worker.clock.now(), run_id=starting.run_id, job_id="job", until="ready")}

    clock_ahead(monkeypatch)
    outcomes = {}
    for name, wait in waits.items():  # through the trigger's serialized kwargs, as a deferral carries it
        watch, close = watch_for(RunWait.from_dict(wait.to_dict()), "stream_state_default", "stream_kafka_default",
                                 ["events"])
        try:
            outcomes[name] = watch.poll()
        finally:
            close()
    assert outcomes == {"a minute": None, "over": "timeout"}


def test_a_driver_on_a_host_whose_clock_runs_ahead_is_alive_by_its_pid(postgres_url, monkeypatch):
    """The pid check compares the process's start, by this host's clock, with when its run registered: a
    stored time handed out in this host's terms, or the driver would look like a reused pid."""
    clock_ahead(monkeypatch)
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        store = host(postgres_url)
        store.begin_run("job", 0, "1.0", host=socket.gethostname(), pid=driver.pid)
        assert local_driver.run_alive(store.latest_run("job")) is True
    finally:
        driver.kill()
        driver.wait()


def test_sqlite_keeps_this_hosts_clock(tmp_path, monkeypatch):
    """One host reads and writes a SQLite file, by its own clock: nothing is measured, whatever that clock does."""
    store = host(f"sqlite:///{tmp_path / 'state.db'}")
    clock_ahead(monkeypatch)
    assert store.clock.offset() == 0.0
    ticket = store.begin_run("job", 0, "1.0", host="h", pid=1)
    assert store.get_run(ticket.run_id).started_at == pytest.approx(time.time(), abs=1.0)
