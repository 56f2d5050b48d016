"""The facts behind a health verdict, gathered one way for every caller: the sensors and their trigger,
the always-on DAG's fresh diagnosis, and the controller before it decides a recovery."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property, partial

from airflow_stream_provider import diagnosis, local_driver, recovery
from airflow_stream_provider.diagnosis import Diagnosis, Thresholds
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.holders import task_ended
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.state.standbys import STANDBY, StandbyLog, StandbyRecord, StandbyStatus
from airflow_stream_provider.state.upgrades import UpgradeLog

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
        Kafka lag (only worth reading while the query runs: it is the evidence for STUCK).  A run whose
        process is found gone is recorded DEAD."""
        run = self.state.latest_run(self.job_id)
        lag = None
        if run and run.status == "RUNNING":
            try:
                lag = self.kafka.lag(self.state.unapplied_from(self.job_id), self.topics)
            except Exception as err:  # the verdict stands without the lag; STUCK needs it
                log.warning("Could not read the Kafka lag of job %s: %r", self.job_id, err)
        alive = StreamDriverHook.is_alive(run) if run else None
        found = diagnosis.diagnose(self.job_id, run, driver_alive=alive, lag=lag, thresholds=self.thresholds)
        if alive is False:  # the process is gone: recorded.  Silence alone (a process this host cannot see)
            # may be a long pause: recorded, the run would stay DEAD when it heartbeats again, and a stop
            # would find nothing to stop; the restart that acts on the verdict records it (``before_restart``)
            self.state.record_death(run, found)
        if found.health in recovery.MAY_BE_OWED:  # only a run down or stuck can be owed a restart
            ended = partial(task_ended, log=log)
            found = recovery.with_interrupted_restart(found, self.state.store.latest_restart(self.job_id), ended)
            upgrade = (self.upgrades.leaving_down(self.job_id).get(self.job_id)
                       if recovery.may_owe_for_an_upgrade(found) else None)
            found = recovery.with_abandoned_upgrade(found, upgrade, ended)
        return run, with_standby(found, run, self.standbys, self.thresholds)

    @cached_property
    def standbys(self) -> StandbyLog:
        return StandbyLog(self.state.store)

    @cached_property
    def upgrades(self) -> UpgradeLog:
        return UpgradeLog(self.state.store)

    def close(self) -> None:
        self.state.close()


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
