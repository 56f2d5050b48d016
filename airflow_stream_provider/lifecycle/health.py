"""The facts behind a health verdict, gathered one way for every caller: the sensors and their trigger,
the always-on DAG's fresh diagnosis, and the controller before it decides a recovery."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cached_property, partial
from typing import Any

from airflow_stream_provider import diagnosis, local_driver, recovery
from airflow_stream_provider.diagnosis import Diagnosis, Thresholds
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.holders import task_ended
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.state.standbys import STANDBY, StandbyLog, StandbyRecord, StandbyStatus
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradeRecord

log = logging.getLogger(__name__)


class HealthProbe:
    """One job's health check over its state and Kafka hooks.  Built once per watch, so a trigger polling
    every few seconds does not rebuild its database engine and Kafka client each time.

    :param job_id: the job to check.
    :param topics: the job's topics, for the Kafka lag.
    :param state: the state database's hook.
    :param kafka: the Kafka offsets hook.
    :param thresholds: when silence means dead, and idleness with lag means stuck.
    """

    def __init__(self, job_id: str, topics: Sequence[str], state: StreamStateHook, kafka: KafkaOffsetsHook,
                 thresholds: Thresholds):
        self.job_id = job_id
        self.topics = list(topics)
        self.state = state
        self.kafka = kafka
        self.thresholds = thresholds

    @classmethod
    def connect(cls, job_id: str, topics: Sequence[str], state_conn_id: str, kafka_conn_id: str,
                thresholds: Thresholds) -> HealthProbe:
        """A probe over the named Airflow connections."""
        return cls(job_id, topics, StreamStateHook(state_conn_id), KafkaOffsetsHook(kafka_conn_id), thresholds)

    def check(self) -> Diagnosis:
        return self.observe()[1]

    def observe(self) -> tuple[RunRecord | None, Diagnosis]:
        """The latest run and its diagnosis from the run, the driver process if it is on this host, and the
        Kafka lag (only worth reading while the query runs: it is the evidence for STUCK).  A run found
        dead is recorded DEAD."""
        run = self.state.latest_run(self.job_id)
        lag = None
        if run and run.status == "RUNNING":
            try:
                lag = self.kafka.lag(self.state.unapplied_from(self.job_id), self.topics)
            except Exception as err:  # the verdict stands without the lag; STUCK needs it
                log.warning("Could not read the Kafka lag of job %s: %r", self.job_id, err)
        alive = StreamDriverHook.is_alive(run) if run else None
        found = diagnosis.diagnose(self.job_id, run, driver_alive=alive, lag=lag, thresholds=self.thresholds)
        self.state.record_death(run, found)
        if found.health in recovery.INTERRUPTIBLE:  # only a run that is down can be owed a restart
            found = with_interrupted_restart(found, self.state.store.latest_restart(self.job_id))
            upgrade = None if found.restart_owed else self.upgrades.leaving_down(self.job_id).get(self.job_id)
            found = with_abandoned_upgrade(found, upgrade, partial(task_ended, log=log))
        return run, with_standby(found, run, self.standbys, self.thresholds)

    @cached_property
    def standbys(self) -> StandbyLog:
        return StandbyLog(self.state.store)

    @cached_property
    def upgrades(self) -> UpgradeLog:
        return UpgradeLog(self.state.store)

    def close(self) -> None:
        self.state.close()


def with_abandoned_upgrade(found: Diagnosis, upgrade: UpgradeRecord | None,
                           ended: Callable[[str], bool]) -> Diagnosis:
    """``found`` with the restart it is owed noted (``Diagnosis.interrupted_restart``), where the job is down
    because an upgrade stopped its run and the upgrade's task ended without finishing or undoing that: its
    worker lost, killed while deferred where no trigger undid it, or failed past the stop on its last try.
    ``upgrade``: the job's latest upgrade in a phase that leaves it down (``UpgradeLog.leaving_down``);
    ``ended``: whether Airflow says a task instance has ended (a retry to come is not).  The recovery ends
    the upgrade and restarts the run it stopped, with the code that ran before."""
    if upgrade is None or found.restart_owed or found.health not in recovery.INTERRUPTIBLE:
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
                          f"{upgrade.phase.value} since {diagnosis.clock(upgrade.updated_at)}, and its task "
                          f"{upgrade.task} has ended in Airflow without finishing it: nobody brings the job back")
    found.advice = ("A recovery ends the upgrade and restarts the version that ran before from the checkpoint "
                    "(stream_health does so by itself).")
    return found


def with_interrupted_restart(found: Diagnosis, last_restart: Mapping[str, Any] | None) -> Diagnosis:
    """``found`` with the restart it is owed noted (``Diagnosis.interrupted_restart``), where the job's newest
    restart (``last_restart``) stopped its run and launched nothing after."""
    owed = recovery.interrupted_restart(found, [last_restart] if last_restart else [])
    if owed is None:
        return found
    found.interrupted_restart = {"at": owed["at"], "reason": owed.get("reason")}
    found.evidence.append(f"the restart begun at {diagnosis.clock(owed['at'])} ({owed.get('reason')}) stopped "
                          "this run and started no new one: nobody asked for this stop")
    found.advice = "A recovery finishes the restart from the checkpoint (stream_health does so by itself)."
    return found


# -- the warm standby ----------------------------------------------------------------------------------
#: The run statuses whose standby is part of the diagnosis: a stopping or stopped job needs none.
_STANDBY_MATTERS = (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.DEAD)


def wants_standby(run: RunRecord | None) -> bool:
    """Whether ``run`` was launched with ``standby`` on, as the spec its launcher recorded says."""
    try:
        return bool(run and run.spec and json.loads(run.spec).get("standby"))
    except (ValueError, AttributeError):
        return False


def with_standby(found: Diagnosis, run: RunRecord | None, standbys: StandbyLog, thresholds: Thresholds) -> Diagnosis:
    """``found`` with its run's standby noted, where the run wants one and the job is not stopping."""
    if run is None or run.status not in _STANDBY_MATTERS or not wants_standby(run):
        return found
    # its standby heartbeats as the run does: judged by the run's own timeout where that is longer
    judged = replace(thresholds, heartbeat_timeout_s=diagnosis.heartbeat_timeout(run, thresholds))
    return diagnosis.note_standby(found, live_standby(standbys, run.job_id, judged))


