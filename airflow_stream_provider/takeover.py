"""When a warm standby takes a stream job over: the rule, pure (no Spark, no Airflow), so that the standby
driver applies it and tests read it in one place.

====================================  =========================================================
the job's latest run                  the standby
====================================  =========================================================
on another generation than the        refuses (recorded): a reset moved on; start a new standby
standby's
of another code version               refuses, naming both versions
none yet                              waits
STOPPED (a clean stop), or DEAD after  ends: nothing to stand by for (a stop's kill, or a
it was asked to stop                  restart's, must not be undone by a takeover)
FAILED                                waits: the recovery decides, inside the restart budget
DEAD, or its process is gone (same    takes over
host), or silent past
``heartbeat_timeout_seconds``
(anywhere, even if its process lives;
counted from ``silent_since`` when
later: after the standby's own
outage of the state database)
anything else                         waits
====================================  =========================================================
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

from airflow_stream_provider import diagnosis
from airflow_stream_provider.diagnosis import Health, Thresholds
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.records import RunRecord, RunStatus


@dataclass(frozen=True)
class Verdict:
    """What a waiting standby does next."""

    action: Literal["wait", "take_over", "refuse", "end"]
    why: str
    run: RunRecord | None = None


def decide(spec: StreamJobSpec, run: RunRecord | None, generation: int, *, driver_alive: bool | None,
           now: float | None = None, silent_since: float | None = None) -> Verdict:
    """The standby's rule, pure: ``run`` is the job's latest run, ``generation`` its current generation,
    ``driver_alive`` the process check where it is possible (else None: the heartbeat decides).
    ``silent_since``: when the standby could read the state database again after an outage; the run could
    not heartbeat into it either, so its silence counts from then at the earliest."""
    if generation != spec.generation:
        return Verdict("refuse", f"the job is on generation {generation}, this standby was started for generation "
                                 f"{spec.generation}: start a standby for the current generation", run)
    if run is None:
        return Verdict("wait", "no run of the job yet")
    if run.version != spec.version:
        return Verdict("refuse", f"standby version {spec.version!r} differs from version {run.version!r} of run "
                                 f"{run.run_id}: a standby takes over only the code it runs. Start a standby of "
                                 f"version {run.version!r}", run)
    if run.status == RunStatus.STOPPED:
        return Verdict("end", f"the job was stopped cleanly (run {run.run_id})", run)
    if run.status == RunStatus.FAILED:
        return Verdict("wait", f"run {run.run_id} failed ({run.failure_kind}): its recovery is decided within the "
                               "restart budget", run)
    being_stopped = run.stop_requested_at is not None  # its end, however it comes, is the diagnosis's below
    if run.status == RunStatus.DEAD and not being_stopped:
        return Verdict("take_over", run.termination_message or f"run {run.run_id} is recorded DEAD", run)
    now = time.time() if now is None else now
    heard = run
    if silent_since is not None and (run.heartbeat_at or run.started_at or now) < silent_since:
        heard = replace(run, heartbeat_at=silent_since)  # its silence before then was the database's
    silent = now - (heard.heartbeat_at or heard.started_at or now)
    if run.running_query and silent > spec.heartbeat_timeout_seconds and not being_stopped:
        # Alive or not: a driver silent this long is not processing (hung, paused, cut off).  The new epoch
        # fences it should it come back; it then finds itself fenced and exits.
        alive = " although its process lives" if driver_alive else ""
        return Verdict("take_over", f"run {run.run_id} sent no heartbeat for {silent:.0f}s (timeout "
                                    f"{spec.heartbeat_timeout_seconds:.0f}s){alive}", run)
    found = diagnosis.diagnose(spec.job_id, heard, driver_alive=driver_alive, lag=None, now=now,
                               thresholds=Thresholds(heartbeat_timeout_s=spec.heartbeat_timeout_seconds))
    if found.health == Health.DEAD:  # asked to stop and gone since: a takeover would undo the stop
        return Verdict("end" if found.stop_requested_at is not None else "take_over", "; ".join(found.evidence),
                       run)
    return Verdict("wait", f"run {run.run_id} is {found.health.value}", run)
