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

A successor is an upgrade's new version warmed up the same way while the old version still runs.  It
takes nothing over by itself: the upgrade stops the old run, then releases the successor with the
generation to run (the same, or n+1 after a reset) and the epoch it saw, and the successor starts at once.
A successor no upgrade will release ends by itself: its upgrade finished without releasing it, or lost its
task (one that died without either its operator's or its trigger's ``on_kill``), or none held it.  One
ended by someone else (an abort, a killed upgrade task, a stop of the job) sees it at its next heartbeat,
its warm-up included.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import InterfaceError, OperationalError

from airflow_stream_provider import local_driver
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import STANDBY, SUCCESSOR, StandbyLog, StandbyStatus
from airflow_stream_provider.state.store import LaunchCancelled, RunTicket, StateStore
from airflow_stream_provider.state.upgrades import UPGRADE_STALE_S, UpgradeLog, UpgradePhase
from airflow_stream_provider.takeover import Verdict, decide

log = logging.getLogger("airflow_stream_provider.standby")

#: How often a waiting standby looks at the active run: the state database is read once per look, and a
#: process check is a system call.  A kill is seen within this.
POLL_S = 0.2
#: The warm-up query gives up after this; the standby still waits (cold parts are then paid at takeover).
WARM_UP_TIMEOUT_S = 120.0
#: How long the warm-up's stop may take before the standby stops waiting for it: a batch stuck in the job's
#: own code keeps ``StreamingQuery.stop`` from returning.
WARM_UP_STOP_S = 30.0
#: A waiting standby runs its warm-up query again this often, in the background.  Spark retires the idle
#: Python workers of each worker kind after a minute without use (PythonWorkerFactory), and a query start
#: uses several kinds (data source lookup, creation, read planning, the reads): a standby that waited
#: longer would fork and import them all again at takeover.  About a second of work each time.  (The
#: tests shorten it, so that takeovers meet a re-warm in flight.)
REWARM_S = float(os.environ.get("STREAM_STANDBY_REWARM_S", "45"))
#: How long a standby that ends tries to record its end in a state database that does not answer: a SIGTERM
#: asks it to go soon.
END_RECORD_S = 10.0
#: What a state database that does not answer raises (a restart, a failover, a locked SQLite file), as
#: ``lifecycle.waits.DATABASE_OUTAGE`` on the Airflow side: a standby rides it out, as the active driver does.
DATABASE_OUTAGE = (OperationalError, InterfaceError)


@dataclass(frozen=True)
class Takeover:
    ticket: RunTicket
    #: the run taken over (None for a successor: the upgrade stopped the old run itself)
    replaced: RunRecord | None
    why: str
    #: the spec the new run runs: a successor's names the generation and offsets of its release
    spec: StreamJobSpec


