"""What stands on a job beside its health, for on-call's two views (``status`` and the status page): the
restart it is owed or has begun, where an unfinished upgrade stands, the task acting on it, its standby.

Read from the state database alone.  Whether a task has ended is Airflow's to say, which these views do
not ask: where that decides, the line names the task to look at.
"""

from __future__ import annotations

import datetime as dt
import time

from airflow_stream_provider import recovery
from airflow_stream_provider.diagnosis import Diagnosis
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.standbys import StandbyLog
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.state.upgrades import (
    LEAVES_THE_JOB_DOWN,
    UpgradeLog,
    UpgradePhase,
    UpgradeRecord,
)


def when(seconds: float | None) -> str:
    """A moment for on-call: UTC, to the second; ``-`` for none."""
    if not seconds:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def read(store: StateStore, found: Diagnosis, now: float | None = None) -> tuple[Diagnosis, list[str]]:
    """``found`` with the restart it is owed noted (a job that reads STOPPED because a restart or a reset
    stopped its run and started none, yet nobody asked for that stop), and the lines that stand beside it:
    a restart begun and not launched, the latest upgrade, the task holding the job's lease, the standby."""
    now = time.time() if now is None else now
    last = store.latest_restart(found.job_id) if found.health in recovery.MAY_BE_OWED else None
    found = recovery.with_interrupted_restart(found, last)
    lines = []
    # Owed once its task has ended, which is Airflow's to say: the restart as if it had, to name that task
    begun = None if found.restart_owed or last is None else recovery.interrupted_restart(found, [last],
                                                                                         lambda task: True)
    if begun is not None:
        lines.append(f"{begun['action']} of this run begun at {when(begun['at'])} by task {begun['task']}, "
                     "nothing launched yet; if that task has ended without launching, stream_health's recover "
                     "finishes it")
    upgrade = UpgradeLog(store).latest(found.job_id)
    if upgrade is not None:
        lines.append(upgrade_line(upgrade))
    lease = LeaseLog(store).get(found.job_id)
    if lease is not None and lease.until >= now:
        lines.append(f"acting on the job: {lease.describe(now)}")
    standbys = StandbyLog(store)
    lines += [standby.describe() for standby in standbys.live(found.job_id) or standbys.recent(found.job_id, 1)]
    return found, lines


def upgrade_line(upgrade: UpgradeRecord) -> str:
    """The latest upgrade: where it stands if unfinished (a retry of its task resumes or rolls back from
    there), how it ended otherwise."""
    versions = f"{upgrade.from_version or '?'} -> {upgrade.to_version or '?'}"
    if upgrade.phase == UpgradePhase.DONE:
        return f"last upgrade {versions}: {upgrade.result or 'done'} at {when(upgrade.updated_at)}"
    line = (f"upgrade {versions} in progress: {upgrade.phase.value} since {when(upgrade.updated_at)} "
            f"(started {when(upgrade.started_at)}); a retry of the upgrade task resumes or rolls it back")
    if upgrade.phase in LEAVES_THE_JOB_DOWN and upgrade.detail.get("live_run_id"):
        task = f"its task {upgrade.task}" if upgrade.task else "its task"
        line += (f"; if {task} has ended without resuming or rolling it back, stream_health's recover ends the "
                 "upgrade and restarts the version that ran before")
    return line
