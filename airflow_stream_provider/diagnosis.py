"""Health of a stream job, concluded in one place from what the state database and the driver show.

Pure (no airflow, no pyspark): the sensors, triggers, operators and the command line all call
``diagnose`` with facts they gathered, so the same evidence always yields the same verdict.
"""

from __future__ import annotations

import enum
import functools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_stream_provider import failures
from airflow_stream_provider.settings_numbers import finite_number
from airflow_stream_provider.spec import parse_interval
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import StandbyRecord
from airflow_stream_provider.state.store import ACTIVE_STATUSES, DEAD, FAILED, STARTING, STOPPED


class Health(enum.StrEnum):
    STARTING = "STARTING"  # driver up, query not yet running
    HEALTHY = "HEALTHY"
    STUCK = "STUCK"  # alive, no committed batch for a while, Kafka lag > 0
    DEAD = "DEAD"  # driver gone without a clean stop (kill -9, OOM killer, lost host)
    STOPPED = "STOPPED"  # clean stop, or never started
    FAILED = "FAILED"  # terminated with a classified error

    @property
    def needs_action(self) -> bool:
        return self in (Health.STUCK, Health.DEAD, Health.FAILED)


#: ``Diagnosis.standby`` of a run that wants a standby and has none warm or warming
MISSING_STANDBY = "MISSING"

# -- conditions: what a watcher reports and a sensor waits for -----------------------------------------
#: A healthy run that wants a warm standby and has none (``Diagnosis.needs_standby``).
NO_STANDBY = "NO_STANDBY"
#: A run owed the restart (or reset) begun for it, which launched nothing after (``Diagnosis.restart_owed``):
#: STOPPED (or DEAD) by that restart's own stop, yet nobody asked for the stop; or dead, failed or stuck, with
#: the task that began the restart ended in Airflow.
INTERRUPTED_RESTART = "INTERRUPTED_RESTART"
#: Every condition a job can be in: its health values and the two above.
CONDITIONS = (*(h.value for h in Health), NO_STANDBY, INTERRUPTED_RESTART)


def check_conditions(fire_on, allowed=CONDITIONS, who: str = "a sensor waits for") -> None:
    """Fail, naming the bad values and the good ones, where ``fire_on`` holds a value not in ``allowed``
    (the conditions ``who`` handles)."""
    if isinstance(fire_on, str):
        raise ValueError(f"fire_on={fire_on!r} must be a list of conditions, e.g. [{fire_on!r}]")
    unknown = sorted(set(fire_on) - set(allowed))
    if unknown:
        raise ValueError(f"fire_on {unknown} are not conditions {who}; choose from {list(allowed)}")


def check_failure_kinds(failure_kinds, fire_on) -> None:
    """Fail where ``failure_kinds`` names no kind of failure, or where ``fire_on`` leaves out FAILED: the wait
    would end on nothing."""
    if isinstance(failure_kinds, str):
        raise ValueError(f"failure_kinds={failure_kinds!r} must be a list of failure kinds, e.g. [{failure_kinds!r}]")
    if not failure_kinds:  # none given: every condition in fire_on
        return
    known = list(failures.FailureKind.__members__)
    unknown = sorted(set(failure_kinds) - set(known))
    if unknown:
        raise ValueError(f"failure_kinds {unknown} are not kinds of failure; choose from {known}")
    if "FAILED" not in fire_on:
        raise ValueError(f"failure_kinds {list(failure_kinds)} name failed runs, but fire_on {list(fire_on)} leaves "
                         "out FAILED: add it, or leave failure_kinds out")


def check_seconds(**named: Any) -> None:
    """Fail, naming each, where a threshold given as a number is not a finite number of seconds above 0 (a
    templated one, text at parse time, is checked when it is used).  A stuck_after of 0 makes every query
    with records waiting STUCK; a poll interval of 0 polls the state database without pause."""
    wrong = [f"{name}={value!r}" for name, value in named.items()
             if not isinstance(value, str) and not (finite_number(value) and value > 0)]
    if wrong:
        raise ValueError(f"{', '.join(wrong)}: give a number of seconds above 0")


@dataclass(frozen=True)
class Thresholds:
    #: no heartbeat for this long means the driver is gone, where its process cannot be checked
    heartbeat_timeout_s: float = 30.0
    #: alive but no committed batch for this long while Kafka has unread records
    stuck_after_s: float = 300.0
    #: a driver heartbeats once its query runs; before that (session, first plan) only this bounds it
    start_timeout_s: float = 300.0