def live_standby(standbys: StandbyLog, job_id: str, thresholds: Thresholds,
                 now: float | None = None) -> StandbyRecord | None:
    """The job's warm (or warming) standby, if one lives.  One recorded live whose driver is gone (killed,
    its host lost) is recorded DEAD here, so that it is replaced."""
    found = None
    for record in standbys.live(job_id, role=STANDBY):  # an upgrade's successor is the upgrade's to watch
        gone = standby_gone(record, thresholds, now)
        if gone:
            standbys.end(record.standby_id, StandbyStatus.DEAD, gone)
            log.warning("Standby %s of job %s is gone: %s", record.standby_id, job_id, gone)
        elif found is None:
            found = record
    return found


def standby_gone(record: StandbyRecord, thresholds: Thresholds, now: float | None = None) -> str | None:
    """Why a standby recorded live is not (its process is gone, or it fell silent), or None."""
    now = time.time() if now is None else now
    alive = local_driver.alive_on_this_host(record.pid, record.host, record.started_at)
    if alive is not None:
        return None if alive else f"its driver process (pid {record.pid} on {record.host}) is gone"
    # Warming sends no heartbeat: bounded like a driver's start.  Waiting, it heartbeats.
    limit = thresholds.start_timeout_s if record.status == StandbyStatus.WARMING else thresholds.heartbeat_timeout_s
    age = now - (record.heartbeat_at or record.started_at or now)
    return f"its last heartbeat is {age:.0f}s old (timeout {limit:.0f}s)" if age > limit else None
