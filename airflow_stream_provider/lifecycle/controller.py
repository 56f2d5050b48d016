"""The lifecycle controller: every step of a stream job's life, composed from the hooks.

Operators, sensors, triggers and the CLI call it; an operator is its arguments plus calls to these steps.
No step here waits: each does its work and, where a driver must get somewhere first, returns a
:class:`~airflow_stream_provider.lifecycle.waits.RunWait` that the operator hands to a trigger (deferrable) or
blocks on (``deferrable=False``).  So the same steps run in the worker before and after a deferral.

Steps: launch (submit, then wait until the query runs), graceful stop with escalation (stop marker, then
SIGTERM, then kill), restart from the checkpoint, reset to a new generation from the stored offsets, and
the facts the recovery and upgrade rules decide on (the diagnosis, the resume point, the recorded launch).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException

from airflow_stream_provider import diagnosis, faults, kafka_offsets, local_driver
from airflow_stream_provider.diagnosis import Diagnosis, Health, Thresholds
from airflow_stream_provider.hooks.checkpoint import CheckpointHook
from airflow_stream_provider.hooks.driver import StreamDriverHook, SubmittedDriver
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.kafka_offsets import LostRange, Offsets
from airflow_stream_provider.lifecycle.driver_log import log_tail
from airflow_stream_provider.lifecycle.health import HealthProbe, live_standby, standby_gone
from airflow_stream_provider.lifecycle.killed import end_unregistered
from airflow_stream_provider.lifecycle.waits import DATABASE_OUTAGE, Outcome, RunWait, RunWatch
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.clock import DatabaseClock
from airflow_stream_provider.state.leases import Lease, LeaseLog
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.state.standbys import (
    STANDBY,
    SUCCESSOR,
    StandbyLog,
    StandbyRecord,
    StandbyStatus,
)
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradeRecord

#: The stop's escalation: after the stop marker, SIGTERM, then a kill; each waits for the driver to end.
STOP_STAGES = ("marker", "terminate", "kill")
#: ``ensure_standby``'s actions when no standby is started: too many died warming up, or its start failed
WITHHELD = "withheld"
NOT_STARTED = "not started"
#: Standbys that died warming up, one after another within ``STANDBY_FAILURE_WINDOW_S``, after which no
#: other is started: each would die the same way, and each death is reported and answered with another.
STANDBY_FAILURES_MAX = 3
STANDBY_FAILURE_WINDOW_S = 1800.0


class StreamJobError(Exception):
    """A failure Airflow's retries may fix (broker or database briefly away)."""


