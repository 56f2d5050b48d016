"""The recovery decision table (pure): every row, the restart budget and the backoff."""

from __future__ import annotations

import pytest

from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import Diagnosis, Health
from airflow_stream_provider.failures import FailureKind, Recovery
from airflow_stream_provider.recovery import (
    RecoveryAction,
    check_on_incompatible,
    decide_recovery,
    history_since,
    with_abandoned_upgrade,
    with_interrupted_restart,
)
from airflow_stream_provider.state.upgrades import UpgradePhase, UpgradeRecord

NOW = 1_800_000_000.0
BUDGET = RestartBudget(max_restarts=3, window_s=1800, backoff_base_s=5, backoff_max_s=300, healthy_reset_s=600)


def _found(health: Health, kind: FailureKind | None = None, **overrides) -> Diagnosis:
    values = {"run_id": "r1", "generation": 1, "epoch": 3, "lag": 0, "evidence": ["driver exited with code 1"],
              "advice": "do the thing", "diagnosed_at": NOW, "error_class": None}
    values.update(overrides)
    return Diagnosis("j", health, kind, **values)


def _decide(found: Diagnosis, on_incompatible: str = "reset", history=(), upgrade=None):
    return decide_recovery(found, on_incompatible=on_incompatible, budget=BUDGET, history=list(history), now=NOW,
                           upgrade=upgrade)


def _upgrade(phase: UpgradePhase, age: float = 30.0, detail: dict | None = None) -> UpgradeRecord:
    return UpgradeRecord("u1", "j", "1.0", "2.0", phase, None, detail or {}, NOW - 600, NOW - age)


def _restarts(*ages: float, committed: bool = False) -> list[dict]:
    return [{"at": NOW - age, "action": "restart", "new_run_committed": committed} for age in sorted(ages, reverse=True)]


@pytest.mark.parametrize(
    ("health", "kind", "on_incompatible", "action"),
    [
        (Health.STARTING, None, "reset", RecoveryAction.NONE),
        (Health.HEALTHY, None, "reset", RecoveryAction.NONE),
        (Health.STOPPED, None, "fail", RecoveryAction.NONE),
        (Health.DEAD, None, "reset", RecoveryAction.RESTART),
        (Health.STUCK, None, "fail", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.TRANSIENT, "reset", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.RESOURCE, "reset", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.UNKNOWN, "reset", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.USER_CODE, "reset", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.CONCURRENT, "fail", RecoveryAction.RESTART),
        (Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE, "reset", RecoveryAction.RESET),
        (Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE, "fail", RecoveryAction.FAIL),
        (Health.FAILED, FailureKind.DATA_LOSS, "reset", RecoveryAction.FAIL),
        (Health.FAILED, FailureKind.POISON, "reset", RecoveryAction.FAIL),
    ],
)
def test_decision_table(health, kind, on_incompatible, action):
    decision = _decide(_found(health, kind), on_incompatible)
    assert decision.action == action, decision.why
    assert decision.backoff_s == 0.0


def test_every_failure_kind_is_decided_by_its_recovery():
    """A new kind needs no edit of the rules: its recovery fact decides."""
    expected = {Recovery.RESTART: RecoveryAction.RESTART, Recovery.RESET: RecoveryAction.RESET,
                Recovery.MANUAL: RecoveryAction.FAIL}
    for kind in FailureKind:
        assert _decide(_found(Health.FAILED, kind)).action == expected[kind.recovery], kind


def test_a_restart_passes_the_summary_on_as_its_reason():
    found = _found(Health.DEAD, evidence=["its driver process (pid 4242 on h) is gone"])
    decision = _decide(found)
    assert decision.reason == found.summary() == "job j: DEAD (run r1): its driver process (pid 4242 on h) is gone"


def test_a_stuck_driver_is_stopped_before_the_restart():
    assert "stop the live driver, then restart" in _decide(_found(Health.STUCK)).why


