"""Upgrade a running stream job to new code: preflight, stop, start (or reset), verify, roll back."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider import kafka_offsets, upgrade
from airflow_stream_provider import spec as spec_module
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.operators.base import StreamJobError, StreamJobOperator, _log_tail
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.store import ACTIVE_STATUSES, STOPPED
from airflow_stream_provider.upgrade import Action, Preflight, Verdict

#: How a preflight's dry run ended: by itself, stopped as idle (caught up, nothing to run a batch on), or
#: stopped at the timeout.
DryRunEnd = Literal["ended", "idle", "timeout"]
#: How long a preflight waits for a live run to commit its second batch (it needs one to re-run).
STATE_HISTORY_WAIT_S = 60.0
#: Caught up (no Kafka record beyond the stored offsets) for this long: no batch is coming, so waiting
#: for one (to verify a new run, or for a dry run to run one) would only wait out the timeout.
IDLE_CONFIRM_S = 5.0


class _IdleClock:
    """Whether the job stayed caught up for IDLE_CONFIRM_S, polled as often as the caller likes."""

    def __init__(self, caught_up):
        self._caught_up, self._since = caught_up, None

    def confirmed(self) -> bool:
        if not self._caught_up():
            self._since = None
            return False
        self._since = self._since or time.monotonic()
        return time.monotonic() - self._since >= IDLE_CONFIRM_S


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
    """

    template_fields = (*StreamJobOperator.template_fields, "version", "reset_policy", "previous_application",
                       "preflight_timeout", "verify_timeout")
    ui_color = "#fdf2e0"

    def __init__(self, *, version: str | None = None, reset_policy: str = "after_preflight",
                 previous_application: str | None = None, preflight_timeout: float = 300.0,
                 verify_timeout: float | None = None, allow_data_loss: bool = False,
                 keep_preflight_copy: bool = False, **kwargs):
        super().__init__(**kwargs)
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

    def execute(self, context) -> dict[str, Any]:
        try:
            policy = upgrade.check_policy(self.reset_policy)
        except ValueError as err:
            raise AirflowFailException(str(err)) from None
        new = self.new_spec
        job_id = new.job_id
        before = self.state.latest_run(job_id)
        previous = self.recorded_launch(before, self.previous_application)
        generation = self.state.current_generation(job_id)
        live = self.live_run()
        self.log.info("Upgrading job %s from %s to %s (generation %s, %s)", job_id,
                      before and before["version"], new.version, generation,
                      f"run {live['run_id']} live" if live else "no live run")

        preflight = self.preflight(new, generation)
        decision = upgrade.decide(preflight, policy)
        self.log.info("Preflight: %s (%s). Decision: %s, because %s", preflight.verdict.value,
                      preflight.detail, decision.action.value, decision.why)
        outcome: dict[str, Any] = {"job_id": job_id, "from_version": before and before["version"],
                                   "to_version": new.version, "preflight": preflight.to_dict(),
                                   "decision": decision.action.value, "generation_before": generation}
        if decision.action == Action.ABORT:
            raise AirflowFailException(self._abort_message(new, generation, preflight, decision, live))
        if decision.action == Action.RESET:  # check the resume point while the old run still runs
            self.resume_point(new, allow_data_loss=self.allow_data_loss)
        if live is not None:
            outcome["stopped"] = self.stop_run(live)
        try:
            started = self._start(new, decision)
            outcome["verified"] = self.verify(started)
        except (StreamJobError, AirflowFailException) as err:
            self.log.error("Version %s of job %s failed after the stop: %s", new.version, job_id, err)
            rolled = self._roll_back(previous, generation, str(err))
            raise AirflowFailException(
                f"job {job_id}: the upgrade to version {new.version} failed after the old run was stopped: "
                f"{_first_lines(str(err))}\n{rolled}") from None
        return {**outcome, **started}

    # -- preflight -------------------------------------------------------------------------------------
    def preflight(self, new: StreamJobSpec, generation: int) -> Preflight:
        """Run the new code as a dry run on a copy of generation ``generation``'s checkpoint."""
        job_id = new.job_id
        active = {g.generation for g in self.checkpoints.list_generations(job_id) if not g.archived}
        path = self.checkpoints.generation_path(job_id, generation)
        if generation not in active or not self.checkpoints.has_checkpoint(path):
            return Preflight(Verdict.SKIPPED, f"generation {generation} has no checkpoint yet")
        started = time.monotonic()
        self._await_state_history(path)
        root = self.checkpoints.new_preflight_root(job_id)
        copy = spec_module.generation_path(f"{root}/{job_id}", generation)
        try:
            self.checkpoints.copy_generation(job_id, generation, copy)
            # A stateful change shows only in a batch that reads state the old code wrote: re-run the newest
            # committed batch when an older one stays committed; with only batch 0 committed, keep it, and
            # batch 1 (on new data) is that batch.  With nothing committed no batch can show it.
            committed = self.checkpoints.latest_committed(copy)
            # Only batch 0 and no record for a batch 1: re-run batch 0 for a verdict now (it shows a changed
            # source or plan, not yet state) rather than wait out the timeout for data that is not coming.
            replay = committed is not None and (committed > 0 or self._caught_up())
            replayed = self.checkpoints.drop_latest_commit(copy) if replay else None
            reads_old_state = None if committed is None else max(committed, 1)
            dry = replace(new.with_generation(generation), checkpoint_root=root, dry_run=True)
            run_id = uuid.uuid4().hex
            self.log.info("Preflight of version %s on a copy of generation %s (%s; batch %s replayed): run %s",
                          new.version, generation, copy, replayed, run_id)
            submitted = self.driver.submit(self.application, dry, run_id, self.state.password)
            ending, run = self._wait_dry_run(submitted, data_needed=replayed is None)
            verdict = _verdict(run, ending, submitted.log_path, reads_old_state)
            return replace(verdict, run_id=run_id, log_path=submitted.log_path,
                           seconds=round(time.monotonic() - started, 1))
        finally:
            if not self.keep_preflight_copy:
                self.checkpoints.remove_preflight(job_id, root)

    def _await_state_history(self, path: str) -> None:
        """Give a live run that has committed only its first batch a moment to commit a second one, so the
        copy holds a batch to re-run on top of the old code's state (see ``preflight``)."""
        deadline = time.monotonic() + min(float(self.preflight_timeout), STATE_HISTORY_WAIT_S)
        while ((self.checkpoints.latest_committed(path) or 0) < 1 and self.live_run() is not None
               and not self._caught_up()):  # caught up, no second batch is coming
            if time.monotonic() > deadline:
                self.log.warning("The live run committed no second batch within %.0fs: the preflight may be "
                                 "inconclusive for stateful changes", STATE_HISTORY_WAIT_S)
                return
            time.sleep(0.5)

    def _wait_dry_run(self, submitted, *, data_needed: bool) -> tuple[DryRunEnd, dict[str, Any] | None]:
        """How the dry run ended, and its run row.  ``data_needed``: no batch was left to re-run, so the dry
        run's batch waits for new records; on a caught-up stream it is stopped as soon as that is clear."""
        idle = _IdleClock(self._caught_up)
        state, run = self.watch_submission(
            submitted, float(self.preflight_timeout),
            (lambda r: r["query_started_at"] and r["last_batch_id"] is None and idle.confirmed())
            if data_needed else None)
        if state == "ready":
            self.log.info("Preflight run %s: the stream is caught up, no record for a batch to run on: "
                          "stopping it", submitted.run_id)
            self.stop_run(run)
            return "idle", self.state.store.get_run(run["run_id"]) or run
        if state == "ended":
            if run is not None:  # its checkpoint copy is removed next: let the driver exit first
                self._wait_ended(run, self.kill_grace)
            return "ended", run
        if run is not None:  # no batch within the timeout: end it, the verdict is inconclusive
            self.log.warning("Preflight run %s ran no batch within %ss: stopping it", submitted.run_id,
                             self.preflight_timeout)
            self.stop_run(run)
        return "timeout", run

    # -- start, verify, roll back ----------------------------------------------------------------------
    def _start(self, new: StreamJobSpec, decision: upgrade.Decision) -> dict[str, Any]:
        reason = f"upgrade to version {new.version}: {decision.why}"
        if decision.action == Action.RESET:
            return self.reset_and_resume(reason, allow_data_loss=self.allow_data_loss, spec=new)
        return self._launch_or_reset(new, None, "reuse", reason, reset=decision.reset_on_start_failure,
                                     allow_data_loss=self.allow_data_loss)

    def _launch_or_reset(self, spec: StreamJobSpec, application: str | None, action: str, reason: str, *,
                         reset: bool, allow_data_loss: bool = False) -> dict[str, Any]:
        """Start ``spec`` on the current generation; if Spark refuses its checkpoint and ``reset`` allows,
        reset to a new generation from the stored offsets instead."""
        try:
            return {**self.launch(spec=spec, application=application), "action": action}
        except (StreamJobError, AirflowFailException):
            failed = self.state.latest_run(spec.job_id)
            refused = failed and failed["failure_kind"] == FailureKind.CHECKPOINT_INCOMPATIBLE.value
            if not (refused and reset):
                raise
            self.log.warning("Version %s refused the checkpoint on start (%s): resetting", spec.version,
                             failed["error_class"])
            return self.reset_and_resume(f"{reason}; refused on start: {failed['error_class']}",
                                         allow_data_loss=allow_data_loss, spec=spec, application=application)

    def verify(self, started: dict[str, Any]) -> dict[str, Any]:
        """The new run must commit a batch within the timeout, or be caught up: a query that runs with no
        record to read cannot prove more, and passes as ``idle`` as soon as that is clear."""
        timeout = float(self.verify_timeout if self.verify_timeout is not None else self.ready_timeout)
        began = time.monotonic()
        idle = _IdleClock(self._caught_up)
        while time.monotonic() - began < timeout:
            run = self.state.store.get_run(started["run_id"])
            if run["last_batch_id"] is not None:
                return {"batch_id": run["last_batch_id"], "seconds": round(time.monotonic() - began, 1)}
            if run["status"] not in ACTIVE_STATUSES or self.driver.is_alive(run) is False:
                time.sleep(0.5)
                run = self.state.store.get_run(started["run_id"])
                raise self._start_failure(self.job, started.get("log_path"), run)
            if run["query_started_at"] and idle.confirmed():
                self.log.info("Run %s is running and the stream is caught up: verified as running (a batch of "
                              "new records will be the first to show more)", started["run_id"])
                return {"batch_id": None, "idle": True, "seconds": round(time.monotonic() - began, 1)}
            time.sleep(0.5)
        raise StreamJobError(f"run {started['run_id']} committed no batch within {timeout:.0f}s although Kafka "
                             f"had records for it. Driver log: {started.get('log_path')}")

    def _caught_up(self) -> bool:
        try:
            lag = self.kafka.lag(self.state.stored_offsets(self.job.job_id), self.job.kafka.topics)
        except Exception:
            return False
        return lag == 0

    def _roll_back(self, previous: tuple[str, StreamJobSpec] | None, generation: int, why: str) -> str:
        job_id = self.job.job_id
        live = self.live_run()
        if live is not None:
            self.stop_run(live)
        if previous is None:
            return ("No rollback: the previous version's job file is unknown (its run was not launched by this "
                    "provider). Pass previous_application, or start the previous version by hand.")
        application, old = previous
        kept = self.state.current_generation(job_id) == generation
        reason = f"rollback to version {old.version}: {_first_lines(why, 1)}"
        try:
            if kept:
                result = self._launch_or_reset(old, application, "restart", reason, reset=True)
            else:
                result = self.reset_and_resume(reason, spec=old, application=application)
            self.verify(result)
        except (StreamJobError, AirflowFailException) as err:
            return (f"The rollback to version {old.version} ({application}) failed too: {_first_lines(str(err))}. "
                    "The job is down; start a known-good version by hand.")
        self.state.record_restart(job_id, "rollback", reason, None, result["run_id"])
        where = (f"on the untouched generation {generation}" if result["action"] == "restart"
                 else f"on generation {result['generation']} from the stored offsets")
        return (f"Rolled back: version {old.version} ({application}) runs again {where} as run "
                f"{result['run_id']}, and has committed since.")

    def _abort_message(self, new: StreamJobSpec, generation: int, preflight: Preflight,
                       decision: upgrade.Decision, live: dict[str, Any] | None) -> str:
        job_id = new.job_id
        running = (f"Nothing was stopped: run {live['run_id']} (version {live['version']}) keeps running."
                   if live else "Nothing was stopped or started.")
        head = f"job {job_id}: upgrade to version {new.version} refused: {decision.why}. {running}"
        if preflight.verdict != Verdict.INCOMPATIBLE:
            return (f"{head}\nPreflight run {preflight.run_id} ({preflight.failure_kind}, {preflight.error_class}): "
                    f"{preflight.detail}\nFix the new version and rerun. Preflight driver log "
                    f"{preflight.log_path}:\n{_log_tail(preflight.log_path)}")
        stored = self.state.stored_offsets(job_id)
        resume = kafka_offsets.to_spark_json(stored) if stored else f"{new.kafka.starting_offsets!r} (none stored)"
        archive = f"{self.checkpoints.job_root(job_id)}/archive/gen-{generation}-<UTC time>"
        return (f"{head}\nSpark refused a copy of the checkpoint: {preflight.error_class}: {preflight.detail}\n"
                f"A reset would archive {self.checkpoints.generation_path(job_id, generation)} to {archive} and "
                f"start generation {generation + 1} of version {new.version} from the stored offsets {resume}. "
                "To do that, rerun with reset_policy='after_preflight' (or use ResetStreamingJobOperator).")


