"""What a lifecycle step waits for, decided one poll at a time (the trigger and the blocking path share it)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from airflow_stream_provider.lifecycle import waits
from airflow_stream_provider.lifecycle.waits import RunWait, RunWatch
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.triggers import resume_floor
from airflow_stream_provider.triggers.run import StreamRunTrigger

NOW = time.time()
STARTING = RunRecord("r1", "j", 1, 1, RunStatus.STARTING, pid=4242, host="h", started_at=NOW)
RUNNING = replace(STARTING, status=RunStatus.RUNNING, query_started_at=NOW)


def _watch(rows, until="ready", *, alive=True, caught_up=False, timeout=60.0, **fields):
    rows = iter(rows)
    wait = RunWait.within(timeout, run_id="r1", job_id="j", until=until, **fields)
    return RunWatch(wait, lambda _run_id: next(rows), lambda _run: alive, lambda: caught_up)


def test_ready_once_the_query_runs():
    watch = _watch([STARTING, RUNNING])
    assert watch.poll() is None
    assert watch.poll() == "ready"


def test_a_settling_launch_is_ready_once_its_first_batch_is_over():
    """A recovery's task resumes after the new run's first batch, not during it (it would take its CPU)."""
    watch = _watch([STARTING, RUNNING, RUNNING, replace(RUNNING, last_batch_id=7)], settle_s=60.0)
    assert watch.poll() is None
    assert watch.poll() is None  # the query runs: its first batch is not over yet
    assert watch.poll() is None
    assert watch.poll() == "ready"


def test_a_settling_launch_whose_query_ran_is_ready_however_its_first_batch_ends():
    """The query started, so the launch worked, as without settling: a run that fails its first batch is
    the next diagnosis's (and counts against the restart budget)."""
    rows = iter([RUNNING, replace(RUNNING, status=RunStatus.FAILED)])
    wait = RunWait.within(60, run_id="r1", job_id="j", until="ready", settle_s=60.0)
    ended = RunWatch(wait, lambda _run_id: next(rows), lambda run: run.status == RunStatus.RUNNING, lambda: False)
    assert ended.poll() is None and ended.poll() == "ready"
    assert _watch([RUNNING], settle_s=60.0, caught_up=True).poll() == "ready"  # nothing to read: no batch comes
    slow = _watch([RUNNING, RUNNING], settle_s=0.05)  # a first batch longer than the settling time
    assert slow.poll() is None
    time.sleep(0.06)
    assert slow.poll() == "ready"
    late = _watch([RUNNING, RUNNING], settle_s=60.0, timeout=0.05)  # the deadline, with the query running
    assert late.poll() is None
    time.sleep(0.06)
    assert late.poll() == "ready"


def test_a_batch_counts_from_min_batch_id():
    watch = _watch([replace(RUNNING, last_batch_id=0), replace(RUNNING, last_batch_id=1)], "batch", min_batch_id=1)
    assert watch.poll() is None
    assert watch.poll() == "batch"


def test_a_recorded_end_ends_the_wait_at_once_a_vanished_driver_after_a_second_look():
    assert _watch([replace(RUNNING, status=RunStatus.FAILED)], alive=False).poll() == "ended"
    vanished = _watch([RUNNING, RUNNING], "ended", alive=False)
    assert vanished.poll() is None  # time for the driver's termination record
    assert vanished.poll() == "ended"


def test_a_driver_that_never_registered_ends_the_wait_when_its_process_is_gone():
    watch = _watch([None, None], pid=2**22 + 17, started_at=NOW)  # no such process
    assert watch.poll() is None
    assert watch.poll() == "ended"


def test_idle_only_after_staying_caught_up(monkeypatch):
    monkeypatch.setattr(waits, "IDLE_CONFIRM_S", 0.05)
    watch = _watch([RUNNING] * 3, "batch", idle=True, caught_up=True)
    assert watch.poll() is None
    time.sleep(0.06)
    assert watch.poll() == "idle"


def test_the_idle_check_asks_kafka_at_most_every_few_seconds(monkeypatch):
    """Each ask opens a Kafka consumer: polling every 0.5 s must not open one each time."""
    asked = []
    wait = RunWait.within(60, run_id="r1", job_id="orders", until="batch", idle=True, min_batch_id=9)
    watch = RunWatch(wait, lambda _run_id: RUNNING, lambda _run: True, lambda: asked.append(1) or False)
    for _ in range(5):
        assert watch.poll() is None
    assert len(asked) == 1
    monkeypatch.setattr(waits, "CAUGHT_UP_EVERY_S", 0.0)
    assert watch.poll() is None and len(asked) == 2