@dataclass
class Diagnosis:
    job_id: str
    health: Health
    failure_kind: failures.FailureKind | None = None
    error_class: str | None = None
    run_id: str | None = None
    generation: int | None = None
    epoch: int | None = None
    lag: int | None = None
    evidence: list[str] = field(default_factory=list)
    advice: str = ""
    #: when the conclusion was drawn (epoch seconds): detection latency is measured against it
    diagnosed_at: float | None = None
    #: for a run launched with ``standby`` on: its standby's status (WARMING, WAITING), or MISSING
    standby: str | None = None
    #: for a DEAD or FAILED run that was asked to stop (epoch seconds): it ended before it stopped cleanly
    stop_requested_at: float | None = None
    #: for a STOPPED or DEAD run that a restart or a reset stopped and launched nothing after (its launch
    #: failed, its task was lost): that record's ``at``, ``reason`` and ``action``.  No one asked for this
    #: stop: the job is down until a recovery finishes it (``recovery.interrupted_restart``)
    interrupted_restart: dict[str, Any] | None = None
    #: for a HEALTHY run whose driver process is alive but silent past its heartbeat timeout (hung, frozen,
    #: in a long pause): when it counts as STUCK if it stays silent (epoch seconds).  A watcher that cannot
    #: see the process (another host) has reported it DEAD; a recovery here looks again then.
    stuck_at: float | None = None

    @property
    def needs_standby(self) -> bool:
        """A healthy run that wants a warm standby and has none (after a takeover, or its standby died):
        the next death would cost a cold start."""
        return self.health == Health.HEALTHY and self.standby == MISSING_STANDBY

    @property
    def restart_owed(self) -> bool:
        """A restart begun for the run started nothing after, and nobody is finishing it (its stop ended the
        run, or its task has ended): a recovery must act, whatever the health says (STOPPED included)."""
        return self.interrupted_restart is not None

    @property
    def condition(self) -> str:
        """The one condition the job is in, the most specific first: the restart it is owed, the standby
        it lacks, else its health."""
        return INTERRUPTED_RESTART if self.restart_owed else NO_STANDBY if self.needs_standby else self.health.value

    @property
    def conditions(self) -> tuple[str, ...]:
        """Every condition that holds: ``condition`` and, where that is not a health value, the health too
        (a DEAD run owed a restart is both)."""
        condition = self.condition
        return (condition,) if condition == self.health.value else (condition, self.health.value)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["health"] = self.health.value
        data["failure_kind"] = self.failure_kind.value if self.failure_kind else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Diagnosis:
        data = dict(data)
        data["health"] = Health(data["health"])
        data["failure_kind"] = failures.FailureKind(data["failure_kind"]) if data.get("failure_kind") else None
        return cls(**data)

    def summary(self) -> str:
        kind = f"/{self.failure_kind.value}" if self.failure_kind else ""
        return f"job {self.job_id}: {self.health.value}{kind} (run {self.run_id}): " + "; ".join(self.evidence)


