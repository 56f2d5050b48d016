"""What every stream-job operator shares: its arguments, its controller, and the three flows the lifecycle
operators are built from (launch, graceful stop, and restart / reset around them).

The spec is given once per DAG as a plain dict (templated); connections complete it at run time:
the state connection gives the database URL (its password stays out of the spec and reaches the
driver through its environment), the Kafka connection the brokers, the Spark connection the master.

Waiting is deferred by default: a flow does a step through the
:class:`~airflow_stream_provider.lifecycle.controller.StreamJobController`, then hands what it waits for to a
:class:`~airflow_stream_provider.triggers.run.StreamRunTrigger` and resumes in the named method, so no
worker slot is held while a driver starts or stops.  With ``deferrable=False`` the same methods run one
after another in the worker.  A flow's state travels as plain keyword arguments (JSON), the way Airflow
passes it to the resumed method.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR, TriggerFailureReason
from airflow.sdk.exceptions import (
    AirflowFailException,
    AirflowNotFoundException,
    AirflowTaskTerminated,
    TaskDeferred,
)

from airflow_stream_provider import faults, recovery
from airflow_stream_provider.diagnosis import Diagnosis, Thresholds
from airflow_stream_provider.hooks.driver import StreamDriverHook, check_conf
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle import waits
from airflow_stream_provider.lifecycle.controller import STOP_STAGES, StreamJobController, StreamJobError
from airflow_stream_provider.lifecycle.holders import lease_owner, retry_due_within, task_ended
from airflow_stream_provider.lifecycle.killed import KilledTask, undo, undo_ended
from airflow_stream_provider.lifecycle.waits import RunWait
from airflow_stream_provider.links import STREAM_LINKS
from airflow_stream_provider.settings_numbers import rendered_seconds
from airflow_stream_provider.spec import SpecError, StreamJobSpec
from airflow_stream_provider.state.leases import Lease
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.triggers.run import StreamRunTrigger

__all__ = ["StreamJobError", "StreamJobOperator"]

#: The task-state key of a launch in flight: a retry after a worker crash picks that run up.
LAUNCH_KEY = "stream_launch"
#: The task-state key of what this task's launch brought up (the launch's result): a retry after the launch
#: (a worker lost before the task's success was recorded) finds that run live, and it is this task's own,
#: not a double start.
LAUNCHED_KEY = "stream_launched"
#: The task-state key of the wait a deferred task resumes from.  A deferral Airflow times out (a triggerer
#: away past the wait's end and ``DEFER_MARGIN_S``) comes back without the trigger's kwargs: this says which
#: wait it was, so the task resumes as from a wait that failed instead of failing blind.
DEFERRED_KEY = "stream_deferred"
STOP_OUTCOMES = ("stopped", "terminated", "killed")
#: How long the job's lease holds for the work between two waits (a submit, a stop step, an archive)
LEASE_STEP_S = 300.0
#: How long it holds past a wait's deadline: the task's resume on a worker once its trigger fired
LEASE_GRACE_S = 120.0
#: How long past a deferred wait's own end the task may stay deferred before Airflow fails it (a trigger's
#: poll that never returns); the trigger rides out a database outage up to the wait's end itself.
DEFER_MARGIN_S = 600.0


class StreamJobOperator(BaseOperator):
    """Base of the stream-job operators.

    :param spec: the job spec (a dict, templated): ``job_id``, ``kafka.topics``, ``checkpoint_root``, ...;
        the connections fill in the brokers and the database URL.
    :param application: the job file to submit.
    :param state_conn_id: the ``stream_state`` connection (the results and state database).
    :param kafka_conn_id: the ``stream_kafka`` connection (the brokers).
    :param spark_conn_id: the ``spark`` connection (master, deploy mode).
    :param checkpoint_conn_id: a ``stream_checkpoint`` connection for a WebHDFS checkpoint root.
    :param conf: Spark configuration for the driver.
    :param py_files: ``--py-files`` for the driver.
    :param env_vars: environment of the driver.
    :param ready_timeout: seconds a new driver may take until its query runs.
    :param heartbeat_timeout: seconds without a heartbeat after which a running driver counts as dead.
    :param stuck_after: seconds without a batch, with records waiting, after which a query is stuck.
    :param stop_timeout: seconds a graceful stop waits for the current batch before SIGTERM.
    :param kill_grace: seconds after SIGTERM before a kill, and after the kill.
    :param driver_log_dir: where local drivers write their logs.
    :param deferrable: wait in the triggerer (the default) instead of holding a worker slot.
    """

    #: Once a launched query runs, how long the flow may wait for the run's first batch to be over before it
    #: goes on (``RunWait.settle_s``); 0: it goes on at once.
    launch_settle_s: float = 0.0
    #: What this task does to the job, as its lease names it (``state.leases``): one task acts at a time.
    lease_action: str = "act"
    #: The waits (by the method they resume in) that a deferral Airflow timed out resumes as failed waits
    #: (``resume_execution``): a launch, which one look settles.
    resumed_on_timeout: frozenset[str] = frozenset({"_launch_waited"})

    template_fields: Sequence[str] = ("spec", "application", "conf", "env_vars", "py_files", "ready_timeout",
                                      "heartbeat_timeout", "stuck_after", "stop_timeout", "driver_log_dir",
                                      "checkpoint_conn_id")
    template_fields_renderers = {"spec": "json", "conf": "json"}
    ui_color = "#e8f1fb"
    operator_extra_links = STREAM_LINKS

    def __init__(self, *, spec: dict[str, Any], application: str | None = None,
                 state_conn_id: str = StreamStateHook.default_conn_name,
                 kafka_conn_id: str = KafkaOffsetsHook.default_conn_name,
                 spark_conn_id: str = StreamDriverHook.default_conn_name,
                 checkpoint_conn_id: str | None = None, conf: dict[str, str] | None = None,
                 py_files: str | None = None, env_vars: dict[str, str] | None = None,
                 ready_timeout: float = 300.0, heartbeat_timeout: float = 30.0, stuck_after: float = 300.0,
                 stop_timeout: float = 120.0, kill_grace: float = 30.0, driver_log_dir: str | None = None,
                 deferrable: bool = True, **kwargs):
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
        self.deferrable = deferrable
        self._in_flight: dict[str, Any] | None = None
        self._lease_owner: str | None = None
        self._held_since: float | None = None  # when this task's hold on the job's lease began
        self._killed = False  # on_kill has run: a wait in this process ends the task (``_after_wait``)

    @property
    def job_id(self) -> str | None:
        """The job this task acts on (for its extra links); ``job`` is the validated spec."""
        return self.spec.get("job_id") if isinstance(self.spec, dict) else None

    # -- the hooks and the controller (built lazily: templated fields are rendered after __init__) -------
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
        if not isinstance(self.spec, Mapping):
            raise AirflowFailException(
                f"spec is a {type(self.spec).__name__}, not a mapping: a templated spec renders to text unless "
                "its DAG sets render_template_as_native_obj=True (as dags/stream_job.py does)")
        data = dict(self.spec)
        if data.get("dry_run"):
            raise AirflowFailException("spec sets dry_run: a DAG's job runs for real; only an upgrade's preflight "
                                       "starts a dry run (on a copy of the checkpoint). Leave dry_run out")
        kafka = data.get("kafka", {})
        if not isinstance(kafka, Mapping):
            raise AirflowFailException(f"spec's kafka is a {type(kafka).__name__}, not a mapping: give it as "
                                       "{'topics': [...], ...}")
        try:
            # what the connections say: a different value in the DAG's spec would be dropped without a word
            given = [("kafka.bootstrap_servers", kafka.get("bootstrap_servers"), self.kafka.bootstrap_servers,
                      "kafka_conn_id", self.kafka_conn_id),
                     ("database_url", data.get("database_url"), self.state.database_url, "state_conn_id",
                      self.state_conn_id)]
            for name, value, connection_value, parameter, conn_id in given:
                if value is not None and value != connection_value:
                    shown = f" to {value!r}" if name != "database_url" else ""  # a URL may hold a password
                    raise AirflowFailException(
                        f"spec sets {name}{shown}, but it comes from the connection {conn_id!r}, which says "
                        f"otherwise: remove {name} from the spec, or change the connection (or name another with "
                        f"{parameter})")
            data["kafka"] = {**kafka, "bootstrap_servers": self.kafka.bootstrap_servers}
            data["database_url"] = self.state.database_url
        except AirflowNotFoundException as err:
            raise AirflowFailException(
                f"{err}. Create it: {self.state_conn_id!r} (type stream_state: extra.url, or PostgreSQL "
                f"host/schema/login/password) and {self.kafka_conn_id!r} (type stream_kafka: host/port or "
                "extra.bootstrap_servers); or pass state_conn_id / kafka_conn_id") from None
        except ValueError as err:  # a connection that cannot be used as it is: no retry fixes it
            raise AirflowFailException(str(err)) from None
        try:
            return StreamJobSpec.from_dict(data)
        except SpecError as err:
            raise AirflowFailException(f"invalid stream job spec: {err}") from None

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(heartbeat_timeout_s=float(self.heartbeat_timeout), stuck_after_s=float(self.stuck_after))

    @cached_property
    def controller(self) -> StreamJobController:
        return StreamJobController(self.job, state=self.state, kafka=self.kafka, driver=self.driver,
                                   checkpoint_conn_id=self.checkpoint_conn_id, thresholds=self.thresholds,
                                   log=self.log)

    # -- OpenLineage (called by its listener when installed): what a launch reads and writes ------------
    #: this operator launches drivers; a stop moves no data and names none
    launches = True

    def get_openlineage_facets_on_start(self):
        return self._lineage()

    def get_openlineage_facets_on_complete(self, task_instance):
        return self._lineage()

    def get_openlineage_facets_on_failure(self, task_instance):
        return self._lineage()

    def _lineage(self):
        from airflow.providers.openlineage.extractors import OperatorLineage

        from airflow_stream_provider.lineage import job_lineage

        if not self.launches:
            return OperatorLineage()
        try:  # read afresh at every call: the end event must name what was launched after the start
            tables = self.state.store.result_tables(self.job.job_id)
        except Exception as err:  # a lineage event must never fail the task
            self.log.warning("No lineage outputs: the state database cannot be read: %s", err)
            tables = []
        return job_lineage(self.job, tables)

    def diagnose(self) -> Diagnosis:
        return self.controller.diagnose()

    def live_run(self) -> RunRecord | None:
        return self.controller.live_run()

    # -- the job's lease: taken on entry, extended over each wait, let go when the task ends ---------------
    def _leased(self, context, step, *args: Any, resumed: bool = False, held_since: float | None = None) -> Any:
        """Run ``step(*args)`` holding the job's lease; a deferral keeps it (held over the wait by
        ``_hold_lease``), anything else ends the task's hold on it.  ``held_since``: when the hold a resumed
        task deferred with began."""
        self._lease_owner = _lease_owner(context, self)
        if not resumed:
            self._take_over_from_ended_task(context)
        held = self.controller.take_lease(self._lease_owner, self.lease_action, time.time() + LEASE_STEP_S)
        if held is not None:
            if resumed:
                raise LeaseLost(
                    f"job {self.job.job_id}: while this task waited, its lease on the job ran out and "
                    f"{held.describe(time.time())} took it; that task acts on the job now, so this one stops "
                    "here. Look at what it did before running this again")
            return self.lease_held(context, held)
        self._held_since = self._hold_continued(held_since)
        try:
            result = step(*args)
        except TaskDeferred:
            raise
        except LeaseLost:  # another task holds the lease: nothing of this task's to let go of
            self._drop_launch(self._launch_in_flight())
            raise
        except LaunchUndecided as failure:
            self._hold_for_retry(context, failure.launch)
            raise
        except BaseException as failure:
            if self._launch_left_for_retry(context):  # whatever failed, the launch it waits on is undecided
                self._hold_for_retry(context, self._in_flight)
                raise
            try:
                self.controller.release_lease(self._lease_owner)
            except Exception as err:  # the task's own failure is what it reports: a retry must not hide a final one
                self.log.warning("The lease on job %s could not be released after %r (%s); it runs out by "
                                 "itself", self.job.job_id, failure, err)
            raise
        self.controller.release_lease(self._lease_owner)
        return result

    def _launch_left_for_retry(self, context) -> bool:
        """The task fails while waiting on the launch its retry picks up (the task state's): not a decided
        launch whose failure path failed in turn, nor a dry run, nor after a kill, which ended the launch."""
        if not self._in_flight or self._killed:
            return False
        pending = _task_state(context, LAUNCH_KEY)
        return bool(pending) and pending["launch"]["run_id"] == self._in_flight["run_id"]

    def _hold_for_retry(self, context, launch: dict[str, Any]) -> None:
        """Keep the job's lease, naming the launch, until this task's retry picks the launch up.  Let go, it
        would leave the job to the next task that wants it (a recover seeing no live run, a person's submit)
        while the driver may be starting still: a second driver on the checkpoint, fenced by its epoch but
        started all the same.  Where no retry is left, the task ends holding it, and the next task to want
        the lease ends the launch unless its query runs by then (``_take_over_from_ended_task``)."""
        due = retry_due_within(self, _task_instance(context))
        until = time.time() + (due or 0.0) + LEASE_GRACE_S
        try:
            held = self.controller.take_lease(self._lease_owner, self.lease_action, until,
                                              _lease_launch(launch, self.spark_conn_id))
        except Exception as err:  # the launch's failure is the one to report; the lease runs out by itself
            self.log.warning("Could not keep the lease on job %s for this task's retry (%s)", self.job.job_id, err)
            return
        if held is None:
            self.log.warning("Job %s: this task keeps the job's lease %s, so that no other task starts a "
                             "driver beside run %s", self.job.job_id,
                             f"for its retry (due within {due:.0f} s)" if due is not None else
                             "as it ends: the next task to want it ends the run unless its query runs by then",
                             launch["run_id"])

    def _take_over_from_ended_task(self, context) -> None:
        """A lease left by a task that Airflow says has ended: its process is gone (a lost worker, an OOM
        kill), or it was killed while deferred and no trigger undid it.  Nothing let go of the lease, which would
        keep every task from the job until it ran out, and nothing ended what the task was doing: a driver
        still starting, an upgrade that stopped the job.  Both are undone here, as its trigger would have."""
        held = self.controller.lease()
        if held is None or held.owner == self._lease_owner or not _task_ended(context, held.owner, self.log):
            return
        self.log.warning("Job %s: %s has ended in Airflow without letting go of the job's lease; undoing what "
                         "it left and taking the lease over", self.job.job_id, held.describe(time.time()))
        undo_ended(self.state.store, held, self.log)

    def _hold_continued(self, held_since: float | None) -> float | None:
        """When this task's hold on the lease began; for a resumed task, the same hold it deferred with.  A
        hold that began since means its lease ran out while it waited, and another task took it and let go:
        that task may have restarted, stopped or reset the job, so this one stops rather than go on from what
        it saw before its wait."""
        since = self.controller.lease_since(self._lease_owner)
        if held_since is not None and since != held_since:
            self.controller.release_lease(self._lease_owner)
            raise LeaseLost(
                f"job {self.job.job_id}: while this task waited, its lease on the job ran out, and another task "
                "took it and let go of it since; what that task did may have changed the job, so this one stops "
                "here. Look at the job (`python -m airflow_stream_provider status`) before running this again")
        return since

    def lease_held(self, context, held: Lease) -> Any:
        """Another task holds the job's lease: nothing is done (a recover overrides this)."""
        raise AirflowFailException(
            f"job {self.job.job_id}: {held.describe(time.time())} acts on the job now, and a {self.lease_action} "
            "beside it could start or stop a driver under it. Nothing was done: run this again once that task "
            "has ended (`python -m airflow_stream_provider status` names the task acting on the job)")

    def _hold_lease(self, until: float) -> None:
        """Keep the job's lease until ``until``: over a wait (its deadline plus ``LEASE_GRACE_S``), or for
        the step after one."""
        if self._lease_owner is None:  # a flow method called outside execute (a test driving it directly)
            return
        held = self.controller.take_lease(self._lease_owner, self.lease_action, until, self._launch_in_flight())
        if held is not None:
            raise LeaseLost(f"job {self.job.job_id}: this task's lease on the job ran out and "
                            f"{held.describe(time.time())} took it; that task acts on the job now, so this one "
                            "stops here. Look at what it did before running this again")

    #: the arguments that are seconds (rendered: a templated one is text until the task runs); ``None``, where
    #: allowed, takes a default
    seconds_fields: tuple[str, ...] = ("ready_timeout", "heartbeat_timeout", "stuck_after", "stop_timeout")

    def check_seconds(self) -> None:
        """Fail, naming each, where a timeout is not a finite number of seconds above 0 (``kill_grace``: 0 or
        more): before anything is looked at or done.  Found later, a ready_timeout of "5m" failed after its
        driver was submitted, and one of 0 killed every new driver at once."""
        wrong = []
        for name in (*self.seconds_fields, "kill_grace"):
            value = getattr(self, name)
            seconds = 1.0 if value is None else rendered_seconds(value)
            if seconds is None or seconds < 0 or (seconds == 0 and name != "kill_grace"):
                wrong.append(f"{name}={value!r}")
        if wrong:
            raise AirflowFailException(f"{', '.join(wrong)}: give a number of seconds above 0 (kill_grace: 0 or more)")

    # -- execute: pick up a launch an earlier try left running, else start ------------------------------
    def execute(self, context) -> Any:
        self.check_seconds()
        try:
            check_conf(self.conf)
        except ValueError as err:
            raise AirflowFailException(str(err)) from None
        return self._leased(context, self._execute, context)

    def _execute(self, context) -> Any:
        pending = _task_state(context, LAUNCH_KEY)
        if pending:
            run = self.controller.get_run(pending["launch"]["run_id"])
            if _still_starting(run, pending["launch"]):
                self._check_hold_since_launch(context, pending)
                self.log.info("Picking up run %s, launched by an earlier try of this task, instead of "
                              "launching another", pending["launch"]["run_id"])
                self._in_flight = pending["launch"]  # a kill now ends it, as it would have the first try's
                return self.wait_then(context, self._launch_wait(pending["launch"]), "_launch_waited", **pending)
            _set_task_state(context, LAUNCH_KEY, None)
        return self.start(context)

    def _check_hold_since_launch(self, context, pending: dict[str, Any]) -> None:
        """A retry picks up its earlier try's launch only under the hold that launched it.  Another task that
        held the job's lease since (this task's hold ran out before the retry came: a late scheduler, a retry
        policy of its own) may have stopped, restarted or reset the job; picked up, the launch would come up
        behind it.  The launch is ended unless its query runs, and this task stops, as a resumed task does
        (``_hold_continued``)."""
        launched_under = pending.get("held_since")
        if launched_under is None or self._held_since is None or launched_under == self._held_since:
            return
        run_id = pending["launch"]["run_id"]
        self._drop_launch(pending["launch"])
        _set_task_state(context, LAUNCH_KEY, None)
        self.controller.release_lease(self._lease_owner)
        raise LeaseLost(
            f"job {self.job.job_id}: run {run_id}, launched by an earlier try of this task, was still starting, "
            "but this task's lease on the job ran out before this retry came, and another task held it since; "
            "what that task did may have changed the job, so the run was ended unless its query ran, and this "
            "task stops here. Look at the job (`python -m airflow_stream_provider status`) before running this "
            "again")

    def start(self, context) -> Any:
        raise NotImplementedError

    def on_kill(self) -> None:
        """Stop what this task started and was waiting on: a half-started run, a dry run; let go of the
        job's lease.  Airflow 3's SIGTERM handler returns to the task once this has run, and the process
        lives on until the supervisor's kill: a wait in this process ends there, and nothing after it is
        done (``_after_wait``)."""
        self._killed = True
        if self._in_flight:
            self.controller.abandon(self._in_flight, "its task was killed")
        if self._lease_owner is not None:
            self.controller.release_lease(self._lease_owner)

    # -- waiting ----------------------------------------------------------------------------------------
    def wait_then(self, context, wait: RunWait, method: str, **state: Any) -> Any:
        """Wait for ``wait``, then continue in ``method(context, event, **state)``: in the triggerer when
        deferrable, else here."""
        try:
            self._hold_lease(self.controller.clock.to_host(wait.deadline) + wait.settle_s + LEASE_GRACE_S)
        except waits.DATABASE_OUTAGE as err:
            # The wait rides the outage out; the lease taken on entry holds on for a while, and the resume
            # takes it again, or stops if another task took it meanwhile (``_leased``).
            self.log.warning("Could not extend the job's lease over this wait (%s); waiting all the same",
                             waits.outage_line(err))
        if self.deferrable:
            self._defer(context, wait, 0.0, method, state)
        outcome = self.controller.block(wait)
        self._after_wait()
        self._hold_lease(time.time() + LEASE_STEP_S)
        return getattr(self, method)(context, {"outcome": outcome, "run_id": wait.run_id}, **state)

    def pause_then(self, context, seconds: float, method: str, **state: Any) -> Any:
        """Wait ``seconds`` (a backoff), then continue in ``method(context, None, **state)``."""
        self._hold_lease(time.time() + seconds + LEASE_GRACE_S)
        if seconds > 0 and self.deferrable:
            self._defer(context, None, seconds, method, state)
        waits.pause(seconds)
        self._after_wait()
        self._hold_lease(time.time() + LEASE_STEP_S)
        return getattr(self, method)(context, None, **state)

    def _after_wait(self) -> None:
        """A task killed during its wait in this process stops here: ``on_kill`` has undone what it started
        and let go of the lease, and the step after the wait (a restart after a backoff, a launch judged
        failed because on_kill ended it) would act on the job without either."""
        if self._killed:
            raise AirflowTaskTerminated(f"job {self.job.job_id}: the task was killed during its wait; "
                                        "what it had started was undone, and nothing more is done")

    def _defer(self, context, wait: RunWait | None, pause_s: float, method: str, state: dict[str, Any]) -> None:
        resume = {"method": method, "state": state, "held_since": self._held_since}
        _set_task_state(context, DEFERRED_KEY, {"run_id": wait and wait.run_id, "resume": resume}
                        if method in self.resumed_on_timeout else None)
        trigger = StreamRunTrigger(wait=wait and wait.to_dict(), state_conn_id=self.state_conn_id,
                                   kafka_conn_id=self.kafka_conn_id, topics=list(self.job.kafka.topics),
                                   pause_s=pause_s, resume=resume, killed=self.killed_task().to_dict())
        # A bound past the wait's own end: a trigger whose poll hangs (a state database that stopped
        # answering mid-read) fails the task, to be retried, instead of leaving it deferred for good.
        within = pause_s if wait is None else max(0.0, wait.deadline - self.controller.clock.now()) + wait.settle_s
        self.defer(trigger=trigger, method_name="execute_complete",
                   timeout=timedelta(seconds=within + DEFER_MARGIN_S))

    def killed_task(self) -> KilledTask:
        """What ``on_kill`` would undo, for the trigger to undo when the task is killed while deferred."""
        return KilledTask(self.job.job_id, lease_owner=self._lease_owner,
                          launch=self._with_cluster_settings(self._launch_in_flight()))

    def _with_cluster_settings(self, launch: dict[str, Any] | None) -> dict[str, Any] | None:
        """``launch`` with what the cluster manager's kill of a cluster-mode driver needs beside its handle:
        the connection, and the task's conf and env_vars (a namespace, HADOOP_CONF_DIR).  For the undo only
        (the trigger's kwargs, which Airflow encrypts), never for the lease's row: env_vars may hold secrets."""
        if not launch or not launch.get("submission_id"):
            return launch
        return {**launch, "spark_conn_id": self.spark_conn_id, "conf": dict(self.conf or {}),
                "env_vars": dict(self.env_vars or {})}

    def _launch_in_flight(self) -> dict[str, Any] | None:
        """The driver this task started and waits on, as whoever undoes the task needs it."""
        return _lease_launch(self._in_flight, self.spark_conn_id)

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context) -> Any:
        """Airflow's resume.  A deferral Airflow timed out, of a wait in ``resumed_on_timeout``, resumes as a
        wait that failed (the trigger's ``error`` event: the wait failed, not the run as far as anyone
        knows), and a launch is looked at once.  Any other fails as Airflow fails it, for a retry to start
        afresh: the step after a backoff, a stop or an upgrade's verification would act on what was decided
        before the triggerer went away."""
        timed_out = (next_method == TRIGGER_FAIL_REPR
                     and (next_kwargs or {}).get("error") == TriggerFailureReason.TRIGGER_TIMEOUT)
        if timed_out and (deferred := _task_state(context, DEFERRED_KEY)):
            message = (f"waiting on run {deferred['run_id']}: the triggerer did not answer for "
                       f"{DEFER_MARGIN_S:.0f}s past the wait's end (Airflow timed the deferral out)")
            self.log.error("%s; resuming as from a wait that failed", message)
            return self.execute_complete(context, {"outcome": "error", "run_id": deferred["run_id"],
                                                   "message": message, "resume": deferred["resume"]})
        return super().resume_execution(next_method, next_kwargs, context)

    def execute_complete(self, context, event: dict[str, Any]) -> Any:
        """Where every deferral comes back: the event names the method the flow continues in."""
        try:
            return self._leased(context, self._resumed, context, event, resumed=True,
                                held_since=event.get("resume", {}).get("held_since"))
        except LeaseLost:
            self._drop_launch(((event.get("resume") or {}).get("state") or {}).get("launch"))
            raise

    def _drop_launch(self, launch: dict[str, Any] | None) -> None:
        """This task lost its hold on the lease while a driver it launched was starting, and another task
        acts on the job, or did meanwhile (a person's stop, a restart): that driver must not come up behind
        it.  Ended while its query has not started, as the undo of a killed task ends it; one whose query
        runs is the job's run by then."""
        if launch:
            undo(self.state.store, KilledTask(self.job.job_id, launch=self._with_cluster_settings(launch)),
                 "its task lost the job's lease while the driver was starting", self.log, running_too=False)

    def _resumed(self, context, event: dict[str, Any]) -> Any:
        resume = event.pop("resume")
        if event["outcome"] == "paused":
            event = None
        return getattr(self, resume["method"])(context, event, **resume["state"])

    def resume(self, context, method: str, result: Any, carry: dict[str, Any]) -> Any:
        """Hand a flow's ``result`` to the method that continues after it."""
        return getattr(self, method)(context, result, **carry)

    @staticmethod
    def outcome(event: dict[str, Any]) -> str:
        if event["outcome"] == "error":  # the wait failed, not the run as far as anyone knows
            raise StreamJobError(f"{event['message']}. Nothing more was done to the run: look at the job "
                                 "(`python -m airflow_stream_provider status`) before running this task again")
        return event["outcome"]

    # -- the launch flow -------------------------------------------------------------------------------
    def launch_then(self, context, after: str, carry: dict[str, Any], *, application: str | None = None,
                    spec_json: str | None = None, generation: int | None = None,
                    starting_offsets: str | None = None, on_fail: str | None = None,
                    restart: tuple[str, str, str | None] | None = None) -> Any:
        """Submit a driver, wait until its query runs, then ``after(context, result, **carry)``; a start
        failure (refused before the submit, or the driver's own) raises, or goes to
        ``on_fail(context, error, **carry)``.

        ``restart``: (action, reason, failed run) of a recovery: recorded as soon as the driver is submitted,
        so that a new run failing before its query starts still counts against the restart budget."""
        application = application or self.application
        if not application:
            raise AirflowFailException(f"{self.task_id}: 'application' (the job file to submit) is required")
        spec = StreamJobSpec.from_dict(json.loads(spec_json)) if spec_json else self.job
        try:
            launch = self.controller.submit(application, spec, generation=generation,
                                            starting_offsets=starting_offsets)
        except (StreamJobError, AirflowFailException) as err:
            if on_fail:  # refused before a driver started (brokers away, a topic missing): the flow's own path
                return self.resume(context, on_fail, err, carry)
            raise
        self._in_flight = launch
        # ``held_since``: the hold it is launched under, which a retry picking it up must still be on
        pending = {"launch": launch, "after": after, "carry": carry, "on_fail": on_fail,
                   "held_since": self._held_since}
        if restart:
            pending["restart"] = list(restart)  # the task state store takes JSON values: no tuple
        # Kept before anything else can fail: this task's retry then picks the launch up instead of leaving a
        # driver nobody waits on, and records its restart.
        _set_task_state(context, LAUNCH_KEY, pending)
        if restart:
            self._record_restart_soon(restart, launch["run_id"])
        return self.wait_then(context, self._launch_wait(launch), "_launch_waited", **pending)

    def _launch_wait(self, launch: dict[str, Any]) -> RunWait:
        return self.controller.launch_wait(launch, "ready", float(self.ready_timeout),
                                           settle_s=float(self.launch_settle_s))

    def _record_restart_soon(self, restart: Sequence[str | None], run_id: str) -> None:
        """Record a recovery's restart as soon as its driver is submitted.  The driver runs already, so a
        state database that does not answer for a moment fails nothing: the restart is recorded once the
        launch is over (``_launch_waited``; recording it twice counts it once)."""
        try:
            self.controller.record_restart(*restart, run_id, self._lease_owner)
        except waits.DATABASE_OUTAGE as err:
            self.log.warning("Could not record the restart that launched run %s yet (%s); recording it once "
                             "the launch is over", run_id, waits.outage_line(err))

    def _launch_waited(self, context, event, launch, after, carry, on_fail=None, restart=None,
                       held_since=None) -> Any:  # held_since: for a retry's pickup (``_check_hold_since_launch``)
        if event["outcome"] == "error":
            event = self._launch_looked_at(event, launch)
        self._in_flight = launch
        if restart:  # a no-op unless the state database did not answer at the submit
            self.controller.record_restart(*restart, launch["run_id"], self._lease_owner)
        try:
            result = self.controller.finish_launch(launch, self.outcome(event), float(self.ready_timeout))
        except (StreamJobError, AirflowFailException) as err:
            if event["outcome"] == "timeout":  # it never came up: don't leave it starting behind us
                self.controller.abandon(launch, "its query did not start in time")
            _set_task_state(context, LAUNCH_KEY, None)
            if restart:
                self._owe_again(restart, launch["run_id"])
            if on_fail:
                return self.resume(context, on_fail, err, carry)
            raise
        finally:
            self._in_flight = None
        _set_task_state(context, LAUNCHED_KEY, result)
        _set_task_state(context, LAUNCH_KEY, None)
        return self.resume(context, after, result, carry)

    def launched_by_earlier_try(self, context) -> dict[str, Any] | None:
        """The launch an earlier try of this task saw running (its result), if any."""
        return _task_state(context, LAUNCHED_KEY)

    def _owe_again(self, restart: Sequence[str | None], run_id: str) -> None:
        """A recovery's driver that failed before it registered left the run it restarts the job's latest:
        a stopped run would read as a stop someone asked for, and nothing would start the job.  A new record
        begun for that run keeps the restart (or reset) owed, to this task's retry or the next recovery, and
        counts the failed attempt against the budget.  A driver that registered needs none: its own failure
        is the job's latest run, and the next recovery acts on that."""
        action, reason, failed_run_id = restart
        if failed_run_id is None:  # an upgrade's reset: the upgrade rolls back itself
            return
        try:
            if self.controller.get_run(run_id) is None:
                self.controller.record_restart(action, reason, failed_run_id, None, self._lease_owner)
                self.log.warning("Run %s never registered: the %s of run %s is owed still", run_id, action,
                                 failed_run_id)
        except waits.DATABASE_OUTAGE as err:  # the launch's own failure is the one to report
            self.log.warning("Could not record the %s of run %s as owed still: %s", action, failed_run_id,
                             waits.outage_line(err))

    def _launch_looked_at(self, event: dict[str, Any], launch: dict[str, Any]) -> dict[str, Any]:
        """The wait failed, not the launch as far as anyone knows (the state database away past the
        deadline, Kafka away while the first batch settled, a fault in the trigger).  One look decides what
        it can.  A launch still undecided fails the task and stays in the task state: the retry picks the run
        up, where the failure path (``on_fail``) or a fresh start could put a second driver beside it."""
        look = self.controller.launch_wait(launch, "ready", math.inf)  # no settling: a running query decides
        try:
            outcome = self.controller.look(look)
        except waits.DATABASE_OUTAGE as err:
            self.log.warning("Could not look at run %s again: %s", launch["run_id"], waits.outage_line(err))
            outcome = None
        if outcome is None:
            raise LaunchUndecided(launch, f"{event['message']}. Run {launch['run_id']} was submitted and may be "
                                          "starting still: a retry of this task picks it up rather than launching "
                                          "another")
        self.log.warning("%s. Run %s, looked at again: %s", event["message"], launch["run_id"], outcome)
        return {"outcome": outcome, "run_id": launch["run_id"]}

    def refuse_during_upgrade(self, action: str) -> None:
        """Fail before anything is done while an upgrade stops, starts, verifies or rolls back the job: a
        ``action`` beside it would start a second driver on the same checkpoint."""
        found = self.controller.latest_upgrade()
        if recovery.upgrade_in_charge(found, time.time()):
            raise AirflowFailException(
                f"job {self.job.job_id}: upgrade {found.upgrade_id} to version {found.to_version} is in phase "
                f"{found.phase.value}, and acts on the job itself; a {action} beside it would start a second "
                "driver on the same checkpoint. Nothing was done: run this again once the upgrade's task has "
                "ended (stream_upgrades in the state database shows its phase)")

    # -- the graceful stop flow ---------------------------------------------------------------------------
    def stop_then(self, context, run_id: str, after: str, carry: dict[str, Any]) -> Any:
        """The stop marker, then wait; SIGTERM and a kill only after the timeouts; then
        ``after(context, result, **carry)``."""
        began = time.time()
        wait = self.controller.stop_step(run_id, STOP_STAGES[0], float(self.stop_timeout))
        return self.wait_then(context, wait, "_stop_waited", run_id=run_id, stage=0, began=began, after=after,
                              carry=carry)

    def _stop_waited(self, context, event, run_id, stage, began, after, carry) -> Any:
        if self.outcome(event) != "ended" and stage + 1 < len(STOP_STAGES):
            wait = self.controller.stop_step(run_id, STOP_STAGES[stage + 1], float(self.kill_grace))
            return self.wait_then(context, wait, "_stop_waited", run_id=run_id, stage=stage + 1, began=began,
                                  after=after, carry=carry)
        result = self.controller.finish_stop(run_id, STOP_OUTCOMES[stage], began)
        return self.resume(context, after, result, carry)

    def stop_live_then(self, context, after: str, carry: dict[str, Any]) -> Any:
        """Stop the live run if there is one, then ``after(context, stop result or None, **carry)``."""
        return self.stop_run_then(context, self.live_run(), after, carry)

    def stop_run_then(self, context, live: RunRecord | None, after: str, carry: dict[str, Any]) -> Any:
        """``stop_live_then`` for the live run ``live`` found already (None: there is none)."""
        if live is None:
            return self.resume(context, after, None, carry)
        return self.stop_then(context, live.run_id, after, carry)

    # -- restart from the checkpoint ---------------------------------------------------------------------
    def restart_then(self, context, reason: str, failed_run_id: str | None, after: str,
                     carry: dict[str, Any]) -> Any:
        """A new run on the current generation, launched as the failed run was: Spark replays the
        unfinished batch, the sink skips what was committed."""
        flow = {"reason": reason, "failed_run_id": failed_run_id, "after": after, "carry": carry}
        self._begin("restart", reason, failed_run_id)  # before the stop of a live (STUCK) run
        faults.maybe_crash("restart_before_stop")  # the task lost between its begin and its stop
        return self.stop_live_then(context, "_restart_stopped", flow)

    def _begin(self, action: str, reason: str, run_id: str | None) -> None:
        """Record ``action`` (a restart, a reset) of ``run_id`` begun, before anything it does can fail: if its
        launch then fails or its task is lost, the run it stopped is no stop someone asked for, and the next
        recovery finishes it.  Not again where the job's newest record is that one, begun already (this task's
        retry, a recovery finishing it): the launch completes the one record, and the attempt counts once."""
        if not self._owed(action, run_id):
            self.controller.record_restart(action, reason, run_id, None, self._lease_owner)

    def _owed(self, action: str, run_id: str | None) -> bool:
        """Whether the job's newest restart record is ``action`` of ``run_id``, begun and not launched yet."""
        return recovery.begun_for(self.state.store.latest_restart(self.job.job_id), action, run_id)

    def _restart_stopped(self, context, stopped, reason, failed_run_id, after, carry) -> Any:
        faults.maybe_crash("restart_after_stop")  # the task lost between its stop and its launch
        self.controller.before_restart(reason, failed_run_id)
        failed = self.controller.get_run(failed_run_id) if failed_run_id else None
        recorded = self.controller.recorded_launch(failed)
        flow = {"reason": reason, "failed_run_id": failed_run_id, "after": after, "carry": carry}
        launch = {"application": recorded[0], "spec_json": recorded[1].to_json()} if recorded else {}
        return self.launch_then(context, "_restart_launched", flow, restart=("restart", reason, failed_run_id),
                                **launch)

    def _restart_launched(self, context, launched, reason, failed_run_id, after, carry) -> Any:
        return self.resume(context, after, {**launched, "action": "restart"}, carry)

    # -- reset to a new generation -------------------------------------------------------------------------
    def reset_then(self, context, reason: str, after: str, carry: dict[str, Any], *,
                   allow_data_loss: bool = False, spec_json: str | None = None,
                   application: str | None = None, on_fail: str | None = None) -> Any:
        """Archive the current generation and start the next one from the offsets stored with the results
        (checked against Kafka; offsets it no longer holds fail unless ``allow_data_loss``).  A reset or a
        launch that fails after the live run's stop goes to ``on_fail(context, error, **carry)`` when given."""
        flow = {"reason": reason, "allow_data_loss": allow_data_loss, "spec_json": spec_json,
                "application": application, "after": after, "carry": carry, "on_fail": on_fail}
        live = self.live_run()
        if on_fail is None:  # an upgrade (``on_fail``) undoes a failed reset itself: it rolls back
            flow["failed_run_id"] = self._reset_begun(reason, live)
        return self.stop_run_then(context, live, "_reset_stopped", flow)

    def _reset_begun(self, reason: str, live: RunRecord | None) -> str | None:
        """The run this reset stops (``live``), recorded as a reset begun before the stop (``_begin``).  With no
        live run: the run a reset begun earlier stopped (this task's retry, a recovery finishing it), whose
        record the launch then completes; or a run that failed or died by itself, recorded likewise, so that
        once this task has ended in Airflow without launching, the reset is owed (``recovery``)."""
        run = live
        if run is None:
            run = self.state.latest_run(self.job.job_id)
            if run is None:
                return None
            if self._owed("reset", run.run_id):
                return run.run_id
            if run.status not in (RunStatus.FAILED, RunStatus.DEAD) or run.stop_requested_at is not None:
                return None  # stopped on purpose: a reset lost now leaves it as it was
        self._begin("reset", reason, run.run_id)
        return run.run_id

    def _reset_stopped(self, context, stopped, reason, allow_data_loss, spec_json, application, after,
                       carry, on_fail=None, failed_run_id=None) -> Any:
        job = StreamJobSpec.from_dict(json.loads(spec_json)) if spec_json else self.job
        try:
            reset = self.controller.before_reset(job, reason, allow_data_loss=allow_data_loss)
        except Exception as err:
            if on_fail:  # the live run is stopped already: the flow's own failure path (an upgrade rolls back)
                return self.resume(context, on_fail, err, carry)
            raise
        return self.launch_reset(context, job, reset, reason, after, carry, application=application,
                                 on_fail=on_fail, failed_run_id=failed_run_id)

    def launch_reset(self, context, job: StreamJobSpec, reset: dict[str, Any], reason: str, after: str,
                     carry: dict[str, Any], *, application: str | None = None, on_fail: str | None = None,
                     failed_run_id: str | None = None) -> Any:
        """Launch ``job`` on the generation ``reset`` prepared (``before_reset``), then ``after``; the launch
        completes the record of the reset begun by the stop of ``failed_run_id`` (``_reset_begun``)."""
        flow = {"reason": reason, "reset": reset, "after": after, "carry": carry, "on_fail": on_fail}
        return self.launch_then(context, "_reset_launched", flow, application=application,
                                spec_json=job.to_json(), generation=reset["generation"],
                                starting_offsets=reset["starting_offsets"],
                                restart=("reset", reason, failed_run_id),
                                on_fail="_reset_failed" if on_fail else None)

    def _reset_failed(self, context, error, reason, reset, after, carry, on_fail) -> Any:
        return self.resume(context, on_fail, error, carry)

    def _reset_launched(self, context, launched, reason, reset, after, carry, on_fail=None) -> Any:
        info = {k: reset[k] for k in ("archived_generation", "archive_path", "starting_offsets", "lost_ranges")}
        return self.resume(context, after, {**launched, "action": "reset", **info}, carry)

    def done(self, context, result, **extra) -> Any:
        """The end of a flow: the task's result (XCom)."""
        return {**result, **extra} if isinstance(result, dict) else result


def flag(value: Any, name: str) -> bool:
    """A templated flag renders to the string "False" without native rendering: never read that as yes."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    raise AirflowFailException(f"{name}={value!r}: expected true or false")


def _still_starting(run: RunRecord | None, launch: dict[str, Any]) -> bool:
    if run is not None:
        return run.active
    if launch.get("submission_id") and not launch.get("pid"):
        # A cluster's application, not registered yet (it may wait in the cluster's queue): nothing here can
        # see its process, so the launch wait's deadline decides; launching again would start a second driver.
        return True
    from airflow_stream_provider import local_driver

    # Started from another host: only its registration or the launch wait's deadline can tell.
    return bool(launch.get("pid")) and local_driver.launch_alive(
        launch["pid"], launch.get("host"), launch.get("submitted_at")) is not False


class LeaseLost(AirflowFailException):
    """This task's hold on the job's lease broke (while it waited, or during a step that outlasted it): another
    task took it, and may have changed the job.  No retry: a person looks first, as the message says."""


class LaunchUndecided(StreamJobError):
    """A launch whose wait failed and whose driver may be starting still: the task fails for its retry to pick
    the launch up (from the task state), and keeps the job's lease until then."""

    def __init__(self, launch: dict[str, Any], message: str):
        super().__init__(message)
        self.launch = launch


def _lease_launch(launch: dict[str, Any] | None, spark_conn_id: str) -> dict[str, Any] | None:
    """What the lease's row names of a launch, as whoever undoes its task needs it."""
    if not launch:
        return None
    named = {k: launch.get(k) for k in ("run_id", "pid", "host", "submitted_at", "submission_id")}
    if named["submission_id"]:  # a cluster-mode driver (no pid here): its cluster manager, by this connection
        named["spark_conn_id"] = spark_conn_id
    return named


def _task_instance(context) -> Any:
    """The task instance running this task; None outside a task run (a test, a command line)."""
    return context.get("ti") if context else None


def _lease_owner(context, task: BaseOperator) -> str:
    """The task instance (``holders.lease_owner``); outside a task run, this operator object."""
    ti = _task_instance(context)
    return lease_owner(ti) if ti is not None else f"{task.task_id}@{id(task):x}"


def _task_ended(context, owner: str, log) -> bool:
    """Whether Airflow says the lease owner ``owner`` has ended, asked through this task's instance."""
    ti = _task_instance(context)
    return task_ended(owner, log, getattr(ti, "get_task_states", None))


def _task_state(context, key: str) -> Any:
    store = context.get("task_state_store") if context else None
    try:
        return store.get(key) if store is not None else None
    except Exception:  # a store that cannot answer must not stop the task: the launch just isn't resumable
        return None


def _set_task_state(context, key: str, value: Any) -> None:
    store = context.get("task_state_store") if context else None
    if store is None:
        return
    try:
        store.set(key, value) if value is not None else store.delete(key)
    except Exception as err:
        import logging

        logging.getLogger(__name__).warning("Could not record %s in the task state: %r", key, err)