def test_a_reset_names_the_error_class():
    found = _found(Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE,
                   error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE")
    decision = _decide(found, "reset")
    assert decision.reason == "checkpoint incompatible: STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE"


def test_on_incompatible_fail_says_what_to_do_instead():
    found = _found(Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE)
    why = _decide(found, "fail").why
    assert why.startswith(found.summary()) and "on_incompatible='fail': reset the job to a new generation" in why


@pytest.mark.parametrize("kind", [FailureKind.DATA_LOSS, FailureKind.POISON])
def test_data_loss_and_poison_fail_with_the_evidence_and_advice(kind):
    found = _found(Health.FAILED, kind, evidence=["[STREAM_POISON_RECORD] events/0@41: bad"])
    why = _decide(found, history=_restarts(10, 20, 30)).why  # decided before, and whatever, the budget
    assert why == (f"{found.summary()}. do the thing No automatic recovery for {kind.value}: it needs a "
                   f"decision.")


@pytest.mark.parametrize(
    ("health", "kind"),
    [(Health.DEAD, None), (Health.FAILED, FailureKind.USER_CODE), (Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE)],
)
def test_out_of_budget_fails_and_says_so(health, kind):
    found = _found(health, kind)
    decision = _decide(found, history=_restarts(100, 200, 300))
    assert decision.action == RecoveryAction.FAIL
    assert decision.why.startswith("job j is out of its restart budget: 3 restarts in the last 30 min whose run "
                                   "neither committed a batch nor ran 600 s (max 3); the job keeps failing: ")
    assert decision.why.endswith(f"{found.summary()}. Fix the cause (do the thing), then restart it by hand.")


def test_restarts_whose_run_committed_do_not_count():
    history = _restarts(100, 200, 300, committed=True)
    decision = _decide(_found(Health.DEAD), history=history)
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESTART, 0.0), "killed from outside: no backoff"


def test_runs_that_commit_then_fail_by_themselves_back_off_but_are_not_refused():
    """A driver out of memory on each run's second batch commits the first every time: it gets somewhere,
    so the budget never refuses it, but it must not restart at once again and again."""
    failing = [{**row, "new_run_failed": True, "new_run_up_s": 40.0}
               for row in _restarts(100, 200, 300, committed=True)]
    decision = _decide(_found(Health.FAILED, FailureKind.RESOURCE), history=failing)
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESTART, 20.0), decision
    healthy_for_a_while = [{**row, "new_run_up_s": 600.0} for row in failing]
    decision = _decide(_found(Health.FAILED, FailureKind.RESOURCE), history=healthy_for_a_while)
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESTART, 0.0), decision


def test_restarts_outside_the_window_do_not_count():
    history = _restarts(100, 2000, 4000)
    assert _decide(_found(Health.DEAD), history=history).action == RecoveryAction.RESTART


@pytest.mark.parametrize(("ages", "backoff"), [((), 0.0), ((60,), 5.0), ((60, 120), 10.0), ((60, 1000), 5.0)])
def test_backoff_is_returned_not_slept(ages, backoff):
    decision = _decide(_found(Health.FAILED, FailureKind.TRANSIENT), history=_restarts(*ages))
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESTART, backoff)


def test_a_reset_backs_off_too():
    decision = _decide(_found(Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE), history=_restarts(60))
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESET, 5.0)


def test_history_reaches_back_over_the_window_and_the_backoff_chain():
    assert history_since(BUDGET, NOW) == NOW - 6000  # ten healthy-reset periods outlast a 30 min window
    assert history_since(RestartBudget(window_s=86400), NOW) == NOW - 86400


@pytest.mark.parametrize("value", ["rest", "Reset", "", "never"])
def test_misspelt_on_incompatible_is_refused_with_the_choices(value):
    with pytest.raises(ValueError, match="is not one of reset, fail"):
        check_on_incompatible(value)
    with pytest.raises(ValueError, match="is not one of reset, fail"):
        _decide(_found(Health.HEALTHY), value)  # refused even when nothing is to be done


@pytest.mark.parametrize("phase", [UpgradePhase.STOPPING, UpgradePhase.STARTING, UpgradePhase.VERIFYING,
                                   UpgradePhase.ROLLING_BACK])
@pytest.mark.parametrize(("health", "kind"), [(Health.DEAD, None), (Health.FAILED, FailureKind.USER_CODE),
                                              (Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE)])
def test_an_upgrade_acting_on_the_job_is_left_to_its_task(phase, health, kind):
    """The new version failing its start or its verification is the upgrade's to roll back: a restart beside
    it would start a second driver on the same checkpoint (the old version, from the recorded launch)."""
    decision = _decide(_found(health, kind), upgrade=_upgrade(phase), history=_restarts(100, 200, 300))
    assert decision.action == RecoveryAction.NONE
    assert f"upgrade u1 to version 2.0 is in phase {phase.value}: the upgrade's task starts" in decision.why


