"""Health rules and the restart budget, on run rows as the driver writes them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import Health, Thresholds, diagnose
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.state.records import RunRecord

NOW = 1_800_000_000.0


def _run(**overrides):
    row = {"run_id": "r1", "job_id": "j", "epoch": 3, "generation": 1, "status": "RUNNING", "pid": 4242,
           "host": "h", "started_at": NOW - 100, "heartbeat_at": NOW - 1, "query_started_at": NOW - 90,
           "last_batch_id": 7, "last_batch_at": NOW - 2, "exit_code": None, "failure_kind": None,
           "error_class": None, "termination_message": None}
    row.update(overrides)
    return RunRecord(**row)


def test_no_run_is_stopped():
    assert diagnose("j", None, driver_alive=None, lag=0).health == Health.STOPPED


def test_healthy():
    found = diagnose("j", _run(), driver_alive=True, lag=10, now=NOW)
    assert found.health == Health.HEALTHY and not found.health.needs_action


def test_dead_by_process_check_even_with_a_fresh_heartbeat():
    found = diagnose("j", _run(), driver_alive=False, lag=0, now=NOW)
    assert found.health == Health.DEAD and "pid 4242 on h" in found.evidence[0]


def test_a_run_recorded_dead_stays_dead_whatever_the_process_check():
    found = diagnose("j", _run(status="DEAD", termination_message="found dead: pid 4242 gone"),
                     driver_alive=None, lag=0, now=NOW)
    assert found.health == Health.DEAD and found.evidence == ["found dead: pid 4242 gone"]


@pytest.mark.parametrize(("run", "alive"), [
    (_run(status="DEAD", termination_message="driver gone during a graceful stop (killed)"), None),
    (_run(), False),  # gone, and the stop's task has not recorded it yet
    (_run(heartbeat_at=NOW - 45), None),  # on another host: silent since
])
def test_a_run_asked_to_stop_that_ended_otherwise_is_dead_and_says_it_was_being_stopped(run, alive):
    """No clean stop was recorded, so DEAD; the diagnosis carries the stop request, so that no restart undoes
    the stop (or races the restart, reset or upgrade that asked for it)."""
    found = diagnose("j", replace(run, stop_requested_at=NOW - 200), driver_alive=alive, lag=5, now=NOW,
                     thresholds=Thresholds(heartbeat_timeout_s=30))
    assert found.health == Health.DEAD and found.stop_requested_at == NOW - 200
    assert "was asked to stop at" in found.evidence[-1] and "before it stopped cleanly" in found.evidence[-1]
    assert found.advice.startswith("Nothing to restart: the job was being stopped")
    still = diagnose("j", replace(_run(), stop_requested_at=NOW - 5), driver_alive=True, lag=5, now=NOW)
    assert still.health == Health.HEALTHY  # still stopping: its stop's task waits on it


def test_a_run_that_failed_as_it_was_being_stopped_says_so_and_carries_the_stop():
    run = _run(status="FAILED", exit_code=75, failure_kind="TRANSIENT", termination_message="connection reset",
               stop_requested_at=NOW - 30)
    found = diagnose("j", run, driver_alive=None, lag=0, now=NOW)
    assert found.health == Health.FAILED and found.stop_requested_at == NOW - 30
    assert "asked to stop at" in found.evidence[-1] and found.advice.startswith("Nothing to restart")
    plain = diagnose("j", replace(run, stop_requested_at=None), driver_alive=None, lag=0, now=NOW)
    assert plain.stop_requested_at is None and not plain.advice.startswith("Nothing to restart")


def test_dead_by_heartbeat_age_where_the_process_cannot_be_checked():
    found = diagnose("j", _run(heartbeat_at=NOW - 45), driver_alive=None, lag=0, now=NOW,
                     thresholds=Thresholds(heartbeat_timeout_s=30))
    assert found.health == Health.DEAD and "45s old" in found.evidence[0]


def test_a_run_launched_with_a_longer_heartbeat_timeout_is_judged_by_it():
    """A job set to heartbeat every 30 s (timeout 90 s): a sensor or operator left at its 30 s default would
    find it dead between two heartbeats, and restart a healthy driver on another host."""
    spec = json.dumps({"job_id": "j", "heartbeat_seconds": 30.0, "heartbeat_timeout_seconds": 90.0})
    thresholds = Thresholds(heartbeat_timeout_s=30)
    between = diagnose("j", _run(heartbeat_at=NOW - 45, spec=spec), driver_alive=None, lag=0, now=NOW,
                       thresholds=thresholds)
    assert between.health == Health.HEALTHY
    silent = diagnose("j", _run(heartbeat_at=NOW - 95, spec=spec), driver_alive=None, lag=0, now=NOW,
                      thresholds=thresholds)
    assert silent.health == Health.DEAD and "95s old (timeout 90s)" in silent.evidence[0]
    longer = diagnose("j", _run(heartbeat_at=NOW - 95, spec=spec), driver_alive=None, lag=0, now=NOW,
                      thresholds=Thresholds(heartbeat_timeout_s=120))  # the longer of the two
    assert longer.health == Health.HEALTHY


def test_a_live_process_with_a_late_heartbeat_is_not_dead():
    """On a loaded host heartbeats lag: a process the check finds alive is not DEAD (a submit would start a
    second driver beside it).  Silent past ``stuck_after`` it is STUCK: alive, but hung or starved."""
    thresholds = Thresholds(heartbeat_timeout_s=30, stuck_after_s=300)
    late = diagnose("j", _run(heartbeat_at=NOW - 45), driver_alive=True, lag=0, now=NOW, thresholds=thresholds)
    assert late.health == Health.HEALTHY
    # when it turns STUCK if it stays silent: a recovery sent by a watcher that judged it by heartbeats (DEAD,
    # from another host) looks again then
    assert late.stuck_at == NOW - 45 + 300 and "STUCK if still silent in 255s" in late.evidence[-1]
    assert diagnose("j", _run(heartbeat_at=NOW - 5), driver_alive=True, lag=0, now=NOW,
                    thresholds=thresholds).stuck_at is None
    stopping = diagnose("j", _run(heartbeat_at=NOW - 45, stop_requested_at=NOW - 50), driver_alive=True, lag=0,
                        now=NOW, thresholds=thresholds)
    assert stopping.health == Health.HEALTHY and stopping.stuck_at is None  # its stop's task waits on it
    silent = diagnose("j", _run(heartbeat_at=NOW - 400), driver_alive=True, lag=0, now=NOW, thresholds=thresholds)
    assert silent.health == Health.STUCK and "alive but its last heartbeat is 400s old" in silent.evidence[0]


@pytest.mark.parametrize(("lag", "idle", "health"), [(5, 400, Health.STUCK), (0, 400, Health.HEALTHY),
                                                      (5, 100, Health.HEALTHY)])
def test_stuck_needs_both_no_progress_and_lag(lag, idle, health):
    run = _run(last_batch_at=NOW - idle, query_started_at=NOW - idle - 10)
    assert diagnose("j", run, driver_alive=True, lag=lag, now=NOW,
                    thresholds=Thresholds(stuck_after_s=300)).health == health


@pytest.mark.parametrize(("idle", "health"), [(3000, Health.HEALTHY), (3950, Health.STUCK)])
def test_a_job_that_triggers_hourly_is_not_stuck_between_two_triggers(idle, health):
    """Records wait between two triggers of a job whose ``trigger_interval`` is an hour: judged by
    ``stuck_after`` alone it was STUCK each hour, and stopped and restarted though healthy."""
    run = _run(last_batch_at=NOW - idle, query_started_at=NOW - idle - 10, heartbeat_at=NOW - 1,
               spec=json.dumps({"trigger_interval": "1 hour"}))
    found = diagnose("j", run, driver_alive=True, lag=50, now=NOW, thresholds=Thresholds(stuck_after_s=300))
    assert found.health == health, found.evidence
    if health == Health.STUCK:
        assert "threshold 3900s" in found.evidence[0]


def test_failed_carries_kind_error_class_and_advice():
    message = "StreamingQueryException: [STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema ..."
    found = diagnose("j", _run(status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                               error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE", termination_message=message),
                     driver_alive=False, lag=0, now=NOW)
    assert (found.health, found.failure_kind) == (Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE)
    assert found.error_class == "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE" and found.advice
    assert found.to_dict()["failure_kind"] == "CHECKPOINT_INCOMPATIBLE"


def test_starting():
    found = diagnose("j", _run(status="STARTING", query_started_at=None), driver_alive=True, lag=3, now=NOW)
    assert found.health == Health.STARTING


def test_budget_counts_restarts_in_the_window():
    budget = RestartBudget(max_restarts=3, window_s=600)
    assert not budget.exhausted([NOW - 700, NOW - 500, NOW - 100], NOW)
    assert budget.exhausted([NOW - 500, NOW - 300, NOW - 100], NOW)


def test_backoff_doubles_and_resets_after_a_healthy_period():
    budget = RestartBudget(backoff_base_s=5, backoff_max_s=60, healthy_reset_s=300)
    assert budget.backoff([], NOW) == 0
    assert budget.backoff([NOW - 10], NOW) == 5
    assert budget.backoff([NOW - 60, NOW - 10], NOW) == 10
    assert budget.backoff([NOW - 100, NOW - 60, NOW - 10], NOW) == 20
    assert budget.backoff([NOW - 2000, NOW - 1900, NOW - 1800, NOW - 10], NOW) == 5  # healthy in between
    assert budget.backoff([NOW - i * 10 for i in range(1, 12)], NOW) == 60  # capped


@pytest.mark.parametrize("field, value", [
    ("max_restarts", 0), ("max_restarts", 1.5), ("window_s", 0.0), ("window_s", float("inf")),
    ("backoff_base_s", -1.0), ("backoff_max_s", float("nan")),
    # 0 or NaN: no two restarts would be consecutive, and the budget and the backoff would count none
    ("healthy_reset_s", 0.0), ("healthy_reset_s", -600.0), ("healthy_reset_s", float("nan")),
])
def test_budget_rejects_nonsense(field, value):
    with pytest.raises(ValueError, match=f"restart budget: {field}={value!r}"):
        RestartBudget(**{field: value})


def test_a_starting_driver_is_bounded_by_the_start_timeout_not_the_heartbeat():
    """Heartbeats begin once the query runs: session start-up on a busy machine is not a death."""
    starting = _run(status="STARTING", query_started_at=None, started_at=NOW - 40, heartbeat_at=NOW - 40)
    thresholds = Thresholds(heartbeat_timeout_s=15, start_timeout_s=120)
    assert diagnose("j", starting, driver_alive=True, lag=0, now=NOW, thresholds=thresholds).health \
        == Health.STARTING
    assert diagnose("j", starting, driver_alive=None, lag=0, now=NOW, thresholds=thresholds).health \
        == Health.STARTING
    assert diagnose("j", starting, driver_alive=False, lag=0, now=NOW, thresholds=thresholds).health == Health.DEAD
    late = replace(starting, started_at=NOW - 200, heartbeat_at=NOW - 200)
    found = diagnose("j", late, driver_alive=None, lag=0, now=NOW, thresholds=thresholds)
    assert found.health == Health.DEAD and "has not started 200s after its start" in found.evidence[0]
    hung = diagnose("j", late, driver_alive=True, lag=0, now=NOW, thresholds=thresholds)
    assert hung.health == Health.STUCK and "alive but its query has not started 200s" in hung.evidence[0]


def test_only_restarts_that_got_nowhere_make_a_crash_loop():
    """Five kills of a healthy job, each restart committing batches: no budget spent, no backoff."""
    from airflow_stream_provider.budget import crash_loop_restarts

    budget = RestartBudget(max_restarts=3, window_s=1800, backoff_base_s=5, healthy_reset_s=600)
    healthy = [{"at": NOW - 60 * k, "new_run_committed": True} for k in range(1, 6)]
    assert crash_loop_restarts(healthy) == []
    assert not budget.exhausted(crash_loop_restarts(healthy), NOW) and budget.backoff([], NOW) == 0
    looping = [{"at": NOW - 30 * k, "new_run_committed": False} for k in range(1, 4)]
    assert budget.exhausted(crash_loop_restarts(healthy + looping), NOW)
