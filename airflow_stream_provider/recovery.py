"""What recovering a stream job does, decided from its diagnosis, its failure kind and the restart budget.

Pure: the recover operator diagnoses the job and carries the decision out; this module holds the rules,
so they can be read (and tested) in one place. A failed run's kind says which recovery it calls for
(``FailureKind.recovery`` in ``failures.py``), so a new kind needs no edit here:

=========================  ===============  ==================================================================
health / failure kind      on_incompatible  decision
=========================  ===============  ==================================================================
STARTING, HEALTHY          any              nothing
STOPPED or DEAD by the     any              restart from the checkpoint: the restart was interrupted
stop of a restart that                      after its stop (its launch failed, its task was lost)
started no run after it
STOPPED or DEAD by the     any              reset: finish the reset someone asked for (its launch failed,
stop of a reset that                        its task was lost), whose archive may be done already
started no run after it
DEAD, FAILED or STUCK,     any              finish it, as above (a STUCK run is stopped first): its task was
with a restart or reset                     lost, or failed on its last try, and the run's one report was
begun for it by a task                      spent on that task
that has ended in Airflow
STOPPED                    any              nothing: a clean stop was asked for by someone
DEAD after a stop was      any              nothing: the stop had to kill its driver, or it died during
asked for                                   the stop; a restart would undo the stop
DEAD                       any              restart from the checkpoint (Spark replays the unfinished batch,
                                            the sink skips what was committed)
STUCK                      any              stop the live driver (escalating to a kill), then restart from
                                            the checkpoint
kind's recovery RESTART:   any              restart from the checkpoint
TRANSIENT, RESOURCE,
UNKNOWN, USER_CODE,
CONCURRENT
kind's recovery RESET:     reset            reset: archive the generation, a new one from the stored offsets
CHECKPOINT_INCOMPATIBLE    fail             fail: a person resets when ready
kind's recovery MANUAL:    any              fail with the evidence: no automatic action can be right
DATA_LOSS, POISON
=========================  ===============  ==================================================================

While an upgrade stops, starts, verifies or rolls back the job (``UPGRADE_IN_CHARGE``), a recovery does
nothing: the upgrade's own task acts on the job, and a recovery beside it would start a second driver on the
same checkpoint.  An upgrade whose record has not moved for ``UPGRADE_STALE_S`` (``state.upgrades``) lost
its task; recoveries act again.

A restart or a reset is first weighed against the restart budget (``budget.py``): out of budget
(``max_restarts`` restarts within the window whose run never committed a batch), the recovery fails and
says so; otherwise it waits the crash-loop backoff first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from airflow_stream_provider.budget import RestartBudget, backoff_restarts, crash_loop_restarts
from airflow_stream_provider.diagnosis import Diagnosis, Health, clock
from airflow_stream_provider.failures import Recovery
from airflow_stream_provider.state.upgrades import UpgradePhase, UpgradeRecord

ON_INCOMPATIBLE = ("reset", "fail")
#: The phases in which an upgrade's task stops, starts, verifies or rolls back the job itself.
UPGRADE_IN_CHARGE = (UpgradePhase.STOPPING, UpgradePhase.STARTING, UpgradePhase.VERIFYING,
                     UpgradePhase.ROLLING_BACK)


class RecoveryAction(StrEnum):
    #: the job needs nothing (starting, healthy, or stopped on purpose)
    NONE = "none"
    #: a new run on the current generation; a live (STUCK) driver is stopped first
    RESTART = "restart"
    #: archive the current generation, start the next one from the offsets stored with the results
    RESET = "reset"
    #: no automatic action: the task fails with ``why``
    FAIL = "fail"


@dataclass(frozen=True)
class RecoveryDecision:
    action: RecoveryAction
    #: for FAIL, the message to fail with; otherwise what the decision rests on, for the log
    why: str
    #: for RESTART and RESET: the reason recorded with the restart (and the archived generation)
    reason: str = ""
    #: seconds to wait before a RESTART or RESET: consecutive restarts back off
    backoff_s: float = 0.0
    #: for a RESTART that finishes an interrupted one: the run it restarts (the job's latest otherwise).  An
    #: upgrade's task that ended after its stop owes the run it stopped, not the new version's
    restart_run_id: str | None = None


def check_on_incompatible(value: str) -> str:
    if value not in ON_INCOMPATIBLE:
        raise ValueError(f"on_incompatible={value!r} is not one of {', '.join(ON_INCOMPATIBLE)}: 'reset' starts "
                         "a new generation from the stored offsets when the checkpoint is incompatible, "
                         "'fail' fails the task for a person to decide")
    return value


def history_since(budget: RestartBudget, now: float) -> float:
    """How far back the restart history matters (the ``since`` of ``StreamStateHook.restarts_since``):
    the budget's window, and enough consecutive restarts for the backoff to reach its ceiling."""
    return now - max(budget.window_s, budget.healthy_reset_s * 10)


