"""Diagnose a stream job and take the action its health calls for, inside a restart budget."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider import recovery
from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import Diagnosis, Health
from airflow_stream_provider.lifecycle import waits
from airflow_stream_provider.lifecycle.controller import NOT_STARTED, WITHHELD
from airflow_stream_provider.lifecycle.killed import end_killed_upgrade
from airflow_stream_provider.lifecycle.waits import RunWait
from airflow_stream_provider.operators.base import StreamJobOperator
from airflow_stream_provider.recovery import RecoveryAction

ON_INCOMPATIBLE = recovery.ON_INCOMPATIBLE
#: How long a warm standby may take to take a dead run over and start its query before a cold restart
STANDBY_TAKEOVER_S = 60.0
#: How often a recovery that found another task acting on the job looks again
LEASE_RETRY_S = 10.0
#: The method a wait before a fresh diagnosis resumes in (``lease_held``, ``_watch_silent``)
LOOK_AGAIN = "_look_again"
#: Looked at this long after a silent driver would turn STUCK: its diagnosis is then STUCK, not HEALTHY
SILENT_MARGIN_S = 1.0
#: How often a recovery waiting on a silent driver looks again meanwhile (it may die in between, unseen by
#: a triggerer on another host)
SILENT_LOOK_EVERY_S = 30.0


class _LookAgain(Exception):
    """A look-again wait on the blocking path (``deferrable=False``) is over: ``execute`` starts afresh.  A
    lease held for half an hour is 180 looks, too many to nest."""


class RecoverStreamingJobOperator(StreamJobOperator):
    """What on-call would do, written down:

    ========================  =========================================================================
    health / failure kind     action
    ========================  =========================================================================
    STARTING, HEALTHY         nothing
    HEALTHY, its driver       wait (in the triggerer, holding no lease) until the silence would make it
    alive but silent past     STUCK, or the driver ends, then diagnose afresh: a watcher on another host
    its heartbeat timeout     reports such a run DEAD once, and nothing would look again
    STOPPED                   nothing: a clean stop was asked for by someone
    anything, while another   wait (in the triggerer) until that task lets go of the job's lease
    task acts on the job      (``state.leases``), then diagnose afresh
    anything, while an        nothing: the upgrade's task acts on the job (``recovery.UPGRADE_IN_CHARGE``)
    upgrade stops, starts,
    verifies or rolls back
    DEAD, TRANSIENT,          restart from the checkpoint (Spark replays the unfinished batch, the sink
    RESOURCE, UNKNOWN,        skips what was committed), within the restart budget
    USER_CODE, CONCURRENT
    STUCK                     stop (escalating to a kill), then restart from the checkpoint
    CHECKPOINT_INCOMPATIBLE   reset to a new generation from the stored offsets (``on_incompatible``)
    DATA_LOSS, POISON         fail with the evidence: no automatic action can be right
    ========================  =========================================================================

    With ``standby`` in the spec, a dead run's warm standby takes over (the task waits for its query, and
    restarts cold only if it does not come up); every recovery that leaves the job running ends with a warm
    standby again (a new one after a takeover, or in place of one that died).

    Out of budget (``max_restarts`` within ``restart_window``), the task fails and says so.  Restarts
    whose run then committed a batch do not count: the job was healthy in between.

    :param max_restarts: restarts allowed within ``restart_window`` before the task fails.
    :param restart_window: seconds over which restarts are counted.
    :param backoff_base: seconds to wait before the second restart in a row; doubled for each further one.
        The wait is deferred: no worker slot is held.
    :param backoff_max: the longest backoff, in seconds.
    :param healthy_reset: seconds between two restarts after which the backoff starts over.
    :param on_incompatible: ``reset`` (archive the checkpoint, resume from the stored offsets) or ``fail``
        (leave it to a person) when the checkpoint cannot be read by the job's code.
    """

    lease_action = "recover"
    #: looking again diagnoses afresh, however the wait before it ended
    resumed_on_timeout = StreamJobOperator.resumed_on_timeout | {LOOK_AGAIN}

    #: The task resumes on a worker after the restarted run's first batch, not in the middle of it.
    launch_settle_s = 20.0

    template_fields = (*StreamJobOperator.template_fields, "on_incompatible", "max_restarts", "restart_window",
                       "backoff_base")

    def __init__(self, *, max_restarts: int = 3, restart_window: float = 1800.0, backoff_base: float = 5.0,
                 backoff_max: float = 300.0, healthy_reset: float = 600.0, on_incompatible: str = "reset",
                 **kwargs):
        super().__init__(**kwargs)
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.healthy_reset = healthy_reset
        self.on_incompatible = on_incompatible
        if not any(isinstance(v, str) for v in (max_restarts, restart_window, backoff_base)):  # none templated
            _ = self.budget  # a wrong budget fails the DAG's parse, not the first recovery

    @property
    def budget(self) -> RestartBudget:
        try:
            return RestartBudget(int(self.max_restarts), float(self.restart_window), float(self.backoff_base),
                                 float(self.backoff_max), float(self.healthy_reset))
        except (TypeError, ValueError) as err:
            raise AirflowFailException(
                f"{type(self).__name__} {self.task_id}: its restart budget cannot be used ({err}). Set max_restarts "
                f"(>= 1, now {self.max_restarts!r}), restart_window (> 0 s, now {self.restart_window!r}), "
                f"backoff_base (>= 0 s, now {self.backoff_base!r}), backoff_max (>= 0 s, now "
                f"{self.backoff_max!r}) and healthy_reset (> 0 s, now {self.healthy_reset!r})."
            ) from None

    def lease_held(self, context, held) -> Any:
        """Another task acts on the job (a submit, a stop, an upgrade's preflight): a recovery beside it could
        start a second driver, so this one waits, in the triggerer, until that task lets go, then diagnoses
        afresh.  Left to that task instead, a job it leaves down (an upgrade that aborts after its preflight)
        would wait for the next sweep: the watcher reports a condition once."""
        self.log.info("Not recovering yet: %s acts on the job; looking again in %.0fs", held.describe(time.time()),
                      LEASE_RETRY_S)
        return self._look_again_after(context, None, LEASE_RETRY_S)

    def _look_again_after(self, context, wait: RunWait | None, pause_s: float = 0.0) -> Any:
        """Diagnose afresh once ``wait`` ends (or after ``pause_s``), holding no lease meanwhile: a stop or an
        upgrade someone starts in between goes ahead, and this recovery then finds what it left."""
        if self._lease_owner is not None:
            self.controller.release_lease(self._lease_owner)
        if self.deferrable:
            self._defer(context, wait, pause_s, LOOK_AGAIN, {})
        if wait is not None:
            self.controller.block(wait)
        waits.pause(pause_s)
        raise _LookAgain

    def execute(self, context) -> Any:
        while True:  # the blocking path's looks: a loop, not one nested call per look
            try:
                return super().execute(context)
            except _LookAgain:
                continue

    def execute_complete(self, context, event: dict[str, Any]) -> Any:
        if event.get("resume", {}).get("method") == LOOK_AGAIN:  # this task held no lease while it waited
            return self._look_again(context, None)
        return super().execute_complete(context, event)

    def _look_again(self, context, event) -> Any:
        return self.execute(context)

    def start(self, context) -> dict[str, Any]:
        try:
            recovery.check_on_incompatible(self.on_incompatible)
        except ValueError as err:
            raise AirflowFailException(str(err)) from None
        budget = self.budget  # a templated budget is checked here, before anything is looked at or done
        found = self.diagnose()
        self.log.info("Diagnosis: %s", found.summary())
        if (found.interrupted_restart or {}).get("upgrade_id"):
            self._end_abandoned_upgrade(found)
        now = time.time()
        history = self.state.restarts_since(self.job.job_id, recovery.history_since(budget, now))
        decision = recovery.decide_recovery(found, on_incompatible=self.on_incompatible, budget=budget,
                                            history=history, now=now,
                                            upgrade=self.controller.latest_upgrade())
        outcome = {"diagnosis": found.to_dict()}
        if decision.action == RecoveryAction.NONE and found.stuck_at is not None:
            return self._watch_silent(context, found)
        if decision.action == RecoveryAction.NONE:
            if found.health.needs_action:  # left alone on purpose: being stopped, or an upgrade acts on it
                self.log.info("Not recovering: %s", decision.why)
                return {**outcome, "action": "none", "why": decision.why}
            standby = self.controller.ensure_standby(self.application) if found.health != Health.STOPPED else None
            if found.needs_standby and standby and standby["action"] in (WITHHELD, NOT_STARTED):
                raise AirflowFailException(standby["why"])  # this run was for the standby: said loudly, once
            return {**outcome, "action": "none", "standby": standby}
        if decision.action == RecoveryAction.FAIL:
            raise AirflowFailException(decision.why)
        standby = self.controller.live_standby() if found.health == Health.DEAD else None
        if standby is not None:  # it takes over by itself (it may have already): wait for its run to process
            launch = self.controller.standby_launch(standby, self.state.store.get_run(found.run_id),
                                                    self.application)
            if launch is not None:
                self.log.info("Standby %s takes over run %s", standby.standby_id, found.run_id)
                pending = {"launch": launch, "after": "_standby_took_over", "on_fail": "_standby_failed",
                           "carry": {"decision": {"reason": decision.reason, "backoff_s": decision.backoff_s,
                                                  "action": decision.action.value}, "outcome": outcome}}
                wait = self.controller.launch_wait(launch, "ready", STANDBY_TAKEOVER_S,
                                                   settle_s=self.launch_settle_s)
                return self.wait_then(context, wait, "_launch_waited", **pending)
        outcome["backoff_s"] = decision.backoff_s
        if decision.backoff_s:
            self.log.info("Backing off %.0fs before the %s (consecutive restarts)", decision.backoff_s,
                          decision.action.value)
        run_id = decision.restart_run_id or found.run_id
        self._begin_before_backoff(decision.action, decision.reason, run_id, decision.backoff_s)
        return self.pause_then(context, decision.backoff_s, "_act", action=decision.action.value,
                               reason=decision.reason, outcome=outcome, run_id=run_id)

    def _begin_before_backoff(self, action: str, reason: str, run_id: str | None, backoff_s: float) -> None:
        """The restart (of ``run_id``) or reset recorded as begun before a backoff, which may last minutes:
        this task lost in it (a worker lost, killed while deferred) leaves the run owed what it began once
        Airflow says the task has ended (``recovery.interrupted_restart``), as a loss after the wait does; the
        run's one report was spent on this task.  The flow after the wait finds it begun, and its launch
        completes the record."""
        if not backoff_s:
            return
        if action == RecoveryAction.RESET:
            self._reset_begun(reason, self.live_run())
        else:
            self._begin(RecoveryAction.RESTART.value, reason, run_id)

    def _end_abandoned_upgrade(self, found: Diagnosis) -> None:
        """The diagnosis found the job down in an upgrade whose task has ended without finishing it (its
        worker lost, or failed past the stop on its last try): ended here (result ``killed``), so that it
        keeps recoveries away no longer, with the restart of the run it stopped owed."""
        owed = found.interrupted_restart
        upgrade = self.controller.latest_upgrade()
        if upgrade is not None and upgrade.upgrade_id == owed["upgrade_id"]:
            end_killed_upgrade(self.state.store, self.job.job_id, f"its task {upgrade.task} ended in Airflow in "
                               f"phase {upgrade.phase.value} without finishing it", self.log)

    def _watch_silent(self, context, found: Diagnosis) -> Any:
        """Its driver lives but has stopped heartbeating (hung, frozen, a long pause): look again once the
        silence makes it STUCK, or sooner if the driver dies.  A watcher on another host, which cannot see
        the process, reports such a run DEAD once; without this look the job would wait for the sweep.

        The wait ends early when the trigger sees the driver end; a triggerer on another host cannot see
        its process, so the task also looks for itself every ``SILENT_LOOK_EVERY_S``."""
        now = time.time()
        self.log.info("Not recovering yet: %s. Looking again when it would be STUCK, in %.0fs, and every "
                      "%.0fs until then", found.summary(), found.stuck_at - now, SILENT_LOOK_EVERY_S)
        look_at = min(found.stuck_at + SILENT_MARGIN_S, now + SILENT_LOOK_EVERY_S)
        wait = RunWait(run_id=found.run_id, job_id=self.job.job_id, until="ended",
                       deadline=self.controller.clock.to_database(look_at))
        return self._look_again_after(context, wait)

    def _standby_took_over(self, context, launched, decision, outcome) -> dict[str, Any]:
        self.controller.record_restart("standby", decision["reason"], outcome["diagnosis"]["run_id"],
                                       launched["run_id"])
        return self.done(context, {**launched, "action": "standby"}, outcome)

    def _standby_failed(self, context, error, decision, outcome) -> dict[str, Any]:
        self.log.warning("The standby did not take over (%s): restarting from the checkpoint", error)
        run_id = outcome["diagnosis"]["run_id"]
        self._begin_before_backoff(decision["action"], decision["reason"], run_id, decision["backoff_s"])
        return self.pause_then(context, decision["backoff_s"], "_act", action=decision["action"],
                               reason=decision["reason"], outcome=outcome, run_id=run_id)

    def _act(self, context, event, action: str, reason: str, outcome: dict[str, Any],
             run_id: str | None = None) -> dict[str, Any]:
        if action == RecoveryAction.RESET:
            return self.reset_then(context, reason, "done", {"outcome": outcome})
        last = self.state.latest_run(self.job.job_id) if run_id is None else self.state.store.get_run(run_id)
        return self.restart_then(context, reason, last and last.run_id, "done", {"outcome": outcome})

    def done(self, context, result, outcome=None) -> dict[str, Any]:
        return {**(outcome or {}), **result, "standby": self.controller.ensure_standby(self.application)}
