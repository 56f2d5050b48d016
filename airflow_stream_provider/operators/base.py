"""What every stream-job operator shares: the job spec, the hooks, launching a run and stopping one.

The spec is given once per DAG as a plain dict (templated); connections complete it at run time:
the state connection gives the database URL (its password stays out of the spec and reaches the
driver through its environment), the Kafka connection the brokers, the Spark connection the master.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException

from airflow_stream_provider import diagnosis, failures, faults, kafka_offsets, local_driver
from airflow_stream_provider.diagnosis import Diagnosis, Health, Thresholds
from airflow_stream_provider.hooks.checkpoint import CheckpointHook
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.kafka_offsets import LostRange, Offsets
from airflow_stream_provider.spec import SpecError, StreamJobSpec
from airflow_stream_provider.state.store import ACTIVE_STATUSES


class StreamJobError(Exception):
    """A failure Airflow's retries may fix (broker or database briefly away)."""


class StreamJobOperator(BaseOperator):
    template_fields: Sequence[str] = ("spec", "application", "conf", "env_vars", "py_files", "ready_timeout",
                                      "heartbeat_timeout", "stuck_after", "stop_timeout", "driver_log_dir",
                                      "checkpoint_conn_id")
    template_fields_renderers = {"spec": "json", "conf": "json"}
    ui_color = "#e8f1fb"

    def __init__(self, *, spec: dict[str, Any], application: str | None = None,
                 state_conn_id: str = StreamStateHook.default_conn_name,
                 kafka_conn_id: str = KafkaOffsetsHook.default_conn_name,
                 spark_conn_id: str = StreamDriverHook.default_conn_name,
                 checkpoint_conn_id: str | None = None, conf: dict[str, str] | None = None,
                 py_files: str | None = None, env_vars: dict[str, str] | None = None,
                 ready_timeout: float = 300.0, heartbeat_timeout: float = 30.0, stuck_after: float = 300.0,
                 stop_timeout: float = 120.0, kill_grace: float = 30.0, driver_log_dir: str | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.spec = spec
        self.application = application
        self.state_conn_id = state_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.spark_conn_id = spark_conn_id
        self.checkpoint_conn_id = checkpoint_conn_id
        self.conf = conf
        self.py_files = py_files
        self.env_vars = env_vars
        self.ready_timeout = ready_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.stuck_after = stuck_after
        self.stop_timeout = stop_timeout
        self.kill_grace = kill_grace
        self.driver_log_dir = driver_log_dir

    # -- hooks (built lazily: templated fields are rendered after __init__) -----------------------------
    @cached_property
    def state(self) -> StreamStateHook:
        return StreamStateHook(self.state_conn_id)

    @cached_property
    def kafka(self) -> KafkaOffsetsHook:
        return KafkaOffsetsHook(self.kafka_conn_id)

    @cached_property
    def driver(self) -> StreamDriverHook:
        return StreamDriverHook(self.spark_conn_id, conf=self.conf, py_files=self.py_files,
                                env_vars=self.env_vars, log_dir=self.driver_log_dir)

    @cached_property
    def job(self) -> StreamJobSpec:
        """The validated spec; a bad one fails the task before anything starts (no retry can fix it)."""
        data = dict(self.spec)
        try:
            data["kafka"] = {**data.get("kafka", {}), "bootstrap_servers": self.kafka.bootstrap_servers}
            data["database_url"] = self.state.database_url
        except AirflowNotFoundException as err:
            raise AirflowFailException(
                f"{err}. Create it: {self.state_conn_id!r} (type stream_state: extra.url, or PostgreSQL "
                f"host/schema/login/password) and {self.kafka_conn_id!r} (type stream_kafka: host/port or "
                "extra.bootstrap_servers); or pass state_conn_id / kafka_conn_id") from None
        try:
            return StreamJobSpec.from_dict(data)
        except SpecError as err:
            raise AirflowFailException(f"invalid stream job spec: {err}") from None

    def check_before_start(self, spec: StreamJobSpec) -> None:
        """What would make a driver fail at once, checked from here before one is started: the brokers,
        the topics, a local checkpoint root's permissions."""
        try:
            _, latest = self.kafka.watermarks(spec.kafka.topics)
        except Exception as err:
            raise StreamJobError(
                f"job {spec.job_id}: cannot read the partitions of {list(spec.kafka.topics)} from "
                f"{spec.kafka.bootstrap_servers} (connection {self.kafka_conn_id!r}): {err!r}. Check the "
                "connection's brokers and that they are up; nothing was started") from None
        missing = sorted(set(spec.kafka.topics) - {topic for topic, _ in latest})
        if missing:
            raise AirflowFailException(
                f"job spec field 'kafka.topics': topics {missing} do not exist on {spec.kafka.bootstrap_servers}. "
                "Create them (the job does not create topics) or fix the spec; nothing was started")
        root = spec.checkpoint_root.removeprefix("file://")
        if "://" not in root:
            existing = Path(root)
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent
            if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
                raise AirflowFailException(
                    f"job spec field 'checkpoint_root': {spec.checkpoint_root} is not writable here ({existing} "
                    "is not a writable directory). Give the Airflow and Spark users write access, or choose another root; "
                    "nothing was started")

    @cached_property
    def checkpoints(self) -> CheckpointHook:
        return CheckpointHook(self.job.checkpoint_root, self.checkpoint_conn_id)

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(heartbeat_timeout_s=float(self.heartbeat_timeout), stuck_after_s=float(self.stuck_after))

    # -- diagnosis -------------------------------------------------------------------------------------
    def diagnose(self) -> Diagnosis:
        job = self.job
        run = self.state.latest_run(job.job_id)
        try:
            lag = self.kafka.lag(self.state.stored_offsets(job.job_id), job.kafka.topics)
        except Exception as err:
            self.log.warning("Could not read Kafka lag for job %s: %r", job.job_id, err)
            lag = None
        alive = self.driver.is_alive(run) if run else None
        found = diagnosis.diagnose(job.job_id, run, driver_alive=alive, lag=lag, thresholds=self.thresholds)
        self.state.record_death(run, found)
        if found.health.needs_action and run is not None and run["last_batch_id"] is not None:
            found.evidence.extend(self._lost_checkpoint(run))
        return found

    def _lost_checkpoint(self, run: dict[str, Any]) -> list[str]:
        """A run that committed batches on a generation whose checkpoint now holds none: the checkpoint was
        lost (deleted, or a restore missed it).  A restart still resumes exactly from the stored offsets,
        and the diagnosis says why Spark starts over."""
        try:
            path = self.checkpoints.generation_path(run["job_id"], run["generation"])
            if self.checkpoints.has_checkpoint(path):
                return []
        except Exception as err:  # the diagnosis stands without this fact
            self.log.warning("Could not check the checkpoint of run %s: %r", run["run_id"], err)
            return []
        return [f"the checkpoint of generation {run['generation']} ({path}) holds no batch although run "
                f"{run['run_id']} committed up to batch {run['last_batch_id']}: it was lost; a restart resumes "
                f"from the stored offsets"]

    def live_run(self) -> dict[str, Any] | None:
        """The latest run if its driver is alive (by process check or fresh heartbeat)."""
        run = self.state.latest_run(self.job.job_id)
        if run is None or run["status"] not in ACTIVE_STATUSES:
            return None
        found = diagnosis.diagnose(self.job.job_id, run, driver_alive=self.driver.is_alive(run), lag=None,
                                   thresholds=self.thresholds)
        return None if found.health == Health.DEAD else run

    # -- launching -------------------------------------------------------------------------------------
    def launch(self, *, generation: int | None = None, starting_offsets: str | None = None,
               spec: StreamJobSpec | None = None, application: str | None = None) -> dict[str, Any]:
        """Submit a driver and wait until its query runs; fail with the driver's own evidence if it doesn't."""
        application = application or self.application
        if not application:
            raise AirflowFailException(f"{self.task_id}: 'application' (the job file to submit) is required")
        spec = spec or self.job
        generation = generation or self.state.current_generation(spec.job_id)
        spec = spec.with_generation(generation, starting_offsets)
        self.check_before_start(spec)
        run_id = uuid.uuid4().hex
        submitted = self.driver.submit(application, spec, run_id, self.state.password)
        run = self._wait_ready(spec, submitted)
        self.state.store.record_launch(run_id, application, spec.to_json())
        self.log.info("Job %s run %s is running: generation %s, epoch %s", spec.job_id, run_id, generation,
                      run["epoch"])
        return {"job_id": spec.job_id, "run_id": run_id, "epoch": run["epoch"], "generation": generation,
                "version": spec.version, "checkpoint_path": spec.checkpoint_path, "pid": submitted.pid,
                "log_path": submitted.log_path, "submission_id": submitted.submission_id}

    def _wait_ready(self, spec: StreamJobSpec, submitted) -> dict[str, Any]:
        state, run = self.watch_submission(submitted, float(self.ready_timeout),
                                           lambda r: r["query_started_at"] and r["status"] in ACTIVE_STATUSES)
        if state == "ready":
            return run
        if state == "ended":
            raise self._start_failure(spec, submitted.log_path, run)
        raise StreamJobError(f"job {spec.job_id} run {submitted.run_id}: the query did not start within "
                             f"{self.ready_timeout:.0f}s. Driver log: {submitted.log_path}")

    def watch_submission(self, submitted, timeout: float, ready: Callable[[dict[str, Any]], Any] | None = None
                         ) -> tuple[str, dict[str, Any] | None]:
        """Poll a submitted driver's run until ``ready(run)``, its end (recorded, or its process gone), or
        ``timeout``: ("ready" | "ended" | "timeout", the run row, None if it never registered)."""
        deadline = time.monotonic() + timeout
        process = local_driver.DriverProcess(submitted.pid, submitted.log_path, submitted.run_id) \
            if submitted.pid else None
        run = None
        while time.monotonic() < deadline:
            run = self.state.store.get_run(submitted.run_id)
            if run and ready is not None and ready(run):
                return "ready", run
            if run and run["status"] not in ACTIVE_STATUSES or (process and not process.alive()):
                time.sleep(0.5)  # let the driver finish writing its termination record
                return "ended", self.state.store.get_run(submitted.run_id)
            time.sleep(0.5)
        return "timeout", run

    def _start_failure(self, spec: StreamJobSpec, log_path: str | None, run: dict[str, Any] | None) -> Exception:
        tail = _log_tail(log_path)
        if run is None:
            return StreamJobError(f"job {spec.job_id}: the driver exited before registering its run "
                                  f"(state database unreachable, or bad arguments). Driver log "
                                  f"{log_path}:\n{tail}")
        found = diagnosis.diagnose(spec.job_id, run, driver_alive=False, lag=None)
        message = (f"job {spec.job_id} run {run['run_id']} did not start: {found.summary()}. "
                   f"What to do: {found.advice} Driver log {log_path}:\n{tail}")
        if found.failure_kind in (failures.FailureKind.TRANSIENT, failures.FailureKind.RESOURCE):
            return StreamJobError(message)
        return AirflowFailException(message)

    # -- the two recovery actions -------------------------------------------------------------------
    def restart_from_checkpoint(self, reason: str, failed_run: dict[str, Any] | None) -> dict[str, Any]:
        """A new run on the current generation: Spark replays the unfinished batch, the sink skips what
        was committed."""
        live = self.live_run()
        if live is not None:
            self.stop_run(live)
        if failed_run is not None and self.state.store.mark_dead(failed_run["run_id"], f"found dead: {reason}"):
            self.log.info("Recorded run %s as DEAD", failed_run["run_id"])
        recorded = self.recorded_launch(failed_run)
        result = self.launch(application=recorded[0], spec=recorded[1]) if recorded else self.launch()
        self.state.record_restart(self.job.job_id, "restart", reason, failed_run and failed_run["run_id"],
                                  result["run_id"])
        return {**result, "action": "restart"}

    def reset_and_resume(self, reason: str, *, allow_data_loss: bool = False, spec: StreamJobSpec | None = None,
                         application: str | None = None) -> dict[str, Any]:
        """Archive the current generation and start the next one from the offsets stored with the results.

        The stored offsets are checked against Kafka first (invariant 5): offsets that fell out of
        retention fail the task with the exact lost ranges unless ``allow_data_loss``.
        """
        job = spec or self.job
        live = self.live_run()
        if live is not None:
            self.stop_run(live)
        resume, lost = self.resume_point(job, allow_data_loss=allow_data_loss)
        generation = self.state.current_generation(job.job_id)
        archive_path = None
        active = {g.generation for g in self.checkpoints.list_generations(job.job_id) if not g.archived}
        if generation in active:
            archive_path = self.checkpoints.archive_generation(job.job_id, generation)
            self.state.mark_archived(job.job_id, generation, archive_path, reason)
            self.log.info("Archived generation %s of job %s to %s", generation, job.job_id, archive_path)
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
        starting = kafka_offsets.to_spark_json(resume) if resume else None
        result = self.launch(generation=generation + 1, starting_offsets=starting, spec=job,
                             application=application)
        self.state.record_restart(job.job_id, "reset", reason, None, result["run_id"])
        return {**result, "action": "reset", "archived_generation": generation, "archive_path": archive_path,
                "starting_offsets": starting, "lost_ranges": [r.to_dict() for r in lost]}

    def recorded_launch(self, run: dict[str, Any] | None,
                        application: str | None = None) -> tuple[str, StreamJobSpec] | None:
        """The job file and spec a run was launched with (recorded once its query ran), with today's
        brokers and database: a restart or a rollback starts exactly the code that ran, not whatever the
        DAG's arguments say now."""
        application = application or (run and run.get("application"))
        if not application or run is None:
            return None
        current = self.job
        if not run.get("spec"):
            return application, replace(current, version=run["version"])
        recorded = json.loads(run["spec"])
        recorded["kafka"]["bootstrap_servers"] = current.kafka.bootstrap_servers
        recorded.update(database_url=current.database_url, dry_run=False)
        return application, StreamJobSpec.from_dict(recorded)

    def resume_point(self, job: StreamJobSpec, *,
                     allow_data_loss: bool = False) -> tuple[Offsets, list[LostRange]]:
        """Where a new generation resumes, checked against Kafka (invariant 5), and the ranges of it Kafka
        no longer holds; fails on loss unless allowed, and then resumes past the loss.

        The stored offsets, for every topic the sink accounts for (a second stream's too).  A partition
        no batch ever committed resumes where the last generation began, not at the spec's default:
        with ``latest`` that would skip everything since.
        """
        stored = self.state.stored_offsets(job.job_id)
        resume = {**self.state.store.recorded_start(job.job_id), **stored}
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

    # -- stopping --------------------------------------------------------------------------------------
    def stop_run(self, run: dict[str, Any]) -> dict[str, Any]:
        """Graceful stop: the stop marker, then wait; SIGTERM and kill only after the timeout."""
        started = time.monotonic()
        self.state.store.request_stop(run["run_id"])
        self.log.info("Asked run %s of job %s to stop; waiting up to %ss", run["run_id"], run["job_id"],
                      self.stop_timeout)
        outcome = "stopped"
        if not self._wait_ended(run, float(self.stop_timeout)):
            self.log.warning("Run %s did not stop within %ss: sending SIGTERM", run["run_id"], self.stop_timeout)
            outcome = "terminated"
            self.driver.terminate(run)
            if not self._wait_ended(run, self.kill_grace):
                outcome = "killed"
                self.log.warning("Run %s ignored SIGTERM: %s", run["run_id"], self.driver.kill(run))
                self._wait_ended(run, self.kill_grace)
        final = self.state.store.get_run(run["run_id"]) or run
        if final["status"] in ACTIVE_STATUSES and self.driver.is_alive(final) is False:
            # Gone without recording an end: it died during the stop (or was killed above).
            outcome = "died" if outcome == "stopped" else outcome
            self.state.store.mark_dead(run["run_id"], f"driver gone during a graceful stop ({outcome})")
            final = self.state.store.get_run(run["run_id"]) or final
        return {"job_id": run["job_id"], "run_id": run["run_id"], "outcome": outcome,
                "exit_code": final["exit_code"], "status": final["status"],
                "seconds": round(time.monotonic() - started, 1)}

    def _wait_ended(self, run: dict[str, Any], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.state.store.get_run(run["run_id"])
            if current and current["status"] not in ACTIVE_STATUSES and self.driver.is_alive(current) is not True:
                return True
            if self.driver.is_alive(run) is False:
                return True
            time.sleep(0.5)
        return False


def _log_tail(path: str | None, lines: int = 25) -> str:
    if not path or not Path(path).exists():
        return "(no local driver log)"
    content = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(line[:300] for line in content[-lines:])