def upgrade_in_charge(upgrade: UpgradeRecord | None, now: float) -> bool:
    """Whether ``upgrade`` (the job's latest) is acting on the job now: see ``UPGRADE_IN_CHARGE``."""
    return upgrade is not None and upgrade.phase in UPGRADE_IN_CHARGE and not upgrade.stale(now)


#: The healths of a run that a restart can have stopped and left down (DEAD: its stop had to kill it;
#: FAILED: its last batch failed as it stopped).
INTERRUPTIBLE = (Health.STOPPED, Health.DEAD, Health.FAILED)
#: The healths of a run a begun restart can be owed to: those, and a STUCK run whose restart's task ended
#: before its stop ended the run (lost in its stop's wait, or killed while deferred there).
MAY_BE_OWED = (*INTERRUPTIBLE, Health.STUCK)


#: What a restart record begun before its stop may owe the job: a restart, or a reset someone asked for.
OWED_ACTIONS = (RecoveryAction.RESTART, RecoveryAction.RESET)
#: How a recovery finishes each of them.
_FINISHES = {RecoveryAction.RESTART: "restart from the checkpoint",
             RecoveryAction.RESET: "reset: a new generation from the stored offsets"}


def begun(row: Mapping[str, Any] | None) -> bool:
    """``row`` (a restart record) was begun before its stop and launched nothing yet, and no stop asked for
    since closed it (``StopStreamingJobOperator`` does)."""
    return (row is not None and row.get("action") in OWED_ACTIONS and row.get("new_run_id") is None
            and row.get("cancelled_at") is None)


def begun_for(row: Mapping[str, Any] | None, action: str, run_id: str | None) -> bool:
    """``row`` is ``action`` of ``run_id``, begun and not launched yet (``begun``)."""
    return begun(row) and (row["action"], row.get("failed_run_id")) == (action, run_id)


def may_owe_for_an_upgrade(found: Diagnosis) -> bool:
    """``found`` is down as an upgrade's stop leaves a run, and owed nothing yet: the one diagnosis an upgrade
    whose task ended can add an owed restart to (``with_abandoned_upgrade``), and so the one worth reading the
    upgrades for."""
    return found.health in INTERRUPTIBLE and not found.restart_owed


def interrupted_restart(found: Diagnosis, history: Sequence[Mapping[str, Any]],
                        ended: Callable[[str], bool] | None = None) -> Mapping[str, Any] | None:
    """The restart or reset begun for ``found``'s run that started none after it (its launch failed, its
    task was lost): the newest record begun for that run (``begun``), when nothing came after it.

    A run its stop ended (STOPPED, or down after a stop was asked for) is owed it at once: nobody else asked
    for that stop.  A run plainly down (dead, failed) or still STUCK (its restart's stop had not ended it) is
    owed it only once ``ended`` (Airflow's answer) says the task that began it has ended: until then that
    task is at work on it (backing off, stopping, launching) or has a retry to come, and the run's own report
    already brought it."""
    if found.run_id is None or found.health not in MAY_BE_OWED or not history:
        return None
    newest = history[-1]
    if not begun(newest) or newest.get("failed_run_id") != found.run_id:
        return None
    if not _ended_by_stop(found):
        task = newest.get("task")
        return newest if task and ended is not None and ended(task) else None
    return newest


