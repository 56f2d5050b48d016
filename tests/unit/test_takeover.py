"""The standby's takeover rule, row by row of its table (``airflow_stream_provider.takeover``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from airflow_stream_provider.spec import SpecError, StreamJobSpec
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.takeover import decide

NOW = 1_000_000.0
SPEC = StreamJobSpec.from_dict({
    "job_id": "orders", "version": "1.0", "checkpoint_root": "/ckpt", "database_url": "sqlite:////tmp/s.db",
    "kafka": {"bootstrap_servers": "k:9092", "topics": ["orders"]}, "standby": True,
    "heartbeat_timeout_seconds": 30.0})


def _run(status=RunStatus.RUNNING, heartbeat_age=1.0, **changes) -> RunRecord:
    return replace(RunRecord(run_id="r1", job_id="orders", epoch=4, generation=1, status=status, version="1.0",
                             host="h", pid=42, started_at=NOW - 100, heartbeat_at=NOW - heartbeat_age,
                             query_started_at=NOW - 90), **changes)


@pytest.mark.parametrize(("run", "alive", "action", "says"), [
    (None, None, "wait", "no run"),
    (_run(), True, "wait", "HEALTHY"),
    (_run(), False, "take_over", "pid 42 on h) is gone"),
    (_run(heartbeat_age=31), None, "take_over", "no heartbeat for 31s"),
    (_run(heartbeat_age=31), True, "take_over", "although its process lives"),  # paused or hung
    (_run(heartbeat_age=20), None, "wait", "HEALTHY"),
    (_run(status=RunStatus.STARTING, query_started_at=None, heartbeat_age=60), None, "wait", "STARTING"),
    (_run(status=RunStatus.STARTING, query_started_at=None), False, "take_over", "gone"),
    (_run(status=RunStatus.DEAD, termination_message="found dead"), None, "take_over", "found dead"),
    (_run(status=RunStatus.FAILED, failure_kind="USER_CODE"), None, "wait", "restart budget"),
    (_run(status=RunStatus.STOPPED), None, "end", "stopped cleanly"),
    # A stop that had to kill (or a restart's stop): taking over would undo it, or race the restart.
    (_run(status=RunStatus.DEAD, stop_requested_at=NOW - 60), None, "end", "asked to stop"),
    (_run(stop_requested_at=NOW - 60), False, "end", "asked to stop"),
    (_run(stop_requested_at=NOW - 60, heartbeat_age=31), None, "end", "asked to stop"),
    (_run(stop_requested_at=NOW - 5), True, "wait", "HEALTHY"),  # still stopping
    (_run(version="2.0"), True, "refuse", "standby version '1.0' differs from version '2.0'"),
])
def test_the_rule(run, alive, action, says):
    verdict = decide(SPEC, run, 1, driver_alive=alive, now=NOW)
    assert verdict.action == action and says in verdict.why


def test_a_standby_of_an_older_generation_is_refused():
    verdict = decide(SPEC, _run(status=RunStatus.DEAD), 2, driver_alive=None, now=NOW)
    assert verdict.action == "refuse" and "generation 2" in verdict.why


def test_a_heartbeat_timeout_under_two_heartbeats_is_refused_before_anything_starts():
    with pytest.raises(SpecError) as err:
        replace(SPEC, heartbeat_seconds=2.0, heartbeat_timeout_seconds=3.0).validate()
    assert err.value.field == "heartbeat_timeout_seconds"



@pytest.mark.parametrize(("run", "alive", "action"), [
    (_run(heartbeat_age=60), None, "wait"),  # silent 60 s, but 50 s of it the standby could not read either
    (_run(status=RunStatus.STARTING, query_started_at=None, heartbeat_age=400), None, "wait"),
    (_run(heartbeat_age=60), False, "take_over"),  # its process is gone: no outage explains that
    (_run(status=RunStatus.DEAD), None, "take_over"),
])
def test_silence_counts_from_when_the_standby_could_read_again(run, alive, action):
    """After an outage of the state database the run could not heartbeat into it either: its silence before
    the standby could read again is no evidence."""
    assert decide(SPEC, run, 1, driver_alive=alive, now=NOW, silent_since=NOW - 10).action == action


def test_silence_after_the_standby_could_read_again_is_judged_by_the_timeout():
    assert decide(SPEC, _run(heartbeat_age=60), 1, driver_alive=None, now=NOW + 25,
                  silent_since=NOW - 10).action == "take_over"