def _verdict(run: dict[str, Any] | None, ending: DryRunEnd, log_path: str | None,
             reads_old_state: int | None) -> Preflight:
    """``reads_old_state``: the first batch of the dry run that reads state the old code committed (None:
    the copy had no committed batch, so none does)."""
    if ending == "idle":
        return Preflight(Verdict.INCONCLUSIVE, "the stream is caught up: no record arrived for the dry run's "
                                               "batch, and the copy held no committed batch to re-run")
    if ending == "timeout":
        return Preflight(Verdict.INCONCLUSIVE, "the dry run ran no batch before it ended")
    if run is None:
        return Preflight(Verdict.FAILED, f"the dry-run driver exited before registering its run: "
                                         f"{_first_lines(_log_tail(log_path, 5), 5)}")
    if run["status"] == STOPPED and run.get("last_batch_id") is not None:
        if reads_old_state is None or run["last_batch_id"] < reads_old_state:
            return Preflight(Verdict.INCONCLUSIVE, f"batch {run['last_batch_id']} ran on the copy, but the copy "
                                                   "had no committed batch whose state it could read")
        return Preflight(Verdict.COMPATIBLE, f"batch {run['last_batch_id']} ran on the copy")
    if run["status"] == STOPPED:
        return Preflight(Verdict.INCONCLUSIVE, "the dry run ran no batch before it ended")
    kind, error_class = run.get("failure_kind"), run.get("error_class")
    detail = _first_lines(run.get("termination_message") or "no termination message", 3)
    verdict = Verdict.INCOMPATIBLE if kind == FailureKind.CHECKPOINT_INCOMPATIBLE.value else Verdict.FAILED
    return Preflight(verdict, detail, error_class=error_class, failure_kind=kind)


def _first_lines(text: str, lines: int = 4) -> str:
    return "\n".join(line[:400] for line in text.strip().splitlines()[:lines])