def _ended_by_stop(found: Diagnosis) -> bool:
    """A stop ended the run: STOPPED, or dead or failed after a stop was asked for.  Not a run that went down
    by itself, nor a STUCK one, which is still running (a STUCK diagnosis carries no stop, whatever its run's
    row holds: ``diagnosis.diagnose``)."""
    return found.health == Health.STOPPED or found.stop_requested_at is not None


def with_abandoned_upgrade(found: Diagnosis, upgrade: UpgradeRecord | None,
                           ended: Callable[[str], bool]) -> Diagnosis:
    """``found`` with the restart it is owed noted (``Diagnosis.interrupted_restart``), where the job is down
    because an upgrade stopped its run and the upgrade's task ended without finishing or undoing that: its
    worker lost, killed while deferred where no trigger undid it, or failed past the stop on its last try.
    ``upgrade``: the job's latest upgrade in a phase that leaves it down (``UpgradeLog.leaving_down``);
    ``ended``: whether Airflow says a task instance has ended (a retry to come is not).  The recovery ends
    the upgrade and restarts the run it stopped, with the code that ran before."""
    if upgrade is None or not may_owe_for_an_upgrade(found):
        return found
    if not upgrade.detail.get("live_run_id") or not upgrade.task:  # it stopped nothing; or an older release's
        return found
    if not ended(upgrade.task):  # at work (or Airflow cannot say): its own task finishes or undoes it
        return found
    found.interrupted_restart = {"at": upgrade.updated_at, "upgrade_id": upgrade.upgrade_id,
                                 "failed_run_id": upgrade.detail["live_run_id"],
                                 "reason": f"upgrade {upgrade.upgrade_id} to version {upgrade.to_version} left in "
                                           f"phase {upgrade.phase.value}"}
    found.evidence.append(f"upgrade {upgrade.upgrade_id} to version {upgrade.to_version} has been in phase "
                          f"{upgrade.phase.value} since {clock(upgrade.updated_at)}, and its task "
                          f"{upgrade.task} has ended in Airflow without finishing it: nobody brings the job back")
    found.advice = ("A recovery ends the upgrade and restarts the version that ran before from the checkpoint "
                    "(stream_health does so by itself).")
    return found


def with_interrupted_restart(found: Diagnosis, last_restart: Mapping[str, Any] | None,
                             ended: Callable[[str], bool] | None = None) -> Diagnosis:
    """``found`` with the restart it is owed noted (``Diagnosis.interrupted_restart``), where the job's newest
    restart (``last_restart``) was begun for its run and launched nothing after (``interrupted_restart``;
    ``ended``: whether Airflow says a task instance has ended, None where Airflow cannot be asked)."""
    owed = interrupted_restart(found, [last_restart] if last_restart else [], ended)
    if owed is None:
        return found
    action = str(owed.get("action") or RecoveryAction.RESTART)  # kept as text: the diagnosis goes to XCom
    found.interrupted_restart = {"at": owed["at"], "reason": owed.get("reason"), "action": action,
                                 "failed_run_id": owed.get("failed_run_id")}
    if _ended_by_stop(found):
        found.evidence.append(f"the {action} begun at {clock(owed['at'])} ({owed.get('reason')}) stopped "
                              "this run and started no new one: nobody asked for this stop")
    else:
        found.evidence.append(f"the {action} of this run begun at {clock(owed['at'])} ({owed.get('reason')}) "
                              f"started no new run, and its task {owed['task']} has ended in Airflow: "
                              "nobody finishes it")
    found.advice = f"A recovery finishes the {_FINISHES[action]} (stream_health does so by itself)."
    return found


