"""A task killed while it was deferred: what its trigger undoes in its place.

A person marking a deferred task failed or succeeded, or clearing it, ends the task with no worker to run the
operator's ``on_kill``.  Airflow (3.3 on) calls the trigger's ``on_kill`` instead, and only then: not when a
triggerer restarts or hands its triggers to another.  The trigger does what the operator would have done, from
the state database and this host: the driver the task started and waited on is killed (asked to stop through
its row where it runs elsewhere), an upgrade's unreleased successor and its record are ended, and the job's
lease is let go at once instead of when the wait's deadline passes.  Where Airflow does not call it (3.1,
3.2, a task marked failed before a triggerer took its trigger up, a worker lost while the task ran), the
next task to want the job's lease does it (``undo_ended``), once Airflow says the holder has ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from airflow_stream_provider import local_driver
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.state.leases import Lease, LeaseLog
from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.state.upgrades import LEAVES_THE_JOB_DOWN, UpgradeLog, UpgradePhase


@dataclass(frozen=True)
class KilledTask:
    """What a deferred task would leave behind if it were killed; travels in its trigger's kwargs."""

    job_id: str
    #: the task's hold on the job's lease (``operators.base``: dag / run / task / map index)
    lease_owner: str | None = None
    #: the driver it started and is waiting on: run_id, pid, host, submitted_at; a cluster-mode one's
    #: submission_id and spark_conn_id too
    launch: dict[str, Any] | None = None
    #: an upgrade: its prewarmed successor, until released, waits on it
    upgrade: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KilledTask:
        return cls(**data)


def end_unregistered(store: StateStore, launch: Mapping[str, Any], why: str, log: logging.Logger,
                     kill_submission: Callable[[str, str], Any]) -> bool:
    """End a launch that has not registered its run, for ``StreamJobController.abandon`` and for whoever
    undoes a task that can no longer do it.  Cancelled first (``StateStore.cancel_launch``), so that a driver
    no kill reaches exits as it registers instead of taking the job's epoch from the run started after it; a
    standby's or a successor's launch (its run id is the standby's) also ends its standby, which sees that at
    its next heartbeat.  Then killed: by its pid on its own host, or a cluster-mode one (queued by YARN, a pod
    pending) through its cluster manager, by the handle its submission returned (``kill_submission(job_id,
    handle)``, a ``Kill``).  False where the run registered first: it is to be ended as a run."""
    if not store.cancel_launch(launch["job_id"], launch["run_id"], why):
        return False
    StandbyLog(store).end(launch["run_id"], StandbyStatus.ENDED, f"its launch was cancelled: {why}")
    handle = launch.get("submission_id")
    if not handle:
        local_driver.kill_unregistered(launch, why, log)
        return True
    killed = kill_submission(launch["job_id"], handle)
    if getattr(killed, "done", False):
        log.warning("Killed run %s before it registered (submission %s): %s (%s)", launch["run_id"], handle, why,
                    killed)
    else:
        log.error("Run %s (submission %s) could not be killed before it registered (%s): %s. Its launch is "
                  "cancelled: it exits as it registers, holding its cluster's resources until then",
                  launch["run_id"], handle, why, killed)
    return True


def end_unreleased_successor(store: StateStore, job_id: str, why: str) -> str | None:
    """End the successor the job's latest upgrade holds and has not released; its id if one was ended."""
    found = UpgradeLog(store).latest(job_id)
    if found is None or not found.successor_id:
        return None
    return found.successor_id if StandbyLog(store).end(found.successor_id, StandbyStatus.ENDED, why) else None


def end_killed_upgrade(store: StateStore, job_id: str, why: str, log: logging.Logger) -> None:
    """The job's unfinished upgrade, whose task was killed, ends (result ``killed``): left in its phase, it
    would keep every recovery and lifecycle task away for ``UPGRADE_STALE_S``, with no task to finish it.
    Killed after it stopped the old run, or asked it to stop, and before the new version ran (or while it
    rolled back), it leaves the job down: a restart of the old run is recorded as begun, so that the next recovery finishes it
    with the code that ran before, as the upgrade's own rollback would (``recovery.interrupted_restart``)."""
    upgrades = UpgradeLog(store)
    found = upgrades.latest(job_id)
    if found is None or found.phase == UpgradePhase.DONE:
        return
    old_run = store.get_run(found.detail.get("live_run_id") or "")
    # An old run still finishing its batch after the upgrade's stop marker ends soon, stop requested, which a
    # recovery takes for a stop someone wanted: it is owed the restart as well.
    stopping = old_run is not None and (not old_run.active or old_run.stop_requested_at is not None)
    if found.phase in LEAVES_THE_JOB_DOWN and stopping:
        store.record_restart(job_id, "restart", f"upgrade {found.upgrade_id} to version {found.to_version} was "
                             f"killed in phase {found.phase.value} ({why}): back to version {found.from_version}",
                             old_run.run_id, None)
    upgrades.move(found.upgrade_id, UpgradePhase.DONE, {**found.detail, "killed": why}, result="killed")
    log.warning("job %s: upgrade %s to version %s ended in phase %s: %s", job_id, found.upgrade_id,
                found.to_version, found.phase.value, why)


