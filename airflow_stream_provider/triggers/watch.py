"""The always-on watcher: the trigger behind each stream job's ``AssetWatcher``.

A scheduled DAG with a time-boxed sensor leaves blind windows between its runs.  This trigger runs in
the triggerer for as long as a DAG is scheduled on the job's asset, and turns every transition of a run
into DEAD, STUCK or FAILED into one asset event that carries the diagnosis; the health DAG runs on it.
So does a healthy run that wants a warm standby and has none (NO_STANDBY: after a takeover, or when its
standby died), so that the health DAG starts one at once, and a run that a restart stopped and started
nothing after (INTERRUPTED_RESTART: its launch failed, its task was lost), so that the restart is finished;
likewise a dead or failed run whose restart or reset was begun by a task that Airflow says has ended (lost,
or failed on its last try: the run's own report was spent on it), and a run an upgrade stopped, once
Airflow says the upgrade's task has ended without finishing it.

* One poll, one query: every watcher of the same state database shares one poll loop (Airflow's shared
  streams), which reads the latest run of every job in one state-database query and diagnoses each with
  the shared pure :func:`~airflow_stream_provider.diagnosis.diagnose`.  Each watcher then picks its own
  job out of that snapshot.  A poll that finds a job down reads the latest upgrades too: a second query,
  however many jobs are down.
* Never twice: an event is keyed on (run, health, failure kind).  The key is recorded in the state
  database one poll after the event left the trigger (time for Airflow to store the event), so a condition
  that persists never fires again, not even after a triggerer restart; a triggerer killed in that second
  reports it again rather than never.  A run that leaves the condition (a stuck query that moves again)
  has its report forgotten, so entering it again is a new transition.
* Nothing lost: what was reported lives in the state database, not in memory, so a job that died while
  the triggerer was down is reported when it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_stream_provider import diagnosis, recovery
from airflow_stream_provider.diagnosis import (
    INTERRUPTED_RESTART,
    NO_STANDBY,
    Diagnosis,
    Health,
    Thresholds,
    check_conditions,
    check_seconds,
)
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.health import with_standby
from airflow_stream_provider.lifecycle.holders import task_ended
from airflow_stream_provider.recovery import with_abandoned_upgrade, with_interrupted_restart
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import StandbyLog
from airflow_stream_provider.state.store import HealthReportKey, WatchedJob
from airflow_stream_provider.state.upgrades import UpgradeLog

log = logging.getLogger(__name__)

#: What the watcher reports by default: the conditions that need someone to act.  NO_STANDBY so that a
#: new standby starts at once after a takeover, not at the next sweep; INTERRUPTED_RESTART so that the
#: health DAG finishes the restart, which a STOPPED run would otherwise never get, nor a dead, failed or stuck
#: one whose recovery was lost after its one report.
FIRE_ON = (Health.DEAD.value, Health.STUCK.value, Health.FAILED.value, NO_STANDBY, INTERRUPTED_RESTART)
#: A run's conditions while it waits for a recovery.  One turns into another as Airflow answers about the
#: task that began its restart (and back, when Airflow cannot be asked): each is reported once per run, and
#: none is forgotten for another, or an answer that came and went would report the run again and again.
#: (So a run that goes STUCK, DEAD and STUCK again, judged by heartbeats alone, is reported STUCK once: the
#: DEAD report between brought a recovery already.)
AWAITING_RECOVERY = frozenset({Health.DEAD.value, Health.STUCK.value, Health.FAILED.value, INTERRUPTED_RESTART})
#: How long a task that Airflow said has ended is taken as ended without asking again
ENDED_REMEMBERED_S = 30.0
#: How often Airflow is asked again about a task it said is not over (a recovery backing off or launching)
RUNNING_ASKED_EVERY_S = 5.0


@dataclass
class Snapshot:
    """One poll of the state database: every job's diagnosis, or why there is none."""

    at: float
    diagnoses: dict[str, Diagnosis] = field(default_factory=dict)
    reported: dict[str, set[HealthReportKey]] = field(default_factory=dict)
    error: str | None = None
    #: jobs that could not be diagnosed this poll, and why: the others are watched all the same
    job_errors: dict[str, str] = field(default_factory=dict)


