"""The warm standby: a second driver that warms up, registers as STANDBY, waits, and takes the job over
when its active run is dead.

Warm means what a cold start pays for is already paid: the JVM and SparkSession, the Kafka client, the
source's planning code, the job's own parse and results code planned once, Python workers forked and the
``foreachBatch`` callback server up (:meth:`Standby.warm_up` runs the job's code on a throw-away query
over the last records of its topics).  What a takeover still costs is the query start and one batch.

When it takes over is ``takeover.decide``: the active run's process is gone (same host) or its heartbeat
is older than ``heartbeat_timeout_seconds`` (anywhere).  Taking over is a compare-and-set on the job's
epoch (``StateStore.begin_run(expected_epoch=...)``), so of two standbys only one wins, and the new epoch
fences a zombie that comes back: its commits are rejected (invariant 3) and it ends at its next heartbeat.
The new run resumes the same checkpoint generation; Spark replays the unfinished batch and the sink skips
what was committed.

A standby does not replace a run that FAILED: that is the recovery's call, inside its restart budget
(a crash loop must not burn through standbys).  A clean stop of the job ends it.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from airflow_stream_provider import local_driver
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus
from airflow_stream_provider.state.store import RunTicket, StateStore
from airflow_stream_provider.takeover import Verdict, decide

log = logging.getLogger("airflow_stream_provider.standby")

#: How often a waiting standby looks at the active run: the state database is read once per look, and a
#: process check is a system call.  A kill is seen within this.
POLL_S = 0.2
#: The warm-up query gives up after this; the standby still waits (cold parts are then paid at takeover).
WARM_UP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Takeover:
    ticket: RunTicket
    replaced: RunRecord
    why: str


class Standby:
    """One standby driver's life in the state database: register, warm up, wait, take over or end."""

    def __init__(self, store: StateStore, spec: StreamJobSpec, standby_id: str, *, pid: int,
                 log_path: str | None):
        self.store, self.spec, self.standby_id = store, spec, standby_id
        self.host, self.pid, self.log_path = socket.gethostname(), pid, log_path
        self.log = StandbyLog(store)

    def register(self) -> bool:
        """Record this standby WARMING; False when it was ended before its driver came up."""
        spec = self.spec
        if not self.log.register(self.standby_id, spec.job_id, spec.version, spec.generation, host=self.host,
                                 pid=self.pid, log_path=self.log_path):
            record = self.log.get(self.standby_id)
            log.info("standby %s was ended before its driver came up (%s): exiting", self.standby_id,
                     record.message if record else "")
            return False
        log.info("job %s version %s generation %s: standby %s registered, warming up", spec.job_id, spec.version,
                 spec.generation, self.standby_id)
        return True

    def warm_up(self, query: Callable[[str], object]) -> float:
        """Run ``query(checkpoint_dir)`` (the harness's throw-away query over the job's code, which returns
        a started ``StreamingQuery``) until one batch went through, then stop it.  Best effort: a failed
        warm-up is logged and the standby waits anyway."""
        began = time.monotonic()
        scratch = tempfile.mkdtemp(prefix=f"standby-{self.spec.job_id}-")
        try:
            running = query(f"file://{scratch}")
            deadline = time.monotonic() + WARM_UP_TIMEOUT_S
            # Done once a batch went through (a live topic keeps it busy: one is enough), or once it waits
            # for data where the topics hold none (then only the source's planning was warmed).
            while running.isActive and time.monotonic() < deadline:
                status = running.status
                if running.lastProgress is not None or (
                        not status["isTriggerActive"] and status["message"].startswith("Waiting for data")):
                    break
                time.sleep(0.05)
            running.stop()
            if running.exception() is not None:
                log.warning("standby warm-up query failed (the takeover pays for it): %s", running.exception())
        except Exception as err:
            log.warning("standby warm-up failed (the takeover pays for it): %r", err)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        seconds = time.monotonic() - began
        self.log.ready(self.standby_id)
        log.info("standby %s is warm after %.1fs: waiting for run of job %s to need it", self.standby_id, seconds,
                 self.spec.job_id)
        return seconds

    def refusal(self) -> Verdict | None:
        """Checked before warming up: a standby that could never take over (another version, another
        generation) is refused at once, recorded."""
        run = self.store.latest_run(self.spec.job_id)
        verdict = decide(self.spec, run, self.store.current_generation(self.spec.job_id),
                         driver_alive=_alive(run))
        return self._end(verdict) if verdict.action == "refuse" else None

    def wait(self, stop_signalled: Callable[[], bool] = lambda: False) -> Takeover | Verdict:
        """Wait until the active run is dead and take it over (a :class:`Takeover`), or until this standby
        must not (a refusing or ending :class:`Verdict`, recorded)."""
        spec, next_heartbeat = self.spec, 0.0
        while True:
            if stop_signalled():
                return self._end(Verdict("end", "SIGTERM"))
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + spec.heartbeat_seconds
                status = self.log.heartbeat(self.standby_id)
                if status is not None and not status.live:
                    record = self.log.get(self.standby_id)
                    return Verdict("end", f"asked to end ({record.message if record else status.value})")
            run = self.store.latest_run(spec.job_id)
            verdict = decide(spec, run, self.store.current_generation(spec.job_id),
                             driver_alive=_alive(run))
            if verdict.action == "take_over":
                took = self._take_over(verdict)
                if took is not None:
                    return took
                continue  # another standby (or a launch) took the epoch first: watch the new run
            if verdict.action != "wait":
                return self._end(verdict)
            time.sleep(POLL_S)

    def _take_over(self, verdict: Verdict) -> Takeover | None:
        spec, dead = self.spec, verdict.run
        ticket = self.store.begin_run(spec.job_id, spec.generation, spec.version, run_id=self.standby_id,
                                      host=self.host, pid=self.pid, log_path=self.log_path,
                                      expected_epoch=dead.epoch)
        if ticket is None:
            log.info("standby %s: the epoch of job %s moved past %s before it could take over", self.standby_id,
                     spec.job_id, dead.epoch)
            return None
        why = f"standby {self.standby_id} took over: {verdict.why}"
        self.store.mark_dead(dead.run_id, why)
        self.log.took_over(self.standby_id, dead.run_id, verdict.why)
        log.warning("standby %s took over run %s of job %s with epoch %s: %s", self.standby_id, dead.run_id,
                    spec.job_id, ticket.epoch, verdict.why)
        return Takeover(ticket, dead, verdict.why)

    def _end(self, verdict: Verdict) -> Verdict:
        status = StandbyStatus.REFUSED if verdict.action == "refuse" else StandbyStatus.ENDED
        self.log.end(self.standby_id, status, verdict.why)
        (log.error if verdict.action == "refuse" else log.info)("standby %s %s: %s", self.standby_id,
                                                                 status.value.lower(), verdict.why)
        return verdict


def _alive(run: RunRecord | None) -> bool | None:
    return local_driver.alive_on_this_host(run.pid, run.host, run.started_at, run.submission_id) if run else None