class Standby:
    """One standby driver's life in the state database: register, warm up, wait, take over or end."""

    def __init__(self, store: StateStore, spec: StreamJobSpec, standby_id: str, *, pid: int,
                 log_path: str | None, successor: bool = False):
        self.store, self.spec, self.standby_id = store, spec, standby_id
        self.host, self.pid, self.log_path = local_driver.this_host(), pid, log_path
        self.successor = successor
        self.log = StandbyLog(store)
        self.upgrades = UpgradeLog(store) if successor else None
        self._began = time.monotonic()
        self._query: Callable[[str], object] | None = None
        self._warmed_at = 0.0
        self._rewarm: threading.Thread | None = None
        #: when the state database stopped answering (monotonic), None while it answers
        self._outage_began: float | None = None
        #: when it answered again after the last outage (wall clock): the run's silence counts from there
        self._silent_since: float | None = None

    def register(self) -> bool:
        """Record this standby WARMING; False when it was ended before its driver came up."""
        spec = self.spec
        if not self.log.register(self.standby_id, spec.job_id, spec.version, spec.generation, host=self.host,
                                 pid=self.pid, log_path=self.log_path, role=SUCCESSOR if self.successor else STANDBY):
            record = self.log.get(self.standby_id)
            log.info("standby %s was ended before its driver came up (%s): exiting", self.standby_id,
                     record.message if record else "")
            return False
        log.info("job %s version %s generation %s: standby %s registered, warming up", spec.job_id, spec.version,
                 spec.generation, self.standby_id)
        return True

    def warm_up(self, query: Callable[[str], object],
                stop_signalled: Callable[[], bool] = lambda: False) -> float | Verdict:
        """Run ``query(checkpoint_dir)`` (the harness's throw-away query over the job's code, which returns
        a started ``StreamingQuery``) until one batch went through, then stop it.  Best effort: a failed
        warm-up is logged and the standby waits anyway.  While it waits, it runs it again every
        ``REWARM_S``.

        The warm-up runs beside the standby's heartbeat: a standby ended meanwhile (an aborted upgrade, a
        stop of the job, a task killed) returns its end :class:`Verdict` at once.  Job code that never
        returns holds a query no stop interrupts; after ``WARM_UP_TIMEOUT_S`` plus ``WARM_UP_STOP_S`` the
        standby waits without it."""
        began = time.monotonic()
        self._rewarm = threading.Thread(target=self._run, args=(query,), name="standby-warm-up", daemon=True)
        self._rewarm.start()
        next_heartbeat = 0.0
        while self._rewarm.is_alive():
            if stop_signalled():
                return self._end(Verdict("end", "SIGTERM"))
            if time.monotonic() >= next_heartbeat:
                next_heartbeat = time.monotonic() + self.spec.heartbeat_seconds
                try:
                    ended = self._asked_to_end()
                    self._database_answered()
                except DATABASE_OUTAGE as err:
                    self._database_away(err)
                    next_heartbeat = time.monotonic() + POLL_S
                    ended = None
                if ended is not None:
                    return ended
            if time.monotonic() - began > WARM_UP_TIMEOUT_S + WARM_UP_STOP_S:
                log.warning("standby %s: its warm-up query has not stopped %.0fs after it began (the job's "
                            "code does not return?): waiting without it", self.standby_id, time.monotonic() - began)
                break
            if self._needed_now():
                log.warning("standby %s: the active run needs it before its warm-up ended: taking over without "
                            "waiting for it", self.standby_id)
                break
            self._rewarm.join(POLL_S)
        seconds = time.monotonic() - began
        self._query = query
        while True:
            if stop_signalled():
                return self._end(Verdict("end", "SIGTERM"))
            try:
                ready = self.log.ready(self.standby_id)
                break
            except DATABASE_OUTAGE as err:
                self._database_away(err)
                time.sleep(POLL_S)
        self._database_answered()
        if not ready:  # ended after its last heartbeat: it must not come back as WAITING
            return self._ended() or Verdict("end", "its record is gone")
        log.info("standby %s is warm after %.1fs: waiting for run of job %s to need it", self.standby_id, seconds,
                 self.spec.job_id)
        return seconds

    def _needed_now(self) -> bool:
        """While warming up: whether the active run already needs this standby (its driver gone, its heartbeat
        silent), so that the takeover does not wait out the warm-up, while a recovery waits on this standby
        for a minute only.  A successor takes nothing over by itself."""
        if self.successor or self._outage_began is not None:  # the warm-up's heartbeat says when it answers
            return False
        try:
            return self._look().action == "take_over"
        except DATABASE_OUTAGE as err:
            self._database_away(err)
            return False

    def _keep_warm(self) -> None:
        """Start the warm-up query again in the background when it is due (the poll goes on meanwhile)."""
        due = self._query is not None and time.monotonic() - self._warmed_at >= REWARM_S
        if due and (self._rewarm is None or not self._rewarm.is_alive()):
            self._rewarm = threading.Thread(target=self._run, args=(self._query,), name="standby-rewarm",
                                            daemon=True)
            self._rewarm.start()

    def rewarming(self) -> bool:
        """A warm-up query started while waiting is still running (a takeover does not wait for it)."""
        return self._rewarm is not None and self._rewarm.is_alive()

    def _run(self, query: Callable[[str], object]) -> float:
        self._warmed_at = time.monotonic()
        return run_warm_up(query, self.spec.job_id)

    def refusal(self) -> Verdict | None:
        """Checked before warming up: a standby that could never take over (another version, another
        generation) is refused at once, recorded.  A successor is another version by design."""
        if self.successor:
            return None
        try:
            verdict = self._look()
        except DATABASE_OUTAGE as err:  # the wait refuses as well, once the database answers
            self._database_away(err)
            return None
        return self._end(verdict) if verdict.action == "refuse" else None

    def wait(self, stop_signalled: Callable[[], bool] = lambda: False) -> Takeover | Verdict:
        """Wait until the active run is dead and take it over (a :class:`Takeover`), or until this standby
        must not (a refusing or ending :class:`Verdict`, recorded)."""
        next_heartbeat = 0.0
        while True:
            if stop_signalled():
                return self._end(Verdict("end", "SIGTERM"))
            beat = time.monotonic() >= next_heartbeat
            if beat:
                next_heartbeat = time.monotonic() + self.spec.heartbeat_seconds
            try:
                outcome = self._poll(beat)
            except DATABASE_OUTAGE as err:
                self._database_away(err)
                if beat:  # beat again once it answers
                    next_heartbeat = 0.0
                outcome = None
            if outcome is not None:
                return outcome
            self._keep_warm()
            time.sleep(POLL_S)

    def _poll(self, beat: bool) -> Takeover | Verdict | None:
        """One look at the job (and, with ``beat``, at this standby's own row): what ends the wait, if anything."""
        if beat:
            ended = self._asked_to_end()
            if ended is not None:
                return ended
        if self.successor:
            took = self._released() or (self._unheld() if beat else None)
            self._database_answered()
            return took
        verdict = self._look()
        if verdict.action == "take_over":
            return self._take_over(verdict)  # None: another standby (or a launch) took the epoch first
        return None if verdict.action == "wait" else self._end(verdict)

    def _look(self) -> Verdict:
        """The takeover rule's verdict on the job as the state database has it now (``DATABASE_OUTAGE`` when
        it does not answer)."""
        run = self.store.latest_run(self.spec.job_id)
        generation = self.store.current_generation(self.spec.job_id)
        self._database_answered()
        return decide(self.spec, run, generation, driver_alive=local_driver.run_alive(run),
                      silent_since=self._silent_since)

    def _database_away(self, err: Exception) -> None:
        """A poll met a state database that does not answer: said once per outage; the poll is tried again."""
        if self._outage_began is None:
            self._outage_began = time.monotonic()
            log.warning("standby %s: the state database does not answer (%r): trying again every %.1fs",
                        self.standby_id, err, POLL_S)

    def _database_answered(self) -> None:
        """After an outage the active run could not heartbeat either: its silence counts from now."""
        if self._outage_began is None:
            return
        self._silent_since = time.time()
        log.warning("standby %s: the state database answers again after %.0fs; a run's silence counts from now",
                    self.standby_id, time.monotonic() - self._outage_began)
        self._outage_began = None

    def _take_over(self, verdict: Verdict) -> Takeover | Verdict | None:
        """Take the epoch from the dead run, if this standby is still live: it is ended (a stop of the job)
        between two heartbeats, while takeovers are decided at each poll.  None when another standby (or a
        launch) took the epoch first."""
        spec, dead = self.spec, verdict.run
        try:
            ticket = self.store.begin_run(spec.job_id, spec.generation, spec.version, run_id=self.standby_id,
                                          host=self.host, pid=self.pid, log_path=self.log_path,
                                          expected_epoch=dead.epoch,
                                          claim=lambda conn: self.log.took_over(conn, self.standby_id,
                                                                                dead.run_id, verdict.why))
        except LaunchCancelled as err:  # a task gave up on it as a launch (it waited on its takeover)
            return self._end(Verdict("end", str(err)))
        if ticket is None:
            ended = self._ended()
            if ended is None:
                log.info("standby %s: the epoch of job %s moved past %s before it could take over",
                         self.standby_id, spec.job_id, dead.epoch)
            return ended
        why = f"standby {self.standby_id} took over: {verdict.why}"
        try:  # the epoch is taken: the takeover goes on whatever this bookkeeping meets
            self.store.mark_dead(dead.run_id, why)
        except DATABASE_OUTAGE as err:
            log.warning("standby %s holds epoch %s; could not record its takeover of run %s: %r", self.standby_id,
                        ticket.epoch, dead.run_id, err)
        log.warning("standby %s took over run %s of job %s with epoch %s: %s", self.standby_id, dead.run_id,
                    spec.job_id, ticket.epoch, verdict.why)
        return Takeover(ticket, dead, verdict.why, spec)

    def _released(self) -> Takeover | Verdict | None:
        """A successor's start once the upgrade released it (None until then): the epoch the release saw
        is compared-and-set, so a run started since (a restart, another upgrade) refuses it."""
        record = self.log.get(self.standby_id)
        if record is None or record.release_generation is None:
            return None
        spec = self.spec.with_generation(record.release_generation, record.release_offsets)
        why = f"released by the upgrade to version {spec.version} on generation {spec.generation}"
        try:
            ticket = self.store.begin_run(spec.job_id, spec.generation, spec.version, run_id=self.standby_id,
                                          host=self.host, pid=self.pid, log_path=self.log_path,
                                          expected_epoch=record.release_epoch,
                                          claim=lambda conn: self.log.took_over(conn, self.standby_id, None, why))
        except LaunchCancelled as err:  # its upgrade gave up on the launch the release made of it
            return self._end(Verdict("end", str(err)))
        if ticket is None:
            return self._ended() or self._end(Verdict(
                "refuse", f"the epoch of job {spec.job_id} moved past {record.release_epoch} after the upgrade "
                          "released this successor: another run started"))
        log.warning("successor %s starts job %s version %s on generation %s with epoch %s", self.standby_id,
                    spec.job_id, spec.version, spec.generation, ticket.epoch)
        return Takeover(ticket, None, why, spec)

    def _asked_to_end(self) -> Verdict | None:
        """Beat; the end its record holds if something ended this standby (an upgrade's abort or its killed
        task, a stop of the job, a newer standby's start)."""
        status = self.log.heartbeat(self.standby_id)
        return None if status is None or status.live else self._ended()

    def _ended(self) -> Verdict | None:
        """The end its record holds if something ended this standby, else None."""
        record = self.log.get(self.standby_id)
        if record is None or record.status.live:
            return None
        verdict = Verdict("end", f"asked to end ({record.message or record.status.value})")
        log.info("standby %s ends: %s", self.standby_id, verdict.why)
        return verdict

    def _unheld(self) -> Verdict | None:
        """Why no upgrade will release this successor, if none will: the job's latest upgrade, which holds
        it until the release, finished or stopped moving; or no upgrade took it within ``UPGRADE_STALE_S``
        (its task failed before recording it).  Checked at each heartbeat, after the release: the upgrade
        releases it before it lets go of it in its record."""
        upgrade = self.upgrades.latest(self.spec.job_id)
        if upgrade is None or upgrade.successor_id != self.standby_id:
            if time.monotonic() - self._began < UPGRADE_STALE_S:
                return None  # its upgrade records it right after starting it
            why = f"no upgrade of job {self.spec.job_id} holds it after {UPGRADE_STALE_S:.0f} s"
        elif upgrade.phase == UpgradePhase.DONE:
            why = f"upgrade {upgrade.upgrade_id} ended ({upgrade.result}) without releasing it"
        elif upgrade.stale(time.time()):
            why = (f"upgrade {upgrade.upgrade_id} has stayed in phase {upgrade.phase.value} for "
                   f"{UPGRADE_STALE_S:.0f} s: its task is gone")
        else:
            return None
        return self._end(Verdict("end", why))

    def _end(self, verdict: Verdict) -> Verdict:
        """Record the end and return it.  A state database that does not answer is tried again for up to
        ``END_RECORD_S`` (a SIGTERM during an outage; a try the database holds up lasts its own timeout):
        then the standby ends unrecorded, and its row is found by its silent heartbeat, instead of the
        driver failing on the error it met."""
        status = StandbyStatus.REFUSED if verdict.action == "refuse" else StandbyStatus.ENDED
        deadline = time.monotonic() + END_RECORD_S
        while True:
            try:
                self.log.end(self.standby_id, status, verdict.why)
                break
            except DATABASE_OUTAGE as err:
                self._database_away(err)
                if time.monotonic() >= deadline:
                    log.warning("standby %s ends (%s) without recording it: the state database has not answered "
                                "for %.0fs; its row is found by its silent heartbeat", self.standby_id,
                                verdict.why, END_RECORD_S)
                    return verdict
                time.sleep(POLL_S)
        (log.error if verdict.action == "refuse" else log.info)("standby %s %s: %s", self.standby_id,
                                                                 status.value.lower(), verdict.why)
        return verdict


def run_warm_up(query: Callable[[str], object], job_id: str) -> float:
    """Run ``query(checkpoint_dir)`` (the harness's throw-away query over the job's code, which returns a
    started ``StreamingQuery``) on a scratch checkpoint until one batch went through, then stop it; return
    the seconds it took.  Best effort: a failure is logged, not raised."""
    began = time.monotonic()
    scratch = tempfile.mkdtemp(prefix=f"standby-{job_id}-")
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
            log.warning("warm-up query failed (a later start pays for what it would have loaded): %s",
                        running.exception())
    except Exception as err:
        log.warning("warm-up failed (a later start pays for what it would have loaded): %r", err)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return time.monotonic() - began