class JobsWatch:
    """The blocking half of the shared poll, run in a thread so the triggerer's event loop stays free."""

    def __init__(self, state_conn_id: str, kafka_conn_id: str, thresholds: Thresholds):
        self.state_conn_id = state_conn_id
        self.state = StreamStateHook(state_conn_id)
        self.kafka = KafkaOffsetsHook(kafka_conn_id)
        self.thresholds = thresholds
        #: when the state database answered again after this watcher last failed to read it
        self.answering_since: float | None = None
        self._away = False
        #: task instances Airflow said have ended, and when it said so (``time.monotonic``)
        self._ended: dict[str, float] = {}
        #: task instances Airflow said have not ended, and when it said so
        self._running: dict[str, float] = {}

    def poll(self) -> Snapshot:
        now = time.time()
        try:
            jobs = self.state.store.watched_jobs()
        except Exception as err:  # the watcher keeps running; the subscribers report the outage once
            self._away = True
            return Snapshot(now, error=f"cannot read the state database of connection {self.state_conn_id!r}: "
                            f"{_one_line(err)}. Health is unknown until it answers again; the watcher keeps "
                            "polling.")
        if self._away:
            self._away, self.answering_since = False, now
        snapshot = Snapshot(now)
        for job in jobs:
            try:  # one job that cannot be diagnosed must not blind the watchers of every other job
                snapshot.diagnoses[job.job_id] = self.diagnose(job, now)
            except Exception as err:
                log.warning("Cannot diagnose job %s", job.job_id, exc_info=True)
                snapshot.job_errors[job.job_id] = (
                    f"cannot diagnose job {job.job_id!r}: {_one_line(err)}. Its health is unknown until this "
                    "clears; the watcher keeps polling, and watches the other jobs all the same.")
                continue
            snapshot.reported[job.job_id] = job.reported
        self._note_abandoned_upgrades(snapshot.diagnoses)
        return snapshot

    def _note_abandoned_upgrades(self, diagnoses: dict[str, Diagnosis]) -> None:
        """Note the restart owed to each job that is down because an upgrade stopped it and its task ended
        in Airflow without finishing or undoing that: nothing else would report it, and the job would stay
        down until a sweep.  One more query, and only in a poll that finds a job down and owed nothing."""
        down = [job_id for job_id, found in diagnoses.items() if recovery.may_owe_for_an_upgrade(found)]
        if not down:
            return
        try:
            upgrades = self.upgrades.leaving_down()
        except Exception as err:  # the diagnoses stand without this fact; the next poll asks again
            log.warning("Could not read the upgrades that leave jobs down: %s", _one_line(err))
            return
        for job_id in down:
            if job_id in upgrades:
                diagnoses[job_id] = with_abandoned_upgrade(diagnoses[job_id], upgrades[job_id], self._task_ended)

    def _task_ended(self, owner: str) -> bool:
        """Whether Airflow says the task instance has ended.  An ended task is not asked about again for a
        while (a cleared one runs again, and moves its upgrade or restart on or ends it), nor one at work
        for a few seconds: a recovery's backoff may last minutes, and the poll runs every second."""
        now = time.monotonic()
        if now - self._ended.get(owner, -math.inf) < ENDED_REMEMBERED_S:
            return True
        if now - self._running.get(owner, -math.inf) < RUNNING_ASKED_EVERY_S:
            return False
        ended = task_ended(owner, log)
        for answers in (self._ended, self._running):  # forget old answers: one entry per task ever asked about
            for stale in [o for o, at in answers.items() if now - at >= ENDED_REMEMBERED_S]:
                del answers[stale]
        (self._ended if ended else self._running)[owner] = now
        return ended

    def diagnose(self, job: WatchedJob, now: float) -> Diagnosis:
        lag = self._lag(job) if diagnosis.lag_matters(job.run, self.thresholds, now) else None
        alive = StreamDriverHook.is_alive(job.run) if job.run else None
        run = job.run
        if run is not None and alive is None and self.answering_since is not None:
            # Judged by heartbeats alone: while the database was away no driver could heartbeat, so silence
            # counts from when it answered again, not from each driver's last heartbeat before the outage.
            run = replace(run, heartbeat_at=max(run.heartbeat_at or 0.0, self.answering_since))
        found = diagnosis.diagnose(job.job_id, run, driver_alive=alive, lag=lag, thresholds=self.thresholds,
                                   now=now)
        if _restart_settled(run, self.thresholds, now):
            found = with_interrupted_restart(found, job.last_restart, self._task_ended)
        return with_standby(found, job.run, self.standbys, self.thresholds)

    @cached_property
    def standbys(self) -> StandbyLog:
        return StandbyLog(self.state.store)

    @cached_property
    def upgrades(self) -> UpgradeLog:
        return UpgradeLog(self.state.store)

    def _lag(self, job: WatchedJob) -> int | None:
        """Kafka records not applied yet; read only for a query idle past ``stuck_after``."""
        try:
            unapplied = self.state.unapplied_from(job.job_id)
            topics = _topics(job.run) or sorted({topic for topic, _ in unapplied})
            return self.kafka.lag(unapplied, topics) if topics else None
        except Exception as err:
            log.warning("Could not read the Kafka lag of job %s: %s", job.job_id, _one_line(err))
            return None

    def close(self) -> None:
        self.state.close()


