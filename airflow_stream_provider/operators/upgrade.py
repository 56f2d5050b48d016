"""Upgrade a running stream job to new code: preflight, stop, start (or reset), verify, roll back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import cached_property
from typing import Any, Literal

from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_stream_provider import faults, kafka_offsets, upgrade
from airflow_stream_provider import spec as spec_module
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.lifecycle.controller import StreamJobError
from airflow_stream_provider.lifecycle.driver_log import log_tail
from airflow_stream_provider.lifecycle.killed import KilledTask, end_killed_upgrade, end_unreleased_successor
from airflow_stream_provider.lifecycle.waits import RunWait
from airflow_stream_provider.operators.base import (
    LAUNCH_KEY,
    StreamJobOperator,
    _set_task_state,
    _task_ended,
    _task_state,
    flag,
)
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from airflow_stream_provider.upgrade import Action, Preflight, Verdict

#: How a preflight's dry run ended: by itself, stopped as idle (caught up, nothing to run a batch on), or
#: stopped at the timeout, or killed at the timeout before it registered.
DryRunEnd = Literal["ended", "idle", "timeout", "unregistered"]
#: How long a preflight waits for a live run to commit its second batch (it needs one to re-run).
STATE_HISTORY_WAIT_S = 60.0
#: The task-state key of this task's upgrade: a retry resumes it (or rolls it back) instead of starting over.
UPGRADE_KEY = "stream_upgrade"


class UpgradeStreamingJobOperator(StreamJobOperator):
    """Move a stream job to a new version (``application`` + ``version``) with exactly-once results.

    1. *Preflight*, while the old run keeps running: copy the current checkpoint generation, drop its
       newest commit so Spark must run that batch again, and run the new code on the copy as a dry run
       (one batch, nothing written). The verdict is compatible / incompatible (Spark's error class) /
       failed / inconclusive.
    2. Decide with ``reset_policy`` (see :mod:`airflow_stream_provider.upgrade`): reuse the checkpoint,
       reset to a new generation from the stored offsets (checked against Kafka *before* the stop), or
       abort with what a reset would do. A failed preflight aborts: the old run is never stopped.
    3. Graceful stop of the old run, then start the new version.
    4. Verify: the new run must commit a batch (or be caught up) within ``verify_timeout``.
    5. Otherwise roll back to what ran before (the application and spec recorded with its run, or
       ``previous_application``): on the untouched old generation when it was kept, from the stored
       offsets when it was archived, and fail the task saying what happened.

    :param version: the new version label (defaults to the spec's ``version``).
    :param reset_policy: ``auto`` | ``after_preflight`` | ``never``.
    :param previous_application: the job file to roll back to, when the old run was not launched by this
        provider (otherwise it is read from the old run's record).
    :param preflight_timeout: seconds the dry run of the new code on a copy of the checkpoint may take.
    :param verify_timeout: seconds the new run has to commit a batch or be caught up (default:
        ``ready_timeout``).
    :param allow_data_loss: as for the reset: accept stored offsets Kafka no longer holds.
    :param keep_preflight_copy: keep the dry run's checkpoint copy for inspection.
    :param prewarm: start the new version's driver at once, beside the old run and the preflight, as a
        warm *successor* (JVM, session, Python workers and the new code planned on a throw-away query); once
        the old run has stopped, the successor starts its query at once, on the same generation or on n+1
        from the stored offsets, instead of a cold driver starting then.  Costs a third driver's memory
        during the preflight; needs local or client deploy mode.  A successor that is gone by then is
        replaced by a cold start.
    """

    lease_action = "upgrade"
    seconds_fields = (*StreamJobOperator.seconds_fields, "preflight_timeout", "verify_timeout")

    template_fields = (*StreamJobOperator.template_fields, "version", "reset_policy", "previous_application",
                       "preflight_timeout", "verify_timeout", "prewarm", "allow_data_loss")
    ui_color = "#fdf2e0"

    def __init__(self, *, version: str | None = None, reset_policy: str = "after_preflight",
                 previous_application: str | None = None, preflight_timeout: float = 300.0,
                 verify_timeout: float | None = None, allow_data_loss: bool = False,
                 keep_preflight_copy: bool = False, prewarm: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.prewarm = prewarm
        self.version = version
        self.reset_policy = reset_policy
        self.previous_application = previous_application
        self.preflight_timeout = preflight_timeout
        self.verify_timeout = verify_timeout
        self.allow_data_loss = allow_data_loss
        self.keep_preflight_copy = keep_preflight_copy

    @property
    def new_spec(self) -> StreamJobSpec:
        return replace(self.job, version=str(self.version)) if self.version else self.job

    @cached_property
    def upgrades(self) -> UpgradeLog:
        return UpgradeLog(self.state.store)

    # -- a prewarmed successor never outlives the upgrade's failure ---------------------------------------
    # (inside the job's lease: a refused lease is another task's upgrade, and its successor is not ours)
    def _execute(self, context) -> Any:
        with self._successor_ended_on_failure():
            return super()._execute(context)

    def _resumed(self, context, event: dict[str, Any]) -> Any:
        with self._successor_ended_on_failure():
            return super()._resumed(context, event)

    @contextmanager
    def _successor_ended_on_failure(self) -> Iterator[None]:
        """A successor waits for its release without end: an upgrade failing before it releases it (stored
        offsets Kafka lost, found at the decision; a preflight whose wait fails; a reset that cannot archive)
        ends it, or it would hold a third driver's resources until someone stopped the job.  A retry then
        starts the new version cold.  The upgrade's record holds the successor until its release."""
        try:
            yield
        except TaskDeferred:
            raise
        except BaseException:
            self._end_unreleased_successor("the upgrade failed before releasing it")
            raise

    def on_kill(self) -> None:
        """Also end the successor the upgrade has not released, and the upgrade's record (a job it left down
        is restarted with the old code by the next recovery).  A task killed while deferred does not come
        here: its trigger does it (``lifecycle.killed``), and where Airflow does not tell the trigger, the
        successor ends by itself once the upgrade's record goes stale (``runtime.standby``)."""
        super().on_kill()
        self._end_unreleased_successor("its upgrade task was killed")
        end_killed_upgrade(self.state.store, self.new_spec.job_id, "its upgrade task was killed", self.log)

    def killed_task(self) -> KilledTask:
        return replace(super().killed_task(), upgrade=True)

    def _end_unreleased_successor(self, why: str) -> None:
        ended = end_unreleased_successor(self.state.store, self.new_spec.job_id, why)
        if ended:
            self.log.info("Asked successor %s of job %s to end: %s", ended, self.new_spec.job_id, why)

    def _phase(self, ctx: dict[str, Any], phase: UpgradePhase, result: str | None = None) -> None:
        ctx["phase"] = phase.value
        self.upgrades.move(ctx["upgrade_id"], phase, ctx, result)

    @property
    def accepts_data_loss(self) -> bool:
        """``allow_data_loss`` as a flag: templated, "False" must not read as yes (invariant 5)."""
        return flag(self.allow_data_loss, "allow_data_loss")

    def start(self, context) -> dict[str, Any]:
        try:
            policy = upgrade.check_policy(self.reset_policy)
        except ValueError as err:
            raise AirflowFailException(str(err)) from None
        _ = self.accepts_data_loss  # bad input fails before anything is done, not after the old run's stop
        unfinished = self._unfinished(context)
        if unfinished is not None:
            return self._resume(context, unfinished)
        # Another upgrade between two of its tries holds no lease, and its retry would roll this one back;
        # one whose task has ended for good is ended here (owing the job the restart it left), as a recovery
        # ends it, rather than keep every upgrade away until it goes stale.
        self._end_abandoned_upgrade(context)
        self.refuse_during_upgrade("new upgrade")
        new = self.new_spec
        job_id = new.job_id
        before = self.state.latest_run(job_id)
        previous = self.controller.recorded_launch(before, self.previous_application)
        generation = self.state.current_generation(job_id)
        live = self.live_run()
        self.log.info("Upgrading job %s from %s to %s (generation %s, %s)", job_id, before and before.version,
                      new.version, generation, f"run {live.run_id} live" if live else "no live run")
        ctx: dict[str, Any] = {
            # the task: where it ends without finishing, the watcher asks Airflow about it (``UpgradeRecord.task``)
            "task": self._lease_owner,
            "policy": policy, "generation": generation, "live_run_id": live and live.run_id,
            "previous": previous and {"application": previous[0], "spec_json": previous[1].to_json()},
            "outcome": {"job_id": job_id, "from_version": before and before.version, "to_version": new.version,
                        "generation_before": generation}}
        if flag(self.prewarm, "prewarm") and live is not None:
            if not self.application:
                raise AirflowFailException(f"{self.task_id}: 'application' (the job file to submit) is required")
            ctx["successor"] = self.controller.start_successor(self.application, new.with_generation(generation))
        ctx["upgrade_id"] = self.upgrades.begin(job_id, before and before.version, new.version, ctx)
        _set_task_state(context, UPGRADE_KEY, ctx["upgrade_id"])
        return self._preflight(context, ctx)

    def _end_abandoned_upgrade(self, context) -> None:
        found = self.controller.latest_upgrade()
        if (found is None or found.phase == UpgradePhase.DONE or not found.task
                or not _task_ended(context, found.task, self.log)):
            return
        end_killed_upgrade(self.state.store, found.job_id, f"its task {found.task} has ended in Airflow "
                           "without finishing it", self.log)

    # -- a retry of a killed upgrade task ----------------------------------------------------------------
    def _unfinished(self, context):
        upgrade_id = _task_state(context, UPGRADE_KEY)
        found = self.upgrades.get(upgrade_id) if upgrade_id else None
        if found is not None and found.result == "stopped":  # a person's stop ended it between two tries
            _set_task_state(context, UPGRADE_KEY, None)
            raise AirflowFailException(
                f"upgrade {found.upgrade_id} of job {found.job_id} to version {found.to_version} was ended in phase "
                f"{found.detail['stopped_in']}: {found.detail['stopped']}. This retry does nothing; trigger the "
                "upgrade again to upgrade the job")
        return found if found is not None and found.phase != UpgradePhase.DONE else None

    def _resume(self, context, found) -> dict[str, Any]:
        """Pick up an upgrade an earlier try of this task left in ``found.phase``: a preflight starts over
        (its dry run is ended first); past the stop, a new version that runs is verified, anything else
        rolls back to what ran before."""
        ctx = found.detail
        latest = self.upgrades.latest(found.job_id)
        if latest is not None and latest.upgrade_id != found.upgrade_id:  # left stale, then another began
            _set_task_state(context, UPGRADE_KEY, None)
            self.upgrades.move(found.upgrade_id, UpgradePhase.DONE, {**ctx, "superseded_by": latest.upgrade_id},
                               result="superseded")
            raise AirflowFailException(
                f"upgrade {found.upgrade_id} of job {found.job_id} to version {found.to_version}, left in phase "
                f"{found.phase.value}, was superseded by upgrade {latest.upgrade_id} to version "
                f"{latest.to_version}. This retry does nothing; trigger the upgrade again to upgrade the job")
        self.log.warning("Resuming upgrade %s of job %s, left in phase %s by an earlier try", found.upgrade_id,
                         found.job_id, found.phase.value)
        if found.phase == UpgradePhase.PREFLIGHT:
            dry = ctx.get("preflight") or {}
            if dry.get("run_id"):
                self.controller.abandon(dry, "its upgrade task was retried")
            if dry.get("root") and not self.keep_preflight_copy:
                self.checkpoints_remove(dry["root"])
            ctx.pop("preflight", None)
            return self._preflight(context, ctx)
        live = self.live_run()
        # The new version runs: not the old run, which bears the same version in an upgrade that keeps it
        # (the job file changed, not the label) and may still be finishing the stop.
        new_version_runs = (live is not None and live.version == found.to_version
                            and live.run_id != ctx.get("live_run_id"))
        if found.phase != UpgradePhase.ROLLING_BACK and new_version_runs:
            ctx["started"] = ctx.get("started") or {"run_id": live.run_id, "log_path": live.log_path}
            return self._verify(context, ctx)
        return self._failed_after_stop(context, StreamJobError(
            f"the upgrade task was interrupted in phase {found.phase.value}"), ctx)

    def checkpoints_remove(self, root: str) -> None:
        self.controller.checkpoints.remove_preflight(self.job.job_id, root)

    # -- preflight -------------------------------------------------------------------------------------
    def _preflight(self, context, ctx: dict[str, Any]) -> dict[str, Any]:
        """Run the new code as a dry run on a copy of the current generation's checkpoint."""
        job_id, generation = self.job.job_id, ctx["generation"]
        checkpoints = self.controller.checkpoints
        active = {g.generation for g in checkpoints.list_generations(job_id) if not g.archived}
        path = checkpoints.generation_path(job_id, generation)
        if generation not in active or not checkpoints.has_checkpoint(path):
            return self._decide(context, ctx, Preflight(Verdict.SKIPPED,
                                                        f"generation {generation} has no checkpoint yet"))
        ctx["preflight_began"] = time.time()
        live = self.live_run()
        if (checkpoints.latest_committed(path) or 0) < 1 and live is not None and not self.controller.caught_up():
            # A stateful change shows only in a batch that reads state the old code wrote: give a live run
            # that committed only its first batch a moment to commit a second one.
            wait = RunWait.within(min(float(self.preflight_timeout), STATE_HISTORY_WAIT_S), self.controller.clock.now(),
                                  run_id=live.run_id, job_id=job_id, until="batch", min_batch_id=1, idle=True)
            return self.wait_then(context, wait, "_history_waited", ctx=ctx)
        return self._dry_run(context, ctx)

    def _history_waited(self, context, event, ctx) -> dict[str, Any]:
        if self.outcome(event) == "timeout":
            self.log.warning("The live run committed no second batch within %.0fs: the preflight may be "
                             "inconclusive for stateful changes", STATE_HISTORY_WAIT_S)
        return self._dry_run(context, ctx)

    def _dry_run(self, context, ctx) -> dict[str, Any]:
        new, generation, job_id = self.new_spec, ctx["generation"], self.job.job_id
        checkpoints = self.controller.checkpoints
        root = checkpoints.new_preflight_root(job_id)
        copy = spec_module.generation_path(f"{root}/{job_id}", generation)
        checkpoints.copy_generation(job_id, generation, copy)
        # Re-run the newest committed batch when an older one stays committed; with only batch 0 committed,
        # keep it, and batch 1 (on new data) is that batch.  Only batch 0 and no record for a batch 1:
        # re-run batch 0 for a verdict now (it shows a changed source or plan, not yet state) rather than
        # wait out the timeout for data that is not coming.  With nothing committed no batch can show it.
        committed = checkpoints.latest_committed(copy)
        replay = committed is not None and (committed > 0 or self.controller.caught_up())
        replayed = checkpoints.drop_latest_commit(copy) if replay else None
        dry = replace(new.with_generation(generation), checkpoint_root=root, dry_run=True)
        launch = self.controller.submit_dry_run(self.application, dry)
        self._in_flight = launch
        ctx["preflight"] = {"root": root, **{k: launch[k] for k in ("job_id", "run_id", "pid", "host", "submitted_at",
                                                                      "log_path", "submission_id")},
                            "reads_old_state": None if committed is None else max(committed, 1)}
        self.upgrades.move(ctx["upgrade_id"], UpgradePhase.PREFLIGHT, ctx)
        self.log.info("Preflight of version %s on a copy of generation %s (%s; batch %s replayed): run %s",
                      new.version, generation, copy, replayed, launch["run_id"])
        # No batch left to re-run: the dry run's batch waits for new records; on a caught-up stream it is
        # stopped as soon as that is clear.
        wait = self.controller.launch_wait(launch, "ended", float(self.preflight_timeout), idle=replayed is None)
        return self.wait_then(context, wait, "_dry_run_waited", ctx=ctx)

    def _dry_run_waited(self, context, event, ctx) -> dict[str, Any]:
        ending = self.outcome(event)
        dry = ctx["preflight"]
        run = self.controller.get_run(dry["run_id"])
        if run is None and ending == "timeout":  # its driver may still come up, on a copy about to be removed
            self.controller.abandon(dry, f"its run did not register within the preflight's {self.preflight_timeout}s")
            return self._preflight_over(context, None, ctx, "unregistered")  # whatever registers meanwhile
        if ending == "ended" or run is None or not run.active:
            # a run that recorded its end is judged by it, though the wait timed out while its driver exited:
            # "timeout" would read a refused checkpoint as inconclusive, and the upgrade would go on
            ended = ending == "idle" or (run is not None and not run.active)
            return self._preflight_over(context, None, ctx, "ended" if ended else ending)
        if ending == "idle":
            self.log.info("Preflight run %s: the stream is caught up, no record for a batch to run on: "
                          "stopping it", dry["run_id"])
        else:
            self.log.warning("Preflight run %s ran no batch within %ss: stopping it", dry["run_id"],
                             self.preflight_timeout)
        return self.stop_then(context, dry["run_id"], "_preflight_over", {"ctx": ctx, "ending": ending})

    def _preflight_over(self, context, stopped, ctx, ending: DryRunEnd) -> dict[str, Any]:
        self._in_flight = None
        dry = ctx["preflight"]
        run = self.controller.get_run(dry["run_id"])
        verdict = _verdict(run, ending, dry["log_path"], dry["reads_old_state"])
        preflight = replace(verdict, run_id=dry["run_id"], log_path=dry["log_path"],
                            seconds=round(time.time() - ctx["preflight_began"], 1))
        if not self.keep_preflight_copy:
            self.checkpoints_remove(dry["root"])
        return self._decide(context, ctx, preflight)

    # -- decide, stop, start -----------------------------------------------------------------------------
    def _decide(self, context, ctx, preflight: Preflight) -> dict[str, Any]:
        decision = upgrade.decide(preflight, ctx["policy"])
        self.log.info("Preflight: %s (%s). Decision: %s, because %s", preflight.verdict.value,
                      preflight.detail, decision.action.value, decision.why)
        ctx["outcome"].update(preflight=preflight.to_dict(), decision=decision.action.value)
        ctx["decision"] = {"action": decision.action.value, "why": decision.why,
                           "reset_on_start_failure": decision.reset_on_start_failure}
        if decision.action == Action.ABORT:
            self.controller.end_successor(ctx.get("successor"), "the upgrade was aborted after its preflight")
            self._phase(ctx, UpgradePhase.DONE, "aborted")
            message = self._abort_message(self.new_spec, ctx["generation"], preflight, decision, self.live_run())
            if preflight.failure_kind and FailureKind(preflight.failure_kind).retryable:
                raise StreamJobError(message)  # Kafka or the database away, or memory: a retry may pass
            raise AirflowFailException(message)
        if decision.action == Action.RESET:  # check the resume point while the old run still runs
            self.controller.resume_point(self.new_spec, allow_data_loss=self.accepts_data_loss)
        # The run to stop is the live one now: a standby may have taken over since the upgrade began, and a
        # kill of this task owes the restart to the run it stopped (``end_killed_upgrade``).
        live = self.live_run()
        ctx["live_run_id"] = live and live.run_id
        self._phase(ctx, UpgradePhase.STOPPING)
        return self.stop_run_then(context, live, "_old_stopped", {"ctx": ctx})

    def _old_stopped(self, context, stopped, ctx) -> dict[str, Any]:
        if stopped is not None:
            ctx["outcome"]["stopped"] = stopped
        faults.maybe_crash("upgrade_after_stop")  # the task lost between the old run's stop and the new start
        self._phase(ctx, UpgradePhase.STARTING)
        new = self.new_spec
        reason = f"upgrade to version {new.version}: {ctx['decision']['why']}"
        ctx["start_epoch"] = self._epoch()  # a run that holds no later epoch is not the new version's
        if ctx.get("successor"):
            return self._release_successor(context, ctx, reason)
        if ctx["decision"]["action"] == Action.RESET:
            return self.reset_then(context, reason, "_started", {"ctx": ctx}, allow_data_loss=self.accepts_data_loss,
                                   spec_json=new.to_json(), application=self.application,
                                   on_fail="_failed_after_stop")
        return self.launch_then(context, "_started", {"ctx": ctx}, spec_json=new.to_json(), on_fail="_start_refused")

    def _release_successor(self, context, ctx, reason: str) -> dict[str, Any]:
        """Start the warm successor on the generation the decision calls for (after a reset's archive, on
        n+1 from the stored offsets); a successor that is gone is replaced by a cold start."""
        new, successor = self.new_spec, ctx.pop("successor")
        reset = None
        if ctx["decision"]["action"] == Action.RESET:
            try:
                reset = self.controller.before_reset(new, reason, allow_data_loss=self.accepts_data_loss)
            except Exception as err:  # the old run is stopped: roll back, as the cold path's reset does
                self.controller.end_successor(successor, "the upgrade's reset failed")
                return self._failed_after_stop(context, err, ctx)
            launch = self.controller.release_successor(successor, reset["generation"], reset["starting_offsets"])
        else:
            launch = self.controller.release_successor(successor, ctx["generation"], None)
        if launch is None:
            self.log.warning("Starting version %s cold: its successor is gone", new.version)
            if reset is None:
                return self.launch_then(context, "_started", {"ctx": ctx}, spec_json=new.to_json(),
                                        on_fail="_start_refused")
            return self.launch_reset(context, new, reset, reason, "_started", {"ctx": ctx},
                                     on_fail="_failed_after_stop")
        ctx["successor_id"] = launch["run_id"]
        self._in_flight = launch  # as a cold start's: a kill of this task while it starts ends it
        self._phase(ctx, UpgradePhase.STARTING)
        pending = {"launch": launch, "after": "_successor_started", "carry": {"ctx": ctx, "reset": reset,
                                                                            "reason": reason},
                   "on_fail": "_successor_refused", "held_since": self._held_since}
        _set_task_state(context, LAUNCH_KEY, pending)
        wait = self.controller.launch_wait(launch, "ready", float(self.ready_timeout))
        return self.wait_then(context, wait, "_launch_waited", **pending)

    def _successor_started(self, context, started, ctx, reset, reason) -> dict[str, Any]:
        if reset is None:
            return self._started(context, started, ctx)
        return self._reset_launched(context, started, reason, reset, "_started", {"ctx": ctx})

    def _successor_refused(self, context, error, ctx, reset, reason) -> dict[str, Any]:
        if reset is not None:  # it ran on the new generation and failed there: no checkpoint to blame
            return self._failed_after_stop(context, error, ctx)
        return self._start_refused(context, error, ctx)

    def _start_refused(self, context, error, ctx) -> dict[str, Any]:
        """Spark refused the checkpoint on start: reset when the decision allows, else roll back.  Only the
        new version's own run says so: refused before its submit (the brokers away), the latest run is an
        older one, maybe one that found the checkpoint incompatible before this upgrade began."""
        new = self.new_spec
        failed = self._own_refusal(ctx.get("start_epoch", 0))
        if not (failed and ctx["decision"]["reset_on_start_failure"]):
            return self._failed_after_stop(context, error, ctx)
        self.log.warning("Version %s refused the checkpoint on start (%s): resetting", new.version,
                         failed.error_class)
        reason = f"upgrade to version {new.version}: {ctx['decision']['why']}; refused on start: {failed.error_class}"
        return self.reset_then(context, reason, "_started", {"ctx": ctx}, allow_data_loss=self.accepts_data_loss,
                               spec_json=new.to_json(), application=self.application, on_fail="_failed_after_stop")

    def _started(self, context, started, ctx) -> dict[str, Any]:
        ctx["started"] = {"action": "reuse", **started}  # a reset's result names itself "reset"
        if ctx.get("successor_id"):
            ctx["started"]["prewarmed"] = True
        return self._verify(context, ctx)

    # -- verify ------------------------------------------------------------------------------------------
    def _verify(self, context, ctx, method: str = "_verified") -> dict[str, Any]:
        """The new run must commit a batch within the timeout, or be caught up: a query that runs with no
        record to read cannot prove more, and passes as ``idle`` as soon as that is clear."""
        self._phase(ctx, UpgradePhase.VERIFYING if method == "_verified" else UpgradePhase.ROLLING_BACK)
        started = ctx["started"]
        ctx["verify_began"] = time.time()
        wait = RunWait.within(self._verify_timeout, self.controller.clock.now(), run_id=started["run_id"],
                              job_id=self.job.job_id, until="batch", idle=True)
        return self.wait_then(context, wait, method, ctx=ctx)

    @property
    def _verify_timeout(self) -> float:
        return float(self.verify_timeout if self.verify_timeout is not None else self.ready_timeout)

    def _verification(self, event, ctx) -> dict[str, Any]:
        """What the verify wait proved; raises when the new run ended or ran no batch in time."""
        started, outcome = ctx["started"], self.outcome(event)
        seconds = round(time.time() - ctx["verify_began"], 1)
        run = self.controller.get_run(started["run_id"])
        if outcome == "batch":
            return {"batch_id": run.last_batch_id, "seconds": seconds}
        if outcome == "idle":
            self.log.info("Run %s is running and the stream is caught up: verified as running (a batch of "
                          "new records will be the first to show more)", started["run_id"])
            return {"batch_id": None, "idle": True, "seconds": seconds}
        if outcome == "ended":
            raise self.controller.start_failure(self.job.job_id, started.get("log_path"), run)
        raise StreamJobError(f"run {started['run_id']} committed no batch within {self._verify_timeout:.0f}s "
                             f"although Kafka had records for it. Driver log: {started.get('log_path')}")

    def _verified(self, context, event, ctx) -> dict[str, Any]:
        try:
            verified = self._verification(event, ctx)
        except (StreamJobError, AirflowFailException) as err:
            return self._failed_after_stop(context, err, ctx)
        self._phase(ctx, UpgradePhase.DONE, "upgraded")
        return {**ctx["outcome"], **ctx["started"], "verified": verified}

    # -- roll back -----------------------------------------------------------------------------------------
    def _failed_after_stop(self, context, error, ctx) -> dict[str, Any]:
        self.controller.end_successor(ctx.pop("successor", None), "the upgrade is rolling back")
        new = self.new_spec
        if ctx.get("phase") == UpgradePhase.ROLLING_BACK.value and ctx.get("error"):
            # A retry of a task killed while rolling back: what failed the upgrade is the first error
            self.log.error("Rolling job %s back again (%s); the upgrade failed with: %s", new.job_id, error,
                           _first_lines(ctx["error"], 1))
        else:
            self.log.error("Version %s of job %s failed after the stop: %s", new.version, new.job_id, error)
            ctx["error"] = str(error)
        self._phase(ctx, UpgradePhase.ROLLING_BACK)
        if ctx["previous"] is None:
            return self._rollback_over(context, "No rollback: the previous version's job file is unknown (its run "
                                       "was not launched by this provider). Pass previous_application, or start "
                                       "the previous version by hand.", ctx)
        return self.stop_live_then(context, "_rollback_stopped", {"ctx": ctx})

    def _rollback_stopped(self, context, stopped, ctx) -> dict[str, Any]:
        previous = ctx["previous"]
        old = StreamJobSpec.from_dict(json.loads(previous["spec_json"]))
        ctx["rollback_reason"] = f"rollback to version {old.version}: {_first_lines(ctx['error'], 1)}"
        ctx["rollback_epoch"] = self._epoch()  # as ``start_epoch``
        if self.state.current_generation(self.job.job_id) == ctx["generation"]:
            return self.launch_then(context, "_rollback_started", {"ctx": ctx}, application=previous["application"],
                                    spec_json=previous["spec_json"], on_fail="_rollback_refused")
        return self.reset_then(context, ctx["rollback_reason"], "_rollback_started", {"ctx": ctx},
                               spec_json=previous["spec_json"], application=previous["application"],
                               on_fail="_rollback_failed")

    def _rollback_refused(self, context, error, ctx) -> dict[str, Any]:
        """The previous version did not start on its own generation: reset only where its own run found the
        checkpoint incompatible.  Refused before its submit (the brokers away), or gone before its run
        registered, the latest run is still the new version's, whose incompatibility says nothing of the
        old code's: resetting then would throw away a checkpoint the old code reads, state and all."""
        failed = self._own_refusal(ctx.get("rollback_epoch", 0))
        if failed is None:
            return self._rollback_failed(context, error, ctx)
        previous = ctx["previous"]
        return self.reset_then(context, f"{ctx['rollback_reason']}; refused on start: {failed.error_class}",
                               "_rollback_started", {"ctx": ctx}, spec_json=previous["spec_json"],
                               application=previous["application"], on_fail="_rollback_failed")

    def _epoch(self) -> int:
        return self.state.store.current_epoch(self.job.job_id) or 0

    def _own_refusal(self, since_epoch: int) -> RunRecord | None:
        """The job's latest run if a start of this flow's registered it (it took an epoch past
        ``since_epoch``, the job's when that start began: no clock to compare) and it found the checkpoint
        incompatible; else None."""
        run = self.state.latest_run(self.job.job_id)
        own = run is not None and not run.dry_run and run.epoch > since_epoch
        return run if own and run.failure_kind == FailureKind.CHECKPOINT_INCOMPATIBLE.value else None

    def _rollback_started(self, context, started, ctx) -> dict[str, Any]:
        started = {"action": "restart", **started}  # on the kept generation; a reset names itself "reset"
        ctx["rolled_back"] = started
        ctx["started"] = started
        return self._verify(context, ctx, "_rollback_verified")

    def _rollback_verified(self, context, event, ctx) -> dict[str, Any]:
        try:
            self._verification(event, ctx)
        except (StreamJobError, AirflowFailException) as err:
            return self._rollback_failed(context, err, ctx)
        result, previous = ctx["rolled_back"], ctx["previous"]
        old_version = StreamJobSpec.from_dict(json.loads(previous["spec_json"])).version
        self.controller.record_restart("rollback", ctx["rollback_reason"], None, result["run_id"])
        where = (f"on the untouched generation {ctx['generation']}" if result.get("action") != "reset"
                 else f"on generation {result['generation']} from the stored offsets")
        return self._rollback_over(context, f"Rolled back: version {old_version} ({previous['application']}) runs "
                                   f"again {where} as run {result['run_id']}, and has committed since.", ctx,
                                   "rolled back")

    def _rollback_failed(self, context, error, ctx) -> dict[str, Any]:
        previous = ctx["previous"]
        old_version = StreamJobSpec.from_dict(json.loads(previous["spec_json"])).version
        return self._rollback_over(context, f"The rollback to version {old_version} ({previous['application']}) "
                                   f"failed too: {_first_lines(str(error))}. The job is down; start a known-good "
                                   "version by hand.", ctx)

    def _rollback_over(self, context, rolled: str, ctx, result: str = "failed") -> dict[str, Any]:
        self._phase(ctx, UpgradePhase.DONE, result)
        new = self.new_spec
        raise AirflowFailException(
            f"job {new.job_id}: the upgrade to version {new.version} failed after the old run was stopped: "
            f"{_first_lines(ctx['error'])}\n{rolled}")

    def _abort_message(self, new: StreamJobSpec, generation: int, preflight: Preflight,
                       decision: upgrade.Decision, live: RunRecord | None) -> str:
        job_id = new.job_id
        running = (f"Nothing was stopped: run {live.run_id} (version {live.version}) keeps running."
                   if live else "Nothing was stopped or started.")
        head = f"job {job_id}: upgrade to version {new.version} refused: {decision.why}. {running}"
        if preflight.verdict != Verdict.INCOMPATIBLE:
            what = (f"The new version was not judged: {FailureKind(preflight.failure_kind).advice} Then rerun "
                    "the upgrade." if preflight.failure_kind in upgrade.UNJUDGED_KINDS else
                    "Fix the new version and rerun.")
            return (f"{head}\nPreflight run {preflight.run_id} ({preflight.failure_kind}, {preflight.error_class}): "
                    f"{preflight.detail}\n{what} Preflight driver log "
                    f"{preflight.log_path}:\n{log_tail(preflight.log_path, secrets=[self.state.password])}")
        stored = self.state.stored_offsets(job_id)
        resume = kafka_offsets.to_spark_json(stored) if stored else f"{new.kafka.starting_offsets!r} (none stored)"
        archive = f"{self.controller.checkpoints.job_root(job_id)}/archive/gen-{generation}-<UTC time>"
        return (f"{head}\nSpark refused a copy of the checkpoint: {preflight.error_class}: {preflight.detail}\n"
                f"A reset would archive {self.controller.checkpoints.generation_path(job_id, generation)} to {archive} and "
                f"start generation {generation + 1} of version {new.version} from the stored offsets {resume}. "
                "To do that, rerun with reset_policy='after_preflight' (or use ResetStreamingJobOperator).")


def _verdict(run: RunRecord | None, ending: DryRunEnd, log_path: str | None,
             reads_old_state: int | None) -> Preflight:
    """``reads_old_state``: the first batch of the dry run that reads state the old code committed (None:
    the copy had no committed batch, so none does)."""
    if ending == "idle":
        return Preflight(Verdict.INCONCLUSIVE, "the stream is caught up: no record arrived for the dry run's "
                                               "batch, and the copy held no committed batch to re-run")
    if ending == "unregistered" or (run is None and ending == "timeout"):  # a start that slow judges no code
        return Preflight(Verdict.FAILED, f"the dry-run driver did not register its run within the preflight's "
                                         f"timeout: {_first_lines(log_tail(log_path, 5), 5)}",
                         failure_kind=FailureKind.TRANSIENT.value)
    if ending == "timeout":
        return Preflight(Verdict.INCONCLUSIVE, "the dry run ran no batch before it ended")
    if run is None:
        return Preflight(Verdict.FAILED, f"the dry-run driver exited before registering its run: "
                                         f"{_first_lines(log_tail(log_path, 5), 5)}")
    if run.status == RunStatus.STOPPED and run.last_batch_id is not None:
        if reads_old_state is None or run.last_batch_id < reads_old_state:
            return Preflight(Verdict.INCONCLUSIVE, f"batch {run.last_batch_id} ran on the copy, but the copy "
                                                   "had no committed batch whose state it could read")
        return Preflight(Verdict.COMPATIBLE, f"batch {run.last_batch_id} ran on the copy")
    if run.status == RunStatus.STOPPED:
        return Preflight(Verdict.INCONCLUSIVE, "the dry run ran no batch before it ended")
    kind, error_class = run.failure_kind, run.error_class
    detail = _first_lines(run.termination_message or "no termination message", 3)
    verdict = Verdict.INCOMPATIBLE if kind == FailureKind.CHECKPOINT_INCOMPATIBLE.value else Verdict.FAILED
    return Preflight(verdict, detail, error_class=error_class, failure_kind=kind)


def _first_lines(text: str, lines: int = 4) -> str:
    return "\n".join(line[:400] for line in text.strip().splitlines()[:lines])