@pytest.mark.parametrize("upgrade", [_upgrade(UpgradePhase.PREFLIGHT), _upgrade(UpgradePhase.DONE),
                                     _upgrade(UpgradePhase.STARTING, age=1801)])
def test_a_preflight_a_finished_upgrade_or_one_that_lost_its_task_does_not_hold_a_recovery(upgrade):
    """A preflight leaves the old version running: if it dies meanwhile, it is restarted as ever."""
    assert _decide(_found(Health.DEAD), upgrade=upgrade).action == RecoveryAction.RESTART


def test_a_run_that_died_while_it_was_being_stopped_is_not_restarted():
    """A stop that had to kill its driver (or one that died during the stop): DEAD, but a restart would
    start the job someone stopped, or race the restart, reset or upgrade whose stop it was."""
    found = _found(Health.DEAD, stop_requested_at=NOW - 60, evidence=["driver gone during a graceful stop (killed)"])
    decision = _decide(found)
    assert decision.action == RecoveryAction.NONE and "a restart would undo the stop" in decision.why


@pytest.mark.parametrize("kind", [FailureKind.TRANSIENT, FailureKind.USER_CODE, FailureKind.CHECKPOINT_INCOMPATIBLE])
def test_a_run_whose_last_batch_failed_while_it_was_being_stopped_is_not_restarted(kind):
    """A graceful stop whose last batch (or write-behind flush) failed: the driver ends FAILED, not STOPPED.
    Restarted (or reset) for its failure kind, the job someone stopped would start again."""
    found = _found(Health.FAILED, kind, stop_requested_at=NOW - 60)
    decision = _decide(found)
    assert decision.action == RecoveryAction.NONE and "a restart would undo the stop" in decision.why
    assert _decide(_found(Health.FAILED, kind)).action != RecoveryAction.NONE  # not being stopped: acted on


def _begun(run_id: str = "r1", age: float = 30.0, new_run_id: str | None = None) -> dict:
    """A restart recorded before its stop of ``run_id``; ``new_run_id`` once it launched its new run."""
    return {"at": NOW - age, "action": "restart", "reason": "STUCK: no batch for 600s", "failed_run_id": run_id,
            "new_run_id": new_run_id, "new_run_committed": False}


@pytest.mark.parametrize("found", [
    _found(Health.STOPPED),
    _found(Health.DEAD, stop_requested_at=NOW - 60, evidence=["driver gone during a graceful stop (killed)"]),
    _found(Health.FAILED, FailureKind.TRANSIENT, stop_requested_at=NOW - 60),
], ids=["stopped", "dead-while-stopping", "failed-while-stopping"])
def test_a_restart_interrupted_after_its_own_stop_is_finished(found):
    """A STUCK run stopped by its restart, whose launch then failed (brokers unreachable for a moment, the
    worker lost): no one asked the job to stop, so the next recovery starts the run the restart owed."""
    decision = _decide(found, history=[_begun()])
    assert decision.action == RecoveryAction.RESTART, decision
    assert "started no new run" in decision.why and decision.reason == "STUCK: no batch for 600s"
    assert decision.backoff_s > 0, "the interrupted attempt counts as a restart that got nowhere"


@pytest.mark.parametrize("history", [
    [_begun(new_run_id="r2")],  # the restart launched its run: this stop is someone else's
    [_begun(run_id="r0")],  # a restart of another run
    [_begun(), {**_begun(run_id="r1", new_run_id="r3"), "action": "standby"}],  # something came after it
], ids=["launched", "another-run", "not-the-newest"])
def test_a_stop_after_a_restart_that_launched_is_left_alone(history):
    assert _decide(_found(Health.STOPPED), history=history).action == RecoveryAction.NONE


@pytest.mark.parametrize("on_incompatible", ["reset", "fail"])
def test_a_reset_interrupted_after_its_own_stop_is_finished_as_a_reset(on_incompatible):
    """A person's reset stopped the live run, then its launch was refused (the brokers away) or its task was
    lost.  Its archive may be done, so a restart from the checkpoint could not help: the recovery finishes the
    reset, whatever ``on_incompatible`` says of the resets it would choose itself."""
    owed = {**_begun(), "action": "reset", "reason": "manual reset"}
    decision = _decide(_found(Health.STOPPED), on_incompatible, history=[owed])
    assert (decision.action, decision.reason, decision.restart_run_id) == (RecoveryAction.RESET, "manual reset", "r1")
    assert "the reset begun at" in decision.why and "finishing that reset: a new generation" in decision.why
    found = with_interrupted_restart(_found(Health.STOPPED), owed)  # the watcher's, the sensors' and status's note
    assert found.condition == "INTERRUPTED_RESTART" and found.interrupted_restart["action"] == "reset"
    assert found.advice.startswith("A recovery finishes the reset: a new generation from the stored offsets")
    assert _decide(found, on_incompatible).action == RecoveryAction.RESET  # from the note alone, as after a window