def test_a_launch_pid_is_checked_only_on_the_host_that_started_it():
    """A triggerer (or a resumed task) on another host has no such process: that is not the driver ending.
    There only the run's row and the deadline decide."""
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    here = _watch([None, None], until="ready", pid=gone.pid, host=socket.gethostname(), started_at=time.time())
    assert here.poll() is None and here.poll() == "ended"
    elsewhere = _watch([None, None, None], until="ready", pid=gone.pid, host="another-host", started_at=time.time())
    assert elsewhere.poll() is None and elsewhere.poll() is None
    stopping = _watch([RUNNING, RUNNING], until="ended", alive=None, pid=gone.pid, host="another-host")
    assert stopping.poll() is None and stopping.poll() is None
    older = _watch([None, None], until="ready", pid=gone.pid, started_at=time.time())  # recorded without a host
    assert older.poll() is None and older.poll() == "ended"


def test_the_deadline_is_absolute():
    assert _watch([STARTING], timeout=-1).poll() == "timeout"


def test_the_trigger_round_trips_and_carries_the_flow_state():
    wait = RunWait.within(5, run_id="r1", job_id="j", until="ended")
    trigger = StreamRunTrigger(wait=wait.to_dict(), state_conn_id="s", kafka_conn_id="k", topics=["t"],
                               resume={"method": "_next", "state": {"ctx": {"a": 1}}})
    path, kwargs = trigger.serialize()
    assert path == "airflow_stream_provider.triggers.run.StreamRunTrigger"
    again = StreamRunTrigger(**kwargs)
    assert again.wait == wait and again.resume == trigger.resume


@pytest.mark.parametrize("seconds", [0.01])
def test_a_pause_fires_with_the_flow_state(seconds):
    trigger = StreamRunTrigger(wait=None, state_conn_id="s", kafka_conn_id="k", pause_s=seconds,
                               resume={"method": "_act", "state": {}})

    async def first():
        async for event in trigger.run():
            return event.payload

    assert asyncio.run(first()) == {"outcome": "paused", "run_id": None, "resume": {"method": "_act", "state": {}}}


def test_a_pause_picked_up_by_another_triggerer_sleeps_what_is_left():
    """A triggerer restarted 200 s into a 300 s backoff slept the whole pause again, past the lease the task
    held over it (the pause plus a grace): another task could take the job meanwhile."""
    trigger = StreamRunTrigger(wait=None, state_conn_id="s", kafka_conn_id="k", pause_s=300,
                               resume={"method": "_act", "state": {}})
    _, kwargs = trigger.serialize()
    picked_up = StreamRunTrigger(**{**kwargs, "resume_at": kwargs["resume_at"] - 299.9})  # as 299.9 s later

    async def first():
        async for event in picked_up.run():
            return event.payload

    began = time.monotonic()
    assert asyncio.run(first())["outcome"] == "paused"
    assert time.monotonic() - began < 5


def test_an_event_is_held_back_from_the_deferral_where_the_trigger_runs_in_another_process(monkeypatch):
    """Airflow 3.3 fails a task whose resumed attempt overtakes the exit report of the process that deferred
    it (apache/airflow#72716): a trigger in the triggerer holds its event back ``RESUME_FLOOR_S`` from the
    deferral.  Run inline by the process that deferred (``dag.test()``), it does not."""
    monkeypatch.setattr(resume_floor, "RESUME_FLOOR_S", 1.0)
    _, kwargs = StreamRunTrigger(wait=None, state_conn_id="s", kafka_conn_id="k", pause_s=0.01,
                                 resume={"method": "_act", "state": {}}).serialize()

    def seconds_to_event(trigger: StreamRunTrigger) -> float:
        async def first():
            async for event in trigger.run():
                return event.payload

        began = time.monotonic()
        assert asyncio.run(first())["outcome"] == "paused"
        return time.monotonic() - began

    assert 0.8 < seconds_to_event(StreamRunTrigger(**{**kwargs, "deferred_in": "worker-host:4242"})) < 5
    assert seconds_to_event(StreamRunTrigger(**kwargs)) < 0.8