class StreamJobController:
    """One job's lifecycle steps, over its hooks.  ``spec`` is the validated job spec with today's brokers
    and database filled in."""

    def __init__(self, spec: StreamJobSpec, *, state: StreamStateHook, kafka: KafkaOffsetsHook,
                 driver: StreamDriverHook, checkpoint_conn_id: str | None = None,
                 thresholds: Thresholds | None = None, log: logging.Logger | None = None):
        self.spec = spec
        self.state, self.kafka, self.driver = state, kafka, driver
        self.checkpoint_conn_id = checkpoint_conn_id
        self.thresholds = thresholds or Thresholds()
        self.log = log or logging.getLogger(__name__)

    @property
    def clock(self) -> DatabaseClock:
        """The state database's clock, which a wait's deadline is by (``state.clock``)."""
        return self.state.store.clock

    @cached_property
    def checkpoints(self) -> CheckpointHook:
        return CheckpointHook(self.spec.checkpoint_root, self.checkpoint_conn_id)

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    # -- facts -----------------------------------------------------------------------------------------
    @cached_property
    def probe(self) -> HealthProbe:
        return HealthProbe(self.job_id, self.spec.kafka.topics, self.state, self.kafka, self.thresholds)

    def diagnose(self) -> Diagnosis:
        """The job's health as every sensor sees it (``HealthProbe``: a dead run is recorded DEAD), and a
        lost checkpoint named."""
        run, found = self.probe.observe()
        if found.health.needs_action and run is not None and run.last_batch_id is not None:
            found.evidence.extend(self._lost_checkpoint(run))
        if self.spec.standby and found.standby is None and found.health != Health.STOPPED:
            # the run was launched without one, and this spec asks for one: say so
            diagnosis.note_standby(found, self.live_standby())
        return found

    def _lost_checkpoint(self, run: RunRecord) -> list[str]:
        """A run that committed batches on a generation whose checkpoint now holds none: the checkpoint was
        lost (deleted, or a restore missed it).  A restart still resumes exactly from the stored offsets,
        and the diagnosis says why Spark starts over."""
        try:
            path = self.checkpoints.generation_path(run.job_id, run.generation)
            if self.checkpoints.has_checkpoint(path):
                return []
        except Exception as err:  # the diagnosis stands without this fact
            self.log.warning("Could not check the checkpoint of run %s: %r", run.run_id, err)
            return []
        return [f"the checkpoint of generation {run.generation} ({path}) holds no batch although run "
                f"{run.run_id} committed up to batch {run.last_batch_id}: it was lost; a restart resumes "
                f"from the stored offsets"]

    def live_run(self) -> RunRecord | None:
        """The latest run if its driver is alive (by process check or fresh heartbeat)."""
        run = self.state.latest_run(self.job_id)
        return run if run is not None and self._still_there(run, self.driver.is_alive(run)) else None

    def _still_there(self, run: RunRecord, alive: bool | None) -> bool:
        """``run`` is active and its driver alive, by the process check or a fresh heartbeat."""
        if not run.active:
            return False
        found = diagnosis.diagnose(run.job_id, run, driver_alive=alive, lag=None, thresholds=self.thresholds)
        return found.health != Health.DEAD

    def get_run(self, run_id: str) -> RunRecord | None:
        return self.state.store.get_run(run_id)

    def latest_upgrade(self) -> UpgradeRecord | None:
        """The job's latest upgrade, finished or not (``recovery.upgrade_in_charge`` says if it acts now)."""
        return UpgradeLog(self.state.store).latest(self.job_id)

    # -- the job's lease: one task at a time acts on the job (``state.leases``) --------------------------
    @cached_property
    def leases(self) -> LeaseLog:
        return LeaseLog(self.state.store)

    def take_lease(self, owner: str, action: str, until: float,
                   launch: Mapping[str, Any] | None = None) -> Lease | None:
        """Hold the job's lease for ``owner`` until ``until``, waiting on ``launch``; None once held, else the
        other holder's."""
        return self.leases.take(self.job_id, owner, action, until, launch)

    def lease(self) -> Lease | None:
        """The job's lease as it stands (held, or run out and not taken since), if any."""
        return self.leases.get(self.job_id)

    def lease_since(self, owner: str) -> float | None:
        """When ``owner``'s hold on the job's lease began (None unless it holds it)."""
        held = self.lease()
        return held.taken_at if held is not None and held.owner == owner else None

    def release_lease(self, owner: str) -> None:
        self.leases.release(self.job_id, owner)

    def caught_up(self) -> bool:
        return caught_up(self.state, self.kafka, self.job_id, self.spec.kafka.topics)

    def recorded_launch(self, run: RunRecord | None,
                        application: str | None = None) -> tuple[str, StreamJobSpec] | None:
        """The job file and spec a run was launched with (recorded once its query ran), with today's
        brokers and database: a restart or a rollback starts exactly the code that ran, not whatever the
        DAG's arguments say now."""
        application = application or (run and run.application)
        if not application or run is None:
            return None
        if not run.spec:
            return application, replace(self.spec, version=run.version)
        recorded = json.loads(run.spec)
        recorded["kafka"]["bootstrap_servers"] = self.spec.kafka.bootstrap_servers
        recorded.update(database_url=self.spec.database_url, dry_run=False)
        return application, StreamJobSpec.from_dict(recorded)

    def resume_point(self, job: StreamJobSpec, *,
                     allow_data_loss: bool = False) -> tuple[Offsets, list[LostRange]]:
        """Where a new generation resumes, checked against Kafka (invariant 5), and the ranges of it Kafka
        no longer holds; fails on loss unless allowed, and then resumes past the loss.

        The stored offsets, for every topic the sink accounts for (a second stream's too).  A partition
        no batch ever committed resumes where the last generation began, not at the spec's default:
        with ``latest`` that would skip everything since.
        """
        resume = self.state.unapplied_from(job.job_id)
        if not resume:
            return {}, []
        topics = sorted(set(job.kafka.topics) | {topic for topic, _ in resume})
        earliest, latest = self.kafka.watermarks(topics)
        lost = kafka_offsets.find_lost_ranges(resume, earliest, latest)
        if lost and not allow_data_loss:
            raise AirflowFailException(
                f"job {job.job_id}: cannot resume from the stored offsets {kafka_offsets.to_spark_json(resume)}: "
                + "; ".join(r.describe() for r in lost)
                + ". Nothing was archived or started. Restore the data, or rerun with allow_data_loss=True "
                "to accept the loss.")
        # Past an accepted loss: below retention, or on a log that went backwards (a recreated topic: all it
        # holds is unread), from the earliest offset Kafka has, as the Python source does with
        # failOnDataLoss=false; a partition that is gone is dropped.
        return {tp: off if earliest[tp] <= off <= latest[tp] else earliest[tp]
                for tp, off in resume.items() if tp in latest}, lost

    # -- launching -------------------------------------------------------------------------------------
    def check_before_start(self, spec: StreamJobSpec) -> None:
        """What would make a driver fail at once, checked from here before one is started: a standby the
        Spark connection cannot give, the brokers, the topics, a local checkpoint root's permissions."""
        if spec.standby:
            try:
                self.driver.check_standby()
            except ValueError as err:
                raise AirflowFailException(f"{err}; nothing was started") from None
        try:
            _, latest = self.kafka.watermarks(spec.kafka.topics)
        except Exception as err:
            raise StreamJobError(
                f"job {spec.job_id}: cannot read the partitions of {list(spec.kafka.topics)} from "
                f"{spec.kafka.bootstrap_servers} (connection {self.kafka.kafka_conn_id!r}): {err!r}. Check "
                "the connection's brokers and that they are up; nothing was started") from None
        missing = sorted(set(spec.kafka.topics) - {topic for topic, _ in latest})
        if missing:
            raise AirflowFailException(
                f"job spec field 'kafka.topics': topics {missing} do not exist on {spec.kafka.bootstrap_servers}. "
                "Create them (the job does not create topics) or fix the spec; nothing was started")
        root = spec.checkpoint_root.removeprefix("file://")
        if root.startswith("hdfs://"):
            self._check_webhdfs(spec)
        elif "://" not in root:
            existing = Path(root)
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent
            if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
                raise AirflowFailException(
                    f"job spec field 'checkpoint_root': {spec.checkpoint_root} is not writable here ({existing} "
                    "is not a writable directory). Give the Airflow and Spark users write access, or choose another "
                    "root; nothing was started")

    def _check_webhdfs(self, spec: StreamJobSpec) -> None:
        """An HDFS root's resets, upgrades and archives go through WebHDFS: a connection that is missing or
        names no host is found now, not at the job's first reset, in an incident maybe.  No request is made:
        a NameNode that is away for a while must not hold up a restart, which Spark's own client serves."""
        conn_id = self.checkpoints.checkpoint_conn_id
        try:
            _ = self.checkpoints.webhdfs_client
        except (AirflowNotFoundException, ValueError) as err:
            raise AirflowFailException(
                f"job spec field 'checkpoint_root': {spec.checkpoint_root} is on HDFS, which the provider reaches "
                f"through WebHDFS for resets, upgrades and archives, but {err}. Create the connection "
                f"{conn_id!r} (type stream_checkpoint: the NameNode's WebHDFS host and port) or pass "
                "checkpoint_conn_id; nothing was started") from None

    def submit(self, application: str, spec: StreamJobSpec, *, generation: int | None = None,
               starting_offsets: str | None = None) -> dict[str, Any]:
        """Start a driver for ``spec`` on ``generation`` (default: the current one) and return the launch at
        once; :meth:`ready_wait` says what to wait for, :meth:`finish_launch` what came of it."""
        generation = generation or self.state.current_generation(spec.job_id)
        self.check_before_start(spec)  # the brokers first: the resume point below asks them too
        if starting_offsets is None and generation > 1 and self.state.store.get_generation(spec.job_id,
                                                                                          generation) is None:
            # Every earlier generation is archived and this one never started: a reset (a person's, or an
            # upgrade's) ended between its archive and its launch, and a restart or a deploy carries on.  The
            # generation starts where the results end, as that reset would have, not at the spec's earliest
            # (a replay of the whole topic) or latest (a gap the sink refuses as lost records).
            resume, _ = self.resume_point(spec)
            starting_offsets = kafka_offsets.to_spark_json(resume) if resume else None
        spec = spec.with_generation(generation, starting_offsets)
        return {**self._submitted(application, spec, uuid.uuid4().hex), "generation": generation, "version": spec.version,
                "application": application, "spec": spec.to_json(), "checkpoint_path": spec.checkpoint_path}

    def submit_dry_run(self, application: str, spec: StreamJobSpec) -> dict[str, Any]:
        return self._submitted(application, spec, uuid.uuid4().hex)

    def _submitted(self, application: str, spec: StreamJobSpec, run_id: str) -> dict[str, Any]:
        """Start the driver; what a launch wait and ``abandon`` need of it (its pid is this host's)."""
        submitted = self.driver.submit(application, spec, run_id, self.state.password,
                                       kafka_secrets=self.spec.kafka.secret_options)
        return {"job_id": spec.job_id, "run_id": run_id, "pid": submitted.pid, "host": local_driver.this_host(),
                "log_path": submitted.log_path, "submission_id": submitted.submission_id,
                "submitted_at": time.time()}

    def launch_wait(self, launch: dict[str, Any], until: str, timeout: float, **extra: Any) -> RunWait:
        return RunWait.within(timeout, self.clock.now(), run_id=launch["run_id"], job_id=launch["job_id"],
                              until=until, pid=launch.get("pid"), host=launch.get("host"),
                              started_at=launch.get("submitted_at"), log_path=launch.get("log_path"), **extra)

    def finish_launch(self, launch: dict[str, Any], outcome: Outcome, timeout: float) -> dict[str, Any]:
        """The launch's result once its query runs; else the driver's own evidence, as the error a retry
        may fix (StreamJobError) or not (AirflowFailException)."""
        spec = StreamJobSpec.from_dict(json.loads(launch["spec"]))
        if outcome == "ready":
            run = self.get_run(launch["run_id"])
            self.state.store.record_launch(launch["run_id"], launch["application"], launch["spec"],
                                           launch.get("submission_id"))
            if run.active:
                self.log.info("Job %s run %s is running: generation %s, epoch %s", spec.job_id, launch["run_id"],
                              launch["generation"], run.epoch)
            else:  # its query ran, so the launch worked; what ended the run is the health check's to act on
                self.log.warning("Job %s run %s started its query (generation %s, epoch %s) and has ended since: "
                                 "%s%s. The launch is done; the health check diagnoses the run (`python -m "
                                 "airflow_stream_provider status`)", spec.job_id, launch["run_id"],
                                 launch["generation"], run.epoch, run.status.value,
                                 f", {run.failure_kind}: {run.termination_message}" if run.failure_kind else "")
            return {"job_id": spec.job_id, "run_id": launch["run_id"], "epoch": run.epoch,
                    "generation": launch["generation"], "version": spec.version,
                    "checkpoint_path": launch["checkpoint_path"], "pid": launch["pid"],
                    "log_path": launch["log_path"], "submission_id": launch["submission_id"]}
        if outcome == "ended":
            raise self.start_failure(spec.job_id, launch["log_path"], self.get_run(launch["run_id"]))
        raise StreamJobError(f"job {spec.job_id} run {launch['run_id']}: the query did not start within "
                             f"{timeout:.0f}s. Driver log: {launch['log_path']}")

    def start_failure(self, job_id: str, log_path: str | None, run: RunRecord | None) -> Exception:
        tail = log_tail(log_path, secrets=[self.state.password])
        if run is None:
            return StreamJobError(f"job {job_id}: the driver exited before registering its run "
                                  f"(state database unreachable, or bad arguments). Driver log "
                                  f"{log_path}:\n{tail}")
        found = diagnosis.diagnose(job_id, run, driver_alive=False, lag=None)
        message = (f"job {job_id} run {run.run_id} did not start: {found.summary()}. "
                   f"What to do: {found.advice} Driver log {log_path}:\n{tail}")
        if found.failure_kind is not None and found.failure_kind.retryable:
            return StreamJobError(message)
        return AirflowFailException(message)

    def abandon(self, launch: Mapping[str, Any], why: str) -> None:
        """End a driver this task started and no longer wants (a killed task, a dry run): kill it outright
        and record the run as DEAD, so nothing waits on it.  Before it registers, only its own host can.

        A kill that fails (the cluster manager refuses, or cannot be reached) leaves the run as it is: a
        driver that lives on is then the job's run, and one that is gone falls silent and is found DEAD, so a
        recovery restarts it.  Recorded DEAD at once, a recovery could start a second driver beside it."""
        run = self.get_run(launch["run_id"])
        if run is None and end_unregistered(self.state.store, launch, why, self.log, self.driver.kill_submission):
            return
        run = run or self.get_run(launch["run_id"])  # registered meanwhile: ended as a run
        if run is not None and run.active:
            # not recorded before its ready
            run = replace(run, submission_id=run.submission_id or launch.get("submission_id"))
            killed = self.driver.kill(run)
            if killed.done:
                self.log.warning("Killed run %s: %s (%s)", run.run_id, why, killed)
                self.state.store.mark_dead(run.run_id, f"abandoned: {why}")
            else:
                self.log.error("Run %s of job %s could not be killed (%s): %s. It is left as it is: live while "
                               "its driver heartbeats, found DEAD and recovered once it falls silent",
                               run.run_id, run.job_id, why, killed)

    # -- the warm standby ------------------------------------------------------------------------------
    @property
    def standbys(self) -> StandbyLog:
        return self.probe.standbys

    def live_standby(self) -> StandbyRecord | None:
        """The job's warm (or warming) standby, if one lives (a vanished one is recorded DEAD)."""
        return live_standby(self.standbys, self.job_id, self.standby_thresholds)

    @cached_property
    def standby_thresholds(self) -> Thresholds:
        """A standby heartbeats as the job's spec says: a spec that heartbeats slowly is judged by its own,
        longer timeout, as its runs are (``diagnosis.heartbeat_timeout``)."""
        return replace(self.thresholds, heartbeat_timeout_s=max(self.thresholds.heartbeat_timeout_s,
                                                                 self.spec.heartbeat_timeout_seconds))

    def ensure_standby(self, application: str | None) -> dict[str, Any] | None:
        """Start a standby for the job's live run unless one is warm already (``spec.standby``): with the code
        and spec the live run was launched with, on its generation.  None when the job wants none or does
        not run."""
        if not self.spec.standby:
            return None
        live = self.live_standby()
        if live is not None:
            return {"standby_id": live.standby_id, "status": live.status.value, "action": "kept"}
        run = self.live_run()
        if run is None or run.status == RunStatus.STOPPING:
            return None
        recorded = self.recorded_launch(run, application)
        if recorded is None:
            self.log.warning("No standby for job %s: run %s recorded no launch and no application was given",
                             self.job_id, run.run_id)
            return None
        application, spec = recorded
        withheld = self.standby_withheld()
        if withheld:
            self.log.error("%s", withheld)
            return {"standby_id": None, "status": None, "action": WITHHELD, "why": withheld}
        spec = replace(spec, standby=True).with_generation(run.generation)
        try:
            standby_id, submitted = self._start_standby(application, spec, STANDBY)
        except Exception as err:  # the run it stands by for runs: a task that launched it must not fail now
            why = f"job {self.job_id}: no standby was started: {err}"
            self.log.error("%s", why, exc_info=True)
            return {"standby_id": None, "status": None, "action": NOT_STARTED, "why": why}
        self.log.info("Started standby %s for run %s of job %s (version %s, generation %s)", standby_id,
                      run.run_id, self.job_id, spec.version, run.generation)
        return {"standby_id": standby_id, "status": StandbyStatus.WARMING.value, "action": "started",
                "pid": submitted.pid, "log_path": submitted.log_path}

    def standby_withheld(self, now: float | None = None) -> str | None:
        """Why no standby is started, with the last one's evidence, where the job's latest standbys all died
        warming up: the loop of a standby dying, the watcher reporting NO_STANDBY and a recovery starting the
        next one stops there."""
        now = time.time() if now is None else now
        died = standby_failures(self.standbys.recent(self.job_id, STANDBY_FAILURES_MAX * 2), now)
        if len(died) < STANDBY_FAILURES_MAX:
            return None
        last = died[0]
        return (
            f"job {self.job_id}: its last {len(died)} standbys died while warming up, the latest "
            f"{now - (last.ended_at or now):.0f}s ago ({last.message or 'no reason recorded'}); no other is "
            f"started before {STANDBY_FAILURE_WINDOW_S / 60:.0f} min have passed since the first. The job runs "
            f"without one. Read the standby's log ({last.log_path}): a standby needs its own ports and "
            "memory beside the active driver (a fixed spark.driver.port or spark.ui.port cannot be shared)")

    def _start_standby(self, application: str, spec: StreamJobSpec, role: str) -> tuple[str, SubmittedDriver]:
        """Submit a standby or successor driver and record it WARMING at once, under the launcher's process,
        so the watcher and the next health check see it warming from this moment on, not missing and to be
        started again; the driver takes the row over when it registers."""
        standby_id = uuid.uuid4().hex
        submitted = self.driver.submit(application, spec, standby_id, self.state.password,
                                       kafka_secrets=self.spec.kafka.secret_options,
                                       standby=role == STANDBY, successor=role == SUCCESSOR)
        self.standbys.register(standby_id, self.job_id, spec.version, spec.generation, host=local_driver.this_host(),
                               pid=submitted.pid, log_path=submitted.log_path, role=role)
        return standby_id, submitted

    def standby_launch(self, standby: StandbyRecord, failed: RunRecord | None,
                       application: str | None) -> dict[str, Any] | None:
        """The standby as a launch whose run id is already known (a standby takes over under its own id):
        what ``launch_wait`` and ``finish_launch`` take."""
        recorded = self.recorded_launch(failed, application)
        if recorded is None:
            return None
        application, spec = recorded
        spec = replace(spec, standby=True).with_generation(standby.generation or 1)
        return {"job_id": self.job_id, "run_id": standby.standby_id, "generation": spec.generation,
                "version": spec.version, "application": application, "spec": spec.to_json(),
                "checkpoint_path": spec.checkpoint_path, "pid": standby.pid, "host": standby.host,
                "log_path": standby.log_path, "submission_id": None, "submitted_at": standby.started_at}

    # -- an upgrade's warm successor ------------------------------------------------------------------
    def start_successor(self, application: str, spec: StreamJobSpec) -> dict[str, Any]:
        """Start the new version's driver warming up beside the old one (``UpgradeStreamingJobOperator``
        with ``prewarm``); it starts its query only once :meth:`release_successor` lets it."""
        try:
            self.driver.check_standby()
        except ValueError as err:
            raise AirflowFailException(f"prewarm: {err}; or upgrade without prewarm. Nothing was started.") from None
        standby_id, submitted = self._start_standby(application, spec, SUCCESSOR)
        self.log.info("Started successor %s of job %s: version %s warms up while the old version runs",
                      standby_id, self.job_id, spec.version)
        return {"standby_id": standby_id, "application": application, "spec": spec.to_json(),
                "pid": submitted.pid, "log_path": submitted.log_path, "submitted_at": time.time()}

    def release_successor(self, successor: dict[str, Any], generation: int,
                          starting_offsets: str | None) -> dict[str, Any] | None:
        """Let the warm successor start on ``generation`` (the old run has stopped): the launch to wait for,
        as :meth:`launch_wait` and :meth:`finish_launch` take it; None when the successor is gone (then the
        upgrade starts the new version cold)."""
        record = self.standbys.get(successor["standby_id"])
        gone = "it is not recorded" if record is None else (
            f"it is {record.status.value}" if not record.status.live else standby_gone(record, self.standby_thresholds))
        if gone:
            self.log.warning("Successor %s of job %s cannot start: %s", successor["standby_id"], self.job_id, gone)
            if record is not None and record.status.live:
                self.standbys.end(record.standby_id, StandbyStatus.DEAD, gone)
            return None
        epoch = self.state.store.current_epoch(self.job_id) or 0
        if not self.standbys.release(record.standby_id, generation, starting_offsets, epoch):
            return None
        spec = StreamJobSpec.from_dict(json.loads(successor["spec"])).with_generation(generation, starting_offsets)
        self.log.info("Released successor %s of job %s: version %s on generation %s (%s)", record.standby_id,
                      self.job_id, spec.version, generation, record.status.value.lower())
        return {"job_id": self.job_id, "run_id": record.standby_id, "generation": generation, "version": spec.version,
                "application": successor["application"], "spec": spec.to_json(),
                "checkpoint_path": spec.checkpoint_path, "pid": record.pid, "host": record.host,
                "log_path": record.log_path, "submission_id": None, "submitted_at": record.started_at}

    def end_successor(self, successor: dict[str, Any] | None, why: str) -> None:
        if successor and self.standbys.end(successor["standby_id"], StandbyStatus.ENDED, why):
            self.log.info("Asked successor %s of job %s to end: %s", successor["standby_id"], self.job_id, why)

    def end_standbys(self, why: str) -> list[str]:
        """End the job's standbys (a graceful stop of the job: nothing to stand by for)."""
        ended = self.standbys.end_all(self.job_id, why)
        if ended:
            self.log.info("Asked standbys %s of job %s to end: %s", ended, self.job_id, why)
        return ended

    # -- stopping --------------------------------------------------------------------------------------
    def stop_step(self, run_id: str, stage: str, timeout: float) -> RunWait:
        """One stage of a graceful stop: the stop marker, then SIGTERM, then a kill; wait for the end."""
        run = self.get_run(run_id)
        if stage == "marker":
            self.state.store.request_stop(run_id)
            self.log.info("Asked run %s of job %s to stop; waiting up to %ss", run_id, run.job_id, timeout)
        elif stage == "terminate":
            sent = self.driver.terminate(run)
            self.log.warning("Run %s did not stop in time: %s", run_id, "sent SIGTERM" if sent else
                             f"no SIGTERM can reach it from {local_driver.this_host()} (it runs on {run.host}, on a "
                             "cluster, or is gone); the kill comes next")
        else:
            killed = self.driver.kill(run)
            self.log.warning("Run %s ignored SIGTERM: %s", run_id, killed)
            # A cluster run's row is trusted dead after a kill (``finish_stop``): not after a refused one.
            if not killed.done and run.submission_id and self._still_there(run, None):
                raise StreamJobError(
                    f"job {run.job_id} run {run_id} did not stop: it ignored the stop marker (a cluster driver "
                    f"cannot be signalled from here), and {killed}. Nothing was started beside it; once it has "
                    "ended, retry this task")
        return RunWait.within(timeout, self.clock.now(), run_id=run_id, job_id=run.job_id, until="ended",
                              pid=run.pid, host=run.host, started_at=run.started_at)

    def finish_stop(self, run_id: str, outcome: str, started: float) -> dict[str, Any]:
        """``outcome``: stopped | terminated | killed: how far the escalation went."""
        final = self.get_run(run_id)
        alive = self.driver.is_alive(final)
        if final.active and alive is False:
            # Gone without recording an end: it died during the stop (or was killed).
            outcome = "died" if outcome == "stopped" else outcome
            self.state.store.mark_dead(run_id, f"driver gone during a graceful stop ({outcome})")
            final = self.get_run(run_id)
        elif outcome == "killed" and (alive or not final.submission_id) and self._still_there(final, alive):
            # Still there after the kill: alive here, or on another host, where nothing here could signal it
            # and its heartbeat is still fresh.  Whatever comes next (a restart, a reset, an upgrade's new
            # version) must not start a second driver beside it.
            where = "is still alive" if alive else f"cannot be signalled from {local_driver.this_host()}"
            raise StreamJobError(
                f"job {final.job_id} run {run_id} did not stop: its driver (pid {final.pid} on {final.host}) "
                f"ignored the stop marker, {where}, and its heartbeat is "
                f"{time.time() - (final.heartbeat_at or final.started_at or time.time()):.0f}s old. Kill it on "
                f"{final.host} (kill -9 -- -{final.pid}), then retry this task; nothing was started beside it")
        return {"job_id": final.job_id, "run_id": run_id, "outcome": outcome, "exit_code": final.exit_code,
                "status": final.status.value, "seconds": round(time.time() - started, 1)}

    # -- the two recovery actions, around their launch --------------------------------------------------
    def before_restart(self, reason: str, failed_run_id: str | None) -> None:
        if failed_run_id and self.state.store.mark_dead(failed_run_id, f"found dead: {reason}"):
            self.log.info("Recorded run %s as DEAD", failed_run_id)

    def before_reset(self, job: StreamJobSpec, reason: str, *, allow_data_loss: bool) -> dict[str, Any]:
        """Archive the current generation and decide where generation n+1 starts: the stored offsets,
        checked against Kafka (invariant 5); fails on offsets Kafka no longer holds unless
        ``allow_data_loss``, which records the accepted loss with the offsets it moves."""
        resume, lost = self.resume_point(job, allow_data_loss=allow_data_loss)
        generation = self.state.current_generation(job.job_id)
        archive_path = None
        found = self.checkpoints.list_generations(job.job_id)
        active = {g.generation for g in found if not g.archived}
        archives = [g.path for g in found if g.archived and g.generation == generation]
        if generation in active:
            archive_path = self.checkpoints.archive_generation(job.job_id, generation)
            self.state.mark_archived(job.job_id, generation, archive_path, reason)
            self.log.info("Archived generation %s of job %s to %s", generation, job.job_id, archive_path)
        elif archives and self.state.store.get_generation(job.job_id, generation) is not None:
            # A reset died between its archive's rename and recording it (its task killed, the state database
            # away): the generation is archived on disk but not in the database.  Record it now, or this
            # reset would report no archive and the generation would count as current again once the next
            # is archived, reusing its number.
            archive_path = archives[-1]  # the newest: archive names carry their time
            self.state.mark_archived(job.job_id, generation, archive_path, reason)
            self.log.info("Generation %s of job %s was archived to %s by an earlier reset that did not record "
                          "it: recorded now", generation, job.job_id, archive_path)
        elif generation > 1 and self.state.store.get_generation(job.job_id, generation) is None:
            # No driver ever registered this generation: every earlier one is archived, so a reset died
            # between its archive and its start (or a reset's new run never came up).  Finish that reset:
            # start this generation, and report the archive it made, instead of skipping a number.
            previous = self.state.store.get_generation(job.job_id, generation - 1) or {}
            generation, archive_path = generation - 1, previous.get("archive_path")
            self.log.info("Generation %s of job %s was archived to %s by an earlier reset that did not start "
                          "generation %s: starting it now", generation, job.job_id, archive_path, generation + 1)
        faults.maybe_crash("reset_after_archive")
        if lost:  # accepted loss: recorded with the offsets it moves, before anything reads from there
            self.state.store.accept_loss(job.job_id, generation + 1, lost, resume, reason)
            self.log.warning("Job %s: accepted the loss of %s; generation %s starts at %s", job.job_id,
                             "; ".join(r.describe() for r in lost), generation + 1,
                             kafka_offsets.to_spark_json(resume))
        return {"generation": generation + 1, "archived_generation": generation, "archive_path": archive_path,
                "starting_offsets": kafka_offsets.to_spark_json(resume) if resume else None,
                "lost_ranges": [r.to_dict() for r in lost]}

    def record_restart(self, action: str, reason: str, failed_run_id: str | None, run_id: str | None,
                       task: str | None = None) -> None:
        self.state.record_restart(self.job_id, action, reason, failed_run_id, run_id, task)

    # -- blocking ---------------------------------------------------------------------------------------
    def block(self, wait: RunWait) -> Outcome:
        """Wait in this process (``deferrable=False``)."""
        return self._watch(wait).block(show=lambda line: self.log.info("driver | %s", line))

    def look(self, wait: RunWait) -> Outcome | None:
        """One poll of ``wait``: its outcome if decided now, else None."""
        return self._watch(wait).poll()

    def _watch(self, wait: RunWait) -> RunWatch:
        return RunWatch(wait, self.get_run, self.driver.is_alive, self.caught_up, secrets=[self.state.password],
                        now=self.clock.now)


