"""The fence watch (``runtime.fence_watch``) ends a fenced driver whose main loop is held up, and nothing
else.

These run the watch's thread against a real state database (SQLite here: the watch reads one row) with a
short period; the process it would end is this test's, so ``exit`` is a callback that records the code.
Real drivers held up in a stop and in a start are ended in ``tests/e2e/test_runtime.py``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from airflow_stream_provider import failures
from airflow_stream_provider.runtime.fence_watch import FenceWatch
from airflow_stream_provider.state import store as state
from airflow_stream_provider.state.store import StateStore

EVERY_S = 0.05
GRACE_S = 0.4


class Exits:
    def __init__(self):
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


@pytest.fixture
def sqlite_store(tmp_path):
    store = StateStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    store.ensure_schema()
    yield store
    store.dispose()


def watch(store: StateStore, ticket: state.RunTicket, exits: Exits) -> FenceWatch:
    return FenceWatch(store, "job", ticket.run_id, ticket.epoch, every_s=EVERY_S, grace_s=GRACE_S,
                      exit=exits).start()


def test_a_run_whose_epoch_was_taken_is_recorded_fenced_and_its_process_ended(sqlite_store):
    ticket = sqlite_store.begin_run("job", 0, "1.0", host="here", pid=1)
    exits = Exits()
    watch(sqlite_store, ticket, exits)
    assert not exits.called.wait(GRACE_S * 3), "ended while the run still held the job's epoch"

    sqlite_store.begin_run("job", 0, "1.0", host="elsewhere (00000000)", pid=2)  # a restart on another host
    taken = time.monotonic()
    assert exits.called.wait(GRACE_S + 20 * EVERY_S), "the fenced run's process was not ended"
    assert time.monotonic() - taken >= GRACE_S, "ended before its main loop had its grace to end it"
    assert exits.codes == [failures.EXIT_CONCURRENT]
    run = sqlite_store.get_run(ticket.run_id)
    assert run.status == state.FAILED and run.failure_kind == failures.FailureKind.CONCURRENT.value, run
    assert "did not end within" in run.termination_message and "current epoch is 2" in run.termination_message


def test_a_run_whose_end_is_recorded_keeps_its_record_and_exits_with_its_code(sqlite_store):
    """The main loop recorded a graceful stop, and the next run took the job while this process's Spark
    session was still stopping: the stop stays recorded as it was, and the process exits with its code."""
    ticket = sqlite_store.begin_run("job", 0, "1.0", host="here", pid=1)
    sqlite_store.finish_run(ticket.run_id, status=state.STOPPED, exit_code=failures.EXIT_STOPPED, message="stopped")
    exits = Exits()
    watch(sqlite_store, ticket, exits).ended(failures.EXIT_STOPPED)
    sqlite_store.begin_run("job", 0, "1.1", host="here", pid=2)
    assert exits.called.wait(GRACE_S + 20 * EVERY_S)
    assert exits.codes == [failures.EXIT_STOPPED]
    run = sqlite_store.get_run(ticket.run_id)
    assert run.status == state.STOPPED and run.termination_message == "stopped", run


def test_an_end_the_main_loop_records_meanwhile_is_the_one_kept(sqlite_store):
    """The grace runs out while the main loop is recording the run's end (a stop that came unstuck): the
    watch waits for it, writes nothing over it, and exits with its code."""
    ticket = sqlite_store.begin_run("job", 0, "1.0", host="here", pid=1)
    exits = Exits()
    fence = watch(sqlite_store, ticket, exits)
    with fence.recording:  # as StreamHarness._finish holds it
        sqlite_store.begin_run("job", 0, "1.0", host="elsewhere (00000000)", pid=2)
        time.sleep(GRACE_S + 10 * EVERY_S)
        assert not exits.called.is_set()
        sqlite_store.finish_run(ticket.run_id, status=state.STOPPED, exit_code=failures.EXIT_STOPPED,
                                message="stopped")
        fence.ended(failures.EXIT_STOPPED)
    assert exits.called.wait(5)
    assert exits.codes == [failures.EXIT_STOPPED]
    run = sqlite_store.get_run(ticket.run_id)
    assert run.status == state.STOPPED and run.termination_message == "stopped", run


class _BrokenHandler(logging.StreamHandler):
    """A log handler whose stream was taken away (seen in a pytest worker), and whose flush fails."""

    def __init__(self):
        super().__init__()
        self.stream = None

    def emit(self, record):
        pass

    def flush(self):
        raise ValueError("I/O operation on closed file")


def test_output_that_cannot_be_flushed_does_not_keep_the_process_alive(sqlite_store):
    ticket = sqlite_store.begin_run("job", 0, "1.0", host="here", pid=1)
    broken = _BrokenHandler()
    logging.getLogger().addHandler(broken)
    try:
        exits = Exits()
        watch(sqlite_store, ticket, exits)
        sqlite_store.begin_run("job", 0, "1.0", host="elsewhere (00000000)", pid=2)
        assert exits.called.wait(GRACE_S + 20 * EVERY_S), "the watch died flushing the log"
    finally:
        logging.getLogger().removeHandler(broken)
    assert exits.codes == [failures.EXIT_CONCURRENT]


def test_an_unreachable_database_is_no_reason_to_end(sqlite_store, monkeypatch):
    """A state database that does not answer says nothing about the epoch: the driver rides the outage out
    (its main loop retries; its commits wait), and the watch does not end it.  Once the database answers
    with a newer epoch, it does."""
    ticket = sqlite_store.begin_run("job", 0, "1.0", host="here", pid=1)
    reads = []

    def unreachable(job_id):
        reads.append(job_id)
        raise ConnectionError("the state database does not answer")

    real = sqlite_store.current_epoch
    monkeypatch.setattr(sqlite_store, "current_epoch", unreachable)
    sqlite_store.begin_run("job", 0, "1.0", host="elsewhere (00000000)", pid=2)
    exits = Exits()
    watch(sqlite_store, ticket, exits)
    assert not exits.called.wait(GRACE_S * 3), "ended on a database that did not answer"
    assert len(reads) > 3, "the watch stopped reading"

    monkeypatch.setattr(sqlite_store, "current_epoch", real)  # back, with the newer run's epoch
    assert exits.called.wait(GRACE_S + 20 * EVERY_S), "the watch did not go on after the outage"
    assert exits.codes == [failures.EXIT_CONCURRENT]