def end_stopped_upgrade(store: StateStore, job_id: str, why: str, log: logging.Logger) -> str | None:
    """The job's unfinished upgrade ends (result ``stopped``) under a person's stop, which holds the job's
    lease, so its task acts no longer (gone, or waiting for a retry): the stop supersedes it.  Left in its
    phase, a job it had stopped would be restarted once its task is found ended (``health.with_abandoned_
    upgrade``), undoing the stop; and a retry of it would roll back to the old code, starting the job again.
    Its id, if one ended."""
    upgrades = UpgradeLog(store)
    found = upgrades.latest(job_id)
    if found is None or found.phase == UpgradePhase.DONE:
        return None
    upgrades.move(found.upgrade_id, UpgradePhase.DONE, {**found.detail, "stopped": why, "stopped_in": found.phase.value},
                  result="stopped")
    log.warning("job %s: upgrade %s to version %s, left in phase %s, ended: %s", job_id, found.upgrade_id,
                found.to_version, found.phase.value, why)
    return found.upgrade_id


def undo(store: StateStore, killed: KilledTask, why: str, log: logging.Logger, *, running_too: bool = True) -> None:
    """Undo what ``killed`` leaves behind; each step on its own, so that one failing leaves the rest done.
    ``running_too=False``: leave its launch alone once its query runs."""
    # an upgrade's own record says what the job is owed (``end_killed_upgrade``)
    steps = [partial(_end_launch, store, {"job_id": killed.job_id, **killed.launch}, running_too,
                     owe_restart=not killed.upgrade)] if killed.launch else []
    if killed.upgrade:
        steps.append(partial(_end_successor, store, killed.job_id))
        steps.append(partial(end_killed_upgrade, store, killed.job_id))
    if killed.lease_owner:
        steps.append(partial(_release_lease, store, killed.job_id, killed.lease_owner))
    for step in steps:
        try:
            step(why, log)
        except Exception:
            log.warning("job %s: %s after its task was killed failed", killed.job_id, step.func.__name__,
                        exc_info=True)


def undo_ended(store: StateStore, held: Lease, log: logging.Logger) -> None:
    """Undo what the task holding ``held`` left when it ended without letting go (its process lost, or
    killed while deferred where no trigger undid it): as :func:`undo`, except that a driver it launched is
    ended only while its query has not started.  The lease names the launch from the holder's last take,
    which may be older than its ready: a run whose query runs is the job's run by then."""
    undo(store, KilledTask(held.job_id, lease_owner=held.owner, launch=held.launch, upgrade=held.action == "upgrade"),
         "its task ended without letting go of the job's lease", log, running_too=False)


def _end_launch(store: StateStore, launch: dict[str, Any], running_too: bool, why: str,
                log: logging.Logger, *, owe_restart: bool = True) -> None:
    """As ``StreamJobController.abandon``, for a task that can no longer do it: a registered run on another
    host or a cluster is asked to stop through its row, which its heartbeat reads; an unregistered one is
    ended as ``end_unregistered`` says.

    A run killed here ends DEAD, which a recovery restarts.  One asked to stop would end as a stop someone
    asked for, which a recovery leaves down: ``owe_restart`` records a restart of it begun, as a restart's
    own stop does, so that the next recovery finishes it (``recovery.interrupted_restart``) and the job is
    not left down by what only undid a lost launch."""
    run = store.get_run(launch["run_id"])
    if run is None and end_unregistered(store, launch, why, log, partial(_kill_submission, launch)):
        return
    run = run or store.get_run(launch["run_id"])
    if run is None or (run.running_query and not running_too):
        return
    if run.active and local_driver.run_alive(run):
        log.warning("Killing run %s: %s (%s)", run.run_id, why, StreamDriverHook().kill(run))
        store.mark_dead(run.run_id, f"abandoned: {why}")
    elif run.active and store.request_stop(run.run_id):
        log.warning("Asked run %s on %s to stop: %s", run.run_id, run.host, why)
        if owe_restart:
            store.record_restart(launch["job_id"], "restart", f"asked to stop as what its task left was undone "
                                 f"({why})", run.run_id, None)


def _kill_submission(launch: dict[str, Any], job_id: str, handle: str) -> Any:
    """Through a cluster manager reached as the task that launched it did (the launch names the connection,
    conf and env_vars); what failed, as text, where it could not be asked."""
    try:
        hook = StreamDriverHook(launch.get("spark_conn_id") or StreamDriverHook.default_conn_name,
                                conf=launch.get("conf"), env_vars=launch.get("env_vars"))
        return hook.kill_submission(job_id, handle)
    except Exception as err:  # the connection or the cluster manager's client: said in the log instead
        return f"{type(err).__name__}: {err}"


def _end_successor(store: StateStore, job_id: str, why: str, log: logging.Logger) -> None:
    ended = end_unreleased_successor(store, job_id, why)
    if ended:
        log.warning("job %s: asked the upgrade's successor %s to end: %s", job_id, ended, why)


def _release_lease(store: StateStore, job_id: str, owner: str, why: str, log: logging.Logger) -> None:
    LeaseLog(store).release(job_id, owner)
    log.info("job %s: let go of the lease of %s (%s)", job_id, owner, why)