def decide_recovery(found: Diagnosis, *, on_incompatible: str, budget: RestartBudget,
                    history: Sequence[Mapping[str, Any]], now: float,
                    upgrade: UpgradeRecord | None = None) -> RecoveryDecision:
    """The recovery ``found`` calls for; ``history`` is the job's restarts since ``history_since``,
    ``upgrade`` the job's latest upgrade."""
    check_on_incompatible(on_incompatible)
    # the history looks back a window only; the diagnosis found the newest restart however old
    interrupted = interrupted_restart(found, history) or found.interrupted_restart
    if interrupted is not None and not upgrade_in_charge(upgrade, now):
        # a reset someone asked for is finished whatever ``on_incompatible`` says: its archive may be done
        action = RecoveryAction(interrupted.get("action") or RecoveryAction.RESTART)
        decision = _within_budget(found, budget, history, now, action,
                                  f"{found.summary()}: the {action} begun at {clock(interrupted['at'])} for it "
                                  f"started no new run; finishing that {_FINISHES[action]}",
                                  interrupted.get("reason") or found.summary(), interrupted.get("failed_run_id"))
        return replace(decision, restart_run_id=interrupted.get("failed_run_id"))
    if found.health in (Health.STARTING, Health.HEALTHY, Health.STOPPED):
        return RecoveryDecision(RecoveryAction.NONE, f"the job is {found.health.value}: nothing to do")
    if found.health in (Health.DEAD, Health.FAILED) and found.stop_requested_at is not None:
        return RecoveryDecision(RecoveryAction.NONE, f"{found.summary()}: it was being stopped, and a restart "
                                                     "would undo the stop. Submit the job to start it again")
    if upgrade_in_charge(upgrade, now):
        return RecoveryDecision(
            RecoveryAction.NONE,
            f"the job is {found.health.value}, and upgrade {upgrade.upgrade_id} to version {upgrade.to_version} "
            f"is in phase {upgrade.phase.value}: the upgrade's task starts, verifies or rolls back the job "
            "itself (a recovery beside it would start a second driver on the same checkpoint)")
    kind = found.failure_kind
    recovery = kind.recovery if kind else Recovery.RESTART  # DEAD and STUCK have no kind: restart
    if recovery == Recovery.MANUAL:
        return RecoveryDecision(RecoveryAction.FAIL, f"{found.summary()}. {found.advice} No automatic recovery "
                                                     f"for {kind.value}: it needs a decision.")
    if recovery == Recovery.RESET:
        if on_incompatible == "fail":
            return RecoveryDecision(RecoveryAction.FAIL, f"{found.summary()}. on_incompatible='fail': reset the "
                                                         "job to a new generation from its stored offsets when "
                                                         "ready.")
        # "CHECKPOINT_INCOMPATIBLE" -> "checkpoint incompatible: <Spark's error class>"
        action, reason = RecoveryAction.RESET, f"{kind.value.replace('_', ' ').lower()}: {found.error_class}"
        why = f"{kind.value}: reset to a new generation from the stored offsets"
    else:
        action, reason = RecoveryAction.RESTART, found.summary()
        stop = "stop the live driver, then " if found.health == Health.STUCK else ""
        why = f"{kind.value if kind else found.health.value}: {stop}restart from the checkpoint"
    return _within_budget(found, budget, history, now, action, why, reason, found.run_id)


def _within_budget(found: Diagnosis, budget: RestartBudget, history: Sequence[Mapping[str, Any]], now: float,
                   action: RecoveryAction, why: str, reason: str, run_id: str | None) -> RecoveryDecision:
    """``action`` of ``run_id``, backed off by the restarts before it, unless those used up the budget.

    The newest record, where it is that action begun for ``run_id`` and not launched, is the attempt this
    decision carries on (its task lost, or this is its retry): the budget counts it once, as itself, not as
    one more before it.  The backoff counts it: a try that was lost spaces the next."""
    carried = bool(history) and begun_for(history[-1], action, run_id)
    earlier = crash_loop_restarts(history[:-1] if carried else history, budget.healthy_reset_s)
    if budget.exhausted(earlier, now):
        used = budget.used(earlier, now)
        return RecoveryDecision(
            RecoveryAction.FAIL,
            f"job {found.job_id} is out of its restart budget: {len(used)} restarts in the last "
            f"{budget.window_s / 60:.0f} min whose run neither committed a batch nor ran {budget.healthy_reset_s:.0f} s "
            f"(max {budget.max_restarts}); "
            f"the job keeps failing: {found.summary()}. Fix the cause ({found.advice or 'see the driver log'}), "
            f"then restart it by hand.")
    return RecoveryDecision(action, why, reason=reason,
                            backoff_s=budget.backoff(backoff_restarts(history, budget.healthy_reset_s), now))