@pytest.mark.parametrize(("task", "ended", "owed"), [
    ("stream_health/r/recover/-1", "failed", True),  # lost, or failed on its last try
    ("stream_health/r/recover/-1", "up_for_retry", False),  # its retry finishes it
    ("stream_health/r/recover/-1", "running", False),  # at work: backing off, launching
    (None, "failed", False),  # an older release's record names no task
    ("stream_health/r/recover/-1", None, False),  # Airflow cannot be asked (a command line)
], ids=["ended", "retry-to-come", "at-work", "no-task", "no-airflow"])
@pytest.mark.parametrize(("health", "kind"), [(Health.DEAD, None), (Health.FAILED, FailureKind.TRANSIENT),
                                             (Health.STUCK, None)], ids=["dead", "failed", "stuck"])
def test_a_run_no_stop_ended_is_owed_its_restart_once_the_task_that_began_it_has_ended(health, kind, task, ended,
                                                                                       owed):
    """A dead or failed run's recovery began its restart, then its task was lost (or failed on its last
    try) before it launched: the run's one report was spent on that task.  So is a STUCK run's, whose
    recovery was lost before its stop ended the run (lost in the stop's wait, or killed while deferred
    there): the driver still runs, stuck.  Once Airflow says the task has ended, the run is owed the
    restart, a condition of its own that the watcher reports; before, it is the task's own work."""
    found, begun, asked = _found(health, kind), {**_begun(), "task": task}, []

    def ended_in_airflow(owner):
        asked.append(owner)
        return ended == "failed"

    noted = with_interrupted_restart(found, begun, None if ended is None else ended_in_airflow)
    assert (noted.condition == "INTERRUPTED_RESTART") is owed, noted
    assert asked == ([task] if task and ended else [])
    if owed:
        assert noted.conditions == ("INTERRUPTED_RESTART", found.health.value)
        assert f"its task {task} has ended in Airflow: nobody finishes it" in noted.evidence[-1]
        decision = _decide(noted)
        assert (decision.action, decision.restart_run_id) == (RecoveryAction.RESTART, "r1"), decision
    assert with_interrupted_restart(_found(Health.DEAD, run_id="r2"), begun, lambda owner: True).interrupted_restart \
        is None, "a restart begun for another run owes this one nothing"


def test_a_reset_begun_for_a_failed_run_by_an_ended_task_is_finished_as_a_reset():
    """A person's reset of a run failed on an incompatible checkpoint (nothing to stop), lost after its
    archive: the recovery finishes the reset even where ``on_incompatible`` would fail."""
    begun = {**_begun(), "action": "reset", "reason": "manual reset", "task": "ops/r/reset/-1"}
    found = with_interrupted_restart(_found(Health.FAILED, FailureKind.CHECKPOINT_INCOMPATIBLE), begun,
                                     lambda owner: True)
    decision = _decide(found, "fail")
    assert (decision.action, decision.reason) == (RecoveryAction.RESET, "manual reset"), decision


def test_an_interrupted_restart_is_weighed_against_the_budget():
    history = [*_restarts(600, 300, 120), _begun()]
    assert _decide(_found(Health.STOPPED), history=history).action == RecoveryAction.FAIL


@pytest.mark.parametrize("found", [_found(Health.DEAD), _found(Health.STOPPED)], ids=["its-retry", "owed"])
def test_the_attempt_a_recovery_carries_on_is_counted_once_as_itself(found):
    """Two restarts got nowhere, and a third was begun for this run and launched nothing (its task lost, in
    its backoff or later): the recovery that carries it on (its task's retry, or the next recovery) makes that
    third attempt, within a budget of three.  The budget does not count it as one more before itself; the
    backoff does count it, as a try that was lost."""
    history = [*_restarts(300, 120), _begun(age=60)]
    decision = _decide(found, history=history)
    assert decision.action == RecoveryAction.RESTART, decision
    assert decision.backoff_s == BUDGET.backoff_base_s * 4, decision
    assert _decide(found, history=[*_restarts(400, 300, 120), _begun(age=60)]).action == RecoveryAction.FAIL
    other = [*_restarts(300, 120), _begun(run_id="r0", age=60)]  # begun for another run: one before this one
    assert _decide(_found(Health.DEAD), history=other).action == RecoveryAction.FAIL