def watch_for(wait: RunWait, state_conn_id: str, kafka_conn_id: str,
              topics: list[str]) -> tuple[RunWatch, Callable[[], None]]:
    """A watch over ``wait`` built from connections (for the trigger), and how to close its clients.  The
    state database is first reached in the watch's polls, which ride out its outage until the deadline: a
    trigger started (or started again by a new triggerer) while it does not answer must wait, not fail."""
    state, kafka = StreamStateHook(state_conn_id), KafkaOffsetsHook(kafka_conn_id)

    def now() -> float:
        try:
            return state.store.clock.now()
        except DATABASE_OUTAGE:  # not reached yet: this host's clock until it answers
            return time.time()

    return (RunWatch(wait, lambda run_id: state.store.get_run(run_id), StreamDriverHook.is_alive,
                     lambda: caught_up(state, kafka, wait.job_id, topics), secrets=[state.password], now=now),
            state.close)


def caught_up(state: StreamStateHook, kafka: KafkaOffsetsHook, job_id: str, topics) -> bool:
    """Kafka holds nothing beyond the stored offsets: no batch is coming (unknown counts as no)."""
    try:
        return kafka.lag(state.unapplied_from(job_id), topics) == 0
    except Exception:
        return False


def standby_failures(recent: list[StandbyRecord], now: float) -> list[StandbyRecord]:
    """The standbys of ``recent`` (newest first) that died warming up, one after another within the window,
    newest first: up to the first that warmed up or ended otherwise (asked to, or by taking over)."""
    died = []
    for record in recent:
        if record.successor or record.status.live:
            continue
        if record.status != StandbyStatus.DEAD or record.ready_at is not None:
            break
        if now - (record.ended_at or record.started_at or now) > STANDBY_FAILURE_WINDOW_S:
            break
        died.append(record)
    return died