def diagnose(job_id: str, run: RunRecord | None, *, driver_alive: bool | None, lag: int | None,
             thresholds: Thresholds = Thresholds(), now: float | None = None) -> Diagnosis:
    """Conclude the job's health from its latest run row.

    ``driver_alive`` is the process check where it is possible (same host, or a cluster handle), else
    None and the heartbeat age decides.  ``lag`` is the number of Kafka records not yet applied.
    """
    now = time.time() if now is None else now
    if run is None:
        return Diagnosis(job_id, Health.STOPPED, lag=lag, evidence=["no run recorded for this job"],
                         advice="Submit the job.", diagnosed_at=now)
    base = {"run_id": run.run_id, "generation": run.generation, "epoch": run.epoch, "lag": lag,
            "diagnosed_at": now}
    heartbeat_age = now - (run.heartbeat_at or run.started_at or now)
    status = run.status
    if status == STOPPED:
        return Diagnosis(job_id, Health.STOPPED, **base,
                         evidence=[f"run stopped cleanly with exit code {run.exit_code}"],
                         advice="Nothing to do; submit the job to start it again.")
    if status == FAILED:
        # A kind this release does not know (a driver of a newer one recorded it) is UNKNOWN, not an error.
        kind = failures.FailureKind.__members__.get(run.failure_kind or "", failures.FailureKind.UNKNOWN)
        message = (run.termination_message or "").strip()
        classification = failures.classify(message, run.error_class)
        # A signature's advice where the text still shows the recorded kind; else (a start failure's own
        # message, a message cut short) what the kind itself calls for.
        advice = classification.advice if classification.kind == kind else kind.advice
        evidence = [f"driver exited with code {run.exit_code} ({_kind_named(run.failure_kind, kind)})",
                    f"error: {classification.evidence or _first_line(message)}"]
        if run.stop_requested_at is not None:  # its last batch failed while it stopped: stopped all the same
            evidence.append(f"it was asked to stop at {clock(run.stop_requested_at)} and failed before it "
                            "stopped cleanly")
            advice = (f"Nothing to restart: the job was being stopped. {advice} Submit the job to start it "
                      "again (the batch that failed is replayed; the sink skips what was committed).")
        return Diagnosis(job_id, Health.FAILED, kind, run.error_class, **base, evidence=evidence, advice=advice,
                         stop_requested_at=run.stop_requested_at)
    if status == DEAD:
        if run.stop_requested_at is not None:
            return _dead_while_stopping(job_id, run, run.termination_message or "its driver is gone", base)
        return Diagnosis(job_id, Health.DEAD, **base, evidence=[run.termination_message or "driver gone"],
                         advice="Restart from the checkpoint: the batch it was running is replayed and the "
                         "sink skips what was already committed.")
    if status not in ACTIVE_STATUSES:
        raise ValueError(f"unknown run status {status!r}")
    starting = status == STARTING or not run.query_started_at
    # Heartbeats begin once the query runs: a starting driver is bounded by the start timeout instead.
    limit = thresholds.start_timeout_s if starting else heartbeat_timeout(run, thresholds)
    # A process that is provably alive is never DEAD for a late heartbeat: on a loaded host, or in a long
    # GC pause, heartbeats lag.  Silent past ``stuck_after`` it is STUCK (below) and is restarted as such.
    if driver_alive is False or (driver_alive is None and heartbeat_age > limit):
        if driver_alive is False:
            gone = f"its driver process (pid {run.pid} on {run.host}) is gone"
        elif starting:
            gone = f"its query has not started {heartbeat_age:.0f}s after its start (timeout {limit:.0f}s)"
        else:
            gone = f"its last heartbeat is {heartbeat_age:.0f}s old (timeout {limit:.0f}s)"
        if run.stop_requested_at is not None:
            return _dead_while_stopping(job_id, run, f"run {run.run_id} is recorded as {status} but {gone}", base)
        evidence = [f"run {run.run_id} is recorded as {status} but {gone}"]
        if run.last_batch_id is not None:
            evidence.append(f"last committed batch {run.last_batch_id}")
        return Diagnosis(job_id, Health.DEAD, **base, evidence=evidence,
                         advice="Restart from the checkpoint: the batch it was running is replayed and the "
                         "sink skips what was already committed.")
    silent_limit = limit if starting else max(limit, thresholds.stuck_after_s)
    if driver_alive and heartbeat_age > silent_limit:
        silent = (f"its query has not started {heartbeat_age:.0f}s after its start" if starting
                  else f"its last heartbeat is {heartbeat_age:.0f}s old")
        return Diagnosis(job_id, Health.STUCK, **base,
                         evidence=[f"its driver process (pid {run.pid} on {run.host}) is alive but {silent} "
                                   f"(threshold {silent_limit:.0f}s)"],
                         advice="Stop the driver (it is alive but silent: hung or starved) and restart it from "
                         "the checkpoint; read its log, and a thread dump of its JVM, for where it hangs.")
    if starting:
        return Diagnosis(job_id, Health.STARTING, **base,
                         evidence=[f"driver up for {now - (run.started_at or now):.0f}s, query not started yet"])
    since = max(run.last_batch_at or 0, run.query_started_at or 0)
    idle = now - since
    no_progress = no_progress_limit(run, thresholds)
    if lag and idle > no_progress:
        return Diagnosis(job_id, Health.STUCK, **base,
                         evidence=[f"no batch committed for {idle:.0f}s (threshold {no_progress:.0f}s)",
                                   f"{lag} Kafka records wait to be applied",
                                   f"heartbeat {heartbeat_age:.0f}s ago: the driver is alive"],
                         advice="Stop the driver (it is alive but makes no progress) and restart it from the "
                         "checkpoint; read its log for the blocked batch.")
    evidence = [f"heartbeat {heartbeat_age:.0f}s ago", f"last batch {run.last_batch_id}", f"lag {lag}"]
    stuck_at = None
    if driver_alive and heartbeat_age > limit and run.stop_requested_at is None:  # a stop's own wait is silent
        stuck_at = now - heartbeat_age + silent_limit
        evidence.append(f"its driver process (pid {run.pid} on {run.host}) is alive but silent past its heartbeat "
                        f"timeout ({limit:.0f}s): STUCK if still silent in {stuck_at - now:.0f}s")
    return Diagnosis(job_id, Health.HEALTHY, **base, evidence=evidence, stuck_at=stuck_at)