class StreamJobWatchTrigger(BaseEventTrigger):
    """Report each transition of ``job_id``'s runs into one of ``fire_on`` as an event carrying the
    diagnosis; never again while the condition merely persists.

    For an ``AssetWatcher`` (see :func:`airflow_stream_provider.assets.stream_job_asset`).  Watchers that
    share the state connection and thresholds share one poll loop in the triggerer.
    """

    def __init__(self, *, job_id: str, state_conn_id: str = StreamStateHook.default_conn_name,
                 kafka_conn_id: str = KafkaOffsetsHook.default_conn_name, fire_on: Sequence[str] = FIRE_ON,
                 heartbeat_timeout: float = 30.0, stuck_after: float = 300.0, poll_interval: float = 1.0):
        super().__init__()
        check_conditions(fire_on, FIRE_ON, "the watcher reports")
        check_seconds(heartbeat_timeout=heartbeat_timeout, stuck_after=stuck_after, poll_interval=poll_interval)
        self.job_id = job_id
        self.state_conn_id = state_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.fire_on = list(fire_on)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.stuck_after = float(stuck_after)
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "job_id": self.job_id, "state_conn_id": self.state_conn_id, "kafka_conn_id": self.kafka_conn_id,
            "fire_on": self.fire_on, "heartbeat_timeout": self.heartbeat_timeout,
            "stuck_after": self.stuck_after, "poll_interval": self.poll_interval})

    # -- one poll for every watcher of the same database --------------------------------------------------
    def shared_stream_key(self) -> Hashable:
        return ("stream-job-watch", self.state_conn_id, self.kafka_conn_id, self.heartbeat_timeout,
                self.stuck_after, self.poll_interval)

    @classmethod
    async def open_shared_stream(cls, kwargs: dict[str, Any]) -> AsyncIterator[Snapshot]:
        watch = JobsWatch(kwargs["state_conn_id"], kwargs["kafka_conn_id"],
                          Thresholds(kwargs["heartbeat_timeout"], kwargs["stuck_after"]))
        try:
            while True:
                yield await asyncio.to_thread(watch.poll)
                await asyncio.sleep(kwargs["poll_interval"])
        finally:
            watch.close()

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Snapshot]) -> AsyncIterator[TriggerEvent]:
        reporter = _Reporter(self.job_id, self.fire_on)
        state = StreamStateHook(self.state_conn_id)  # its engine is built on the first report only
        try:
            async for snapshot in shared_stream:
                if reporter.unrecorded:  # fired one poll ago: Airflow has stored those events by now
                    await asyncio.to_thread(reporter.record, state)
                for payload in reporter.events(snapshot):
                    (self.log.error if payload["status"] == "error" else self.log.warning)(
                        "%s", payload["message"])
                    yield TriggerEvent(payload)
        finally:
            state.close()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Standalone (a triggerer without shared streams, or a test): the same poll, one subscriber."""
        async for event in self.filter_shared_stream(self.open_shared_stream(self.serialize()[1])):
            yield event


class _Reporter:
    """One watcher's memory between polls: what it fired and has not recorded yet, and which error it
    already reported.  Pure apart from ``record``."""

    def __init__(self, job_id: str, fire_on: Sequence[str]):
        self.job_id = job_id
        self.fire_on = set(fire_on)
        self.fired: set[HealthReportKey] = set()
        #: reports to persist (with their message) or to forget (None), one poll after they were decided
        self.unrecorded: list[tuple[HealthReportKey, str | None]] = []
        self.error: str | None = None

    def events(self, snapshot: Snapshot) -> list[dict[str, Any]]:
        if snapshot.error or self.job_id not in snapshot.diagnoses:
            error = snapshot.error or snapshot.job_errors.get(self.job_id) or (
                f"job {self.job_id!r} is unknown to the state database: no run of it was ever recorded. "
                "Check the job id of this watcher against the job's spec, or deploy the job; the watcher "
                "keeps polling and reports the job once it runs.")
            first = error != self.error
            self.error = error
            return [{"status": "error", "job_id": self.job_id, "message": error, "at": snapshot.at}] if first else []
        if self.error:
            log.info("Watching job %s again: %s", self.job_id, "the state database answers")
            self.error = None
        found = snapshot.diagnoses[self.job_id]
        condition = found.condition
        key = HealthReportKey(found.run_id or "", condition, found.failure_kind.value if found.failure_kind else "")
        # The run left a reported condition (a STUCK query moving again, a slow start that was not a
        # death): forget it, so that entering it again is a new transition.
        reported = snapshot.reported.get(self.job_id, set()) | self.fired
        for stale in sorted(k for k in reported if k.run_id == key.run_id and k != key
                            and not (k.health in AWAITING_RECOVERY and condition in AWAITING_RECOVERY)):
            self.fired.discard(stale)
            self.unrecorded.append((stale, None))
        if condition not in self.fire_on or key in reported:
            return []
        self.fired.add(key)
        self.unrecorded.append((key, found.summary()))
        return [{"status": "fired", "job_id": self.job_id, "message": found.summary(),
                 "diagnosis": found.to_dict(), "at": snapshot.at}]

    def record(self, state: StreamStateHook) -> None:
        """Persist what was fired (and forget what was left), in order; what cannot be written now
        (database away) is tried at the next poll."""
        pending, self.unrecorded = self.unrecorded, []
        for position, (key, message) in enumerate(pending):
            try:
                if message is None:
                    state.store.forget_health_report(self.job_id, key)
                else:
                    state.store.record_health_report(self.job_id, key, message)
            except Exception as err:
                log.warning("Could not update the report %s of job %s yet: %s", key, self.job_id, _one_line(err))
                self.unrecorded = pending[position:] + self.unrecorded
                return


def _topics(run: RunRecord | None) -> list[str]:
    """The topics a run reads, from the spec its launcher recorded."""
    try:
        return list(json.loads(run.spec)["kafka"]["topics"]) if run and run.spec else []
    except (ValueError, KeyError, TypeError):
        return []


def _restart_settled(run: RunRecord | None, thresholds: Thresholds, now: float) -> bool:
    """Whether a restart that stopped ``run`` has had time to launch its new run.  A restart records its
    new run at the launch, after its task resumes from the stop's wait (seconds on a busy Airflow): a run
    ended less than a heartbeat timeout ago is taken for a restart under way, not an interrupted one."""
    return run is None or run.ended_at is None or now - run.ended_at >= thresholds.heartbeat_timeout_s


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"
