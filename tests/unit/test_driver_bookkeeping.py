"""The driver's own records around its query when the state database fails for a moment: the query's
start, a committed batch's progress, a graceful stop.  Each write is best effort or tried again, so a short
outage neither fails a healthy run nor leaves it misread.

The state database is a stand-in that fails on cue: a real one cannot be made to fail at exactly these
moments here.  The drivers' whole paths, with real databases, are in ``tests/e2e``."""

from __future__ import annotations

import json
import time
import types
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import OperationalError

from airflow_stream_provider.runtime.harness import StreamHarness
from airflow_stream_provider.runtime.listener import StateListener
from airflow_stream_provider.state import store as state


def _away() -> OperationalError:
    return OperationalError("UPDATE stream_runs ...", None, ConnectionError("the state database is away"))


class _Store:
    """Records the driver's writes; ``failing`` names the writes that raise."""

    def __init__(self, *failing: str):
        self.failing = set(failing)
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def write(*args, **kwargs):
            self.calls.append((name, *args))
            if name in self.failing:
                raise _away()
            return SimpleNamespace(stop_requested=False, job_epoch=None)
        return write


def test_a_query_start_the_database_missed_is_recorded_once_it_answers():
    """Left STARTING, a run is never judged STUCK, a deploy's wait for it times out, and a standby waits the
    whole start timeout: the main loop records the start the listener could not."""
    store = _Store("mark_query_started")
    listener = StateListener(store, "run-1", "job")
    listener.onQueryStarted(SimpleNamespace(name="job", id="q-1"))  # the listener swallows the error
    assert listener.start_pending
    store.failing.clear()
    listener.record_start()
    assert not listener.start_pending
    assert [c for c in store.calls if c[0] == "mark_query_started"] == [("mark_query_started", "run-1")] * 2


def test_a_committed_batch_whose_progress_is_not_recorded_does_not_fail_the_run():
    """The batch's transaction committed; the progress line after it is bookkeeping, and its failure failed
    the query (a cold restart), or behind the writer read as a failed commit."""
    store = _Store("record_progress")
    harness = SimpleNamespace(store=store, run_id="run-1", startup=SimpleNamespace(committed=lambda: None),
                              spec=SimpleNamespace(dry_run=True), _rerun_of_batch_0=False)
    StreamHarness._after_commit(harness, SimpleNamespace(batch_id=7))
    assert ("record_progress", "run-1", 7, None) in store.calls


class _Query:
    """A query whose batch runs ``batch_s`` more seconds."""

    def __init__(self, batch_s: float):
        self.ends = time.monotonic() + batch_s
        self.stopped = False
        self.lastProgress = None

    @property
    def status(self):
        return {"isTriggerActive": time.monotonic() < self.ends}

    def stop(self):
        self.stopped = True

    def exception(self):
        return None


@pytest.mark.parametrize("failing", [(), ("set_status", "heartbeat")], ids=["database-up", "database-away"])
def test_a_graceful_stop_heartbeats_while_its_batch_finishes_and_stops_with_the_database_away(failing):
    """A batch may run for minutes after the stop is asked: silent that long, the draining driver read as
    dead to a watcher on another host, and a standby took the stop over.  With the database away (a SIGTERM,
    which it cannot record), the status write failed the stop: exit 6, the query never stopped."""
    store = _Store(*failing)
    ended = []
    harness = SimpleNamespace(store=store, run_id="run-1", spec=SimpleNamespace(heartbeat_seconds=0.05),
                              listener=SimpleNamespace(batches_completed=0),
                              _finish=lambda *args: ended.append(args) or 0)
    harness._stopping_bookkeeping = types.MethodType(StreamHarness._stopping_bookkeeping, harness)
    query = _Query(0.4)
    assert StreamHarness._stop_gracefully(harness, query) == 0
    assert query.stopped and ended[0][0] == state.STOPPED
    assert ("set_status", "run-1", state.STOPPING) in store.calls
    assert sum(c[0] == "heartbeat" for c in store.calls) >= 3, store.calls


def test_a_database_url_no_installed_driver_serves_is_bad_configuration(tmp_path):
    """Exit 2, the configuration's code, before anything starts: it was exit 1 (a failed job) and read as a
    state database out of reach."""
    spec = {"job_id": "orders", "version": "1.0", "checkpoint_root": str(tmp_path),
            "database_url": "postgresql+psycopg3://stream@db/results",
            "kafka": {"bootstrap_servers": "127.0.0.1:9", "topics": ["orders"]}}
    with pytest.raises(SystemExit) as ended:
        StreamHarness.from_argv(["--spec", json.dumps(spec)])
    assert ended.value.code == 2