def clock(at: float) -> str:
    """A moment for a message: UTC, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _kind_named(recorded: str | None, kind: failures.FailureKind) -> str:
    if recorded and recorded != kind.value:
        return f"{recorded}, a failure kind this release does not know: taken as {kind.value}"
    return kind.value


def heartbeat_timeout(run: RunRecord, thresholds: Thresholds) -> float:
    """The longer of the watcher's heartbeat timeout and the one the run was launched with (its spec's
    ``heartbeat_timeout_seconds``, as its standby uses): a job set to heartbeat slowly is not dead between two
    heartbeats because a sensor kept the default."""
    return max(thresholds.heartbeat_timeout_s, _spec_heartbeat_timeout(run.spec))


def no_progress_limit(run: RunRecord, thresholds: Thresholds) -> float:
    """How long a run with records waiting may go without committing a batch: ``stuck_after``, past the run's
    own trigger interval (its spec's ``trigger_interval``): a job that triggers hourly commits at most hourly,
    and is not stuck between two triggers."""
    return thresholds.stuck_after_s + _spec_trigger_seconds(run.spec)


@functools.lru_cache(maxsize=256)
def _spec_trigger_seconds(spec_json: str | None) -> float:
    try:
        interval = json.loads(spec_json).get("trigger_interval") if spec_json else None
        return parse_interval(interval) if interval is not None else 0.0
    except (ValueError, TypeError, AttributeError):  # a spec recorded by another release: the threshold decides
        return 0.0


@functools.lru_cache(maxsize=256)
def _spec_heartbeat_timeout(spec_json: str | None) -> float:
    try:
        return float(json.loads(spec_json).get("heartbeat_timeout_seconds") or 0.0) if spec_json else 0.0
    except (ValueError, TypeError, AttributeError):  # a spec recorded by another release: the threshold decides
        return 0.0


def _dead_while_stopping(job_id: str, run: RunRecord, gone: str, base: dict[str, Any]) -> Diagnosis:
    """A run asked to stop whose driver ended without a clean stop: killed once the stop timed out, or dead
    during it.  DEAD (no clean stop was recorded), with ``stop_requested_at`` set: the recovery leaves it
    stopped, as asked, rather than undo the stop (or race the restart, reset or upgrade that asked for it).
    The sink's transactions keep its results and offsets consistent."""
    return Diagnosis(job_id, Health.DEAD, **base, stop_requested_at=run.stop_requested_at,
                     evidence=[gone, f"it was asked to stop at {clock(run.stop_requested_at)} and ended before "
                               "it stopped cleanly"],
                     advice="Nothing to restart: the job was being stopped. Submit it to start it again (it "
                     "resumes after its last committed batch; the batch cut short is replayed and the sink "
                     "skips what was committed).")


def note_standby(found: Diagnosis, standby: StandbyRecord | None) -> Diagnosis:
    """Add what is known of the standby of a run that wants one (``standby`` is its live standby)."""
    found.standby = standby.status.value if standby else MISSING_STANDBY
    found.evidence.append(standby.describe() if standby else "no standby is warm")
    return found


def lag_matters(run: RunRecord | None, thresholds: Thresholds, now: float | None = None) -> bool:
    """Whether the Kafka lag could change the verdict: only for a running query idle for longer than
    ``stuck_after`` (the lag then tells STUCK from an idle stream).  A watcher of many jobs reads
    Kafka only for those."""
    if run is None or run.status not in ACTIVE_STATUSES or not run.query_started_at:
        return False
    now = time.time() if now is None else now
    return now - max(run.last_batch_at or 0, run.query_started_at) > thresholds.stuck_after_s


def _first_line(text: str) -> str:
    return text.splitlines()[0][:300] if text else ""