def test_a_begun_restart_a_stop_closed_is_not_finished():
    closed = {**_begun(), "cancelled_at": NOW - 10}
    assert _decide(_found(Health.STOPPED), history=[closed]).action == RecoveryAction.NONE


def test_a_restart_owed_older_than_the_history_window_is_finished():
    """The diagnosis finds the job's newest restart however old (``HealthProbe``); the budget's history
    looks back a window only.  A job left down longer than that is still owed its restart."""
    owed = {"at": NOW - history_since(BUDGET, NOW) - 3600, "reason": "STUCK: no batch for 600s"}
    decision = _decide(_found(Health.STOPPED, interrupted_restart=owed))
    assert decision.action == RecoveryAction.RESTART and decision.reason == "STUCK: no batch for 600s", decision


@pytest.mark.parametrize(("health", "ended", "noted"), [
    (Health.STOPPED, True, True), (Health.DEAD, True, True), (Health.FAILED, True, True),
    (Health.STOPPED, False, False), (Health.HEALTHY, True, False), (Health.STARTING, True, False)])
def test_a_job_an_upgrade_stopped_is_owed_a_restart_once_its_task_has_ended(health, ended, noted):
    """The watcher's and the sensors' note (``recovery.with_abandoned_upgrade``): only a job that is
    down, only once Airflow says the upgrade's task has ended.  The recovery waits while the upgrade is in
    charge (the recover task ends it first), then restarts the run the upgrade stopped, whichever is latest."""
    upgrade = _upgrade(UpgradePhase.STOPPING, detail={"task": "stream_upgrade/r/upgrade/-1", "live_run_id": "r0"})
    asked = []
    found = with_abandoned_upgrade(_found(health, stop_requested_at=NOW - 40), upgrade,
                                   lambda owner: asked.append(owner) or ended)
    assert (found.condition == "INTERRUPTED_RESTART") is noted
    assert asked == ([] if health in (Health.HEALTHY, Health.STARTING) else [upgrade.task])
    if noted:
        assert found.interrupted_restart["upgrade_id"] == "u1"
        assert _decide(found, upgrade=upgrade).action == RecoveryAction.NONE, "its upgrade is in charge"
        decision = _decide(found, upgrade=_upgrade(UpgradePhase.DONE))
        assert (decision.action, decision.restart_run_id) == (RecoveryAction.RESTART, "r0"), decision


@pytest.mark.parametrize("detail", [
    {"task": "stream_upgrade/r/upgrade/-1"},  # it stopped nothing: the job was down before it
    {"live_run_id": "r0"},  # an older release's record: no task to ask about
])
def test_an_upgrade_that_stopped_nothing_or_names_no_task_owes_nothing(detail):
    found = with_abandoned_upgrade(_found(Health.STOPPED), _upgrade(UpgradePhase.STOPPING, detail=detail),
                                   lambda owner: True)
    assert found.interrupted_restart is None


def test_a_restart_already_owed_is_not_noted_twice():
    owed = {"at": NOW - 30, "reason": "STUCK"}
    found = with_abandoned_upgrade(_found(Health.STOPPED, interrupted_restart=owed),
                                   _upgrade(UpgradePhase.STOPPING), lambda owner: True)
    assert found.interrupted_restart is owed


def test_a_restart_whose_run_ran_healthy_for_a_while_is_no_part_of_a_crash_loop():
    """A quiet topic's restarted runs commit nothing, however long they run: three kills in half an hour of
    runs up for minutes each refused the fourth restart as a crash loop.  A run that stayed up
    ``healthy_reset`` seconds got somewhere, as one that committed a batch did."""
    quiet = [{**row, "new_run_up_s": 540.0} for row in _restarts(900, 1200, 1500)]
    assert _decide(_found(Health.DEAD, None), history=quiet).action == RecoveryAction.FAIL, "9 minutes: not yet"
    quiet = [{**row, "new_run_up_s": 600.0} for row in quiet]
    decision = _decide(_found(Health.DEAD, None), history=quiet)
    assert (decision.action, decision.backoff_s) == (RecoveryAction.RESTART, 0.0), decision
