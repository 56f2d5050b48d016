"""How long a job is down: cold start, kill -9 recovery (this provider and the baseline), an incompatible
upgrade, and how recovery and reset scale with checkpoint history and partitions.

Every time is read from the ledger the sink writes in its commit transaction ("first batch committed")
against wall-clock moments taken here (the kill, the trigger); a live trickle of events keeps the job
busy, so a recovered driver commits as soon as it can.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable

from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus
from benchmarks.audit import Audit, audit
from benchmarks.stack import (
    EVENTS_JOB,
    EVENTS_JOB_V2,
    Job,
    Stack,
    driver_processes,
    kill_driver_tree,
    say,
    tree_rss,
)
from stack.events import Trickle

#: The example health DAG's sensor looks every 2 s; a kill lands anywhere in that interval.
POLL_INTERVAL_S = 2.0


def _wait(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def _processing(job: Job) -> RunRecord:
    """The live run, once it has committed a batch."""
    def ready():
        run = job.latest_run()
        if run and run.status == "RUNNING" and run.pid and job.first_commit(run_id=run.run_id):
            return run
        return None

    return _wait(ready, 300, f"job {job.job_id} to process")


class _Watching:
    """Set when the polling health DAG's deferred sensor starts polling.  ``dag.test()`` runs the trigger in
    this process, so wrapping the trigger class's ``run`` observes it without changing what it does."""

    event = threading.Event()

    @classmethod
    def install(cls) -> None:
        from airflow_stream_provider.triggers.health import StreamHealthTrigger

        if getattr(StreamHealthTrigger.run, "_observed", False):
            return
        original = StreamHealthTrigger.run

        async def run(self):
            cls.event.set()
            async for event in original(self):
                yield event

        run._observed = True
        StreamHealthTrigger.run = run


def _audit(job: Job, producer, total: Audit) -> None:
    found = audit(job.store, job.job_id, producer.produced)
    say(f"  {job.job_id}: {found}")
    total += found


def _finish(stack: Stack, job: Job, producer, total: Audit) -> None:
    stack.trigger_ok("stream_stop")
    producer.close()
    _audit(job, producer, total)


# -- kill -9 with this provider ----------------------------------------------------------------------
def kill_and_recover(stack: Stack, job: Job) -> tuple[float, float, float]:
    """While ``bench_polling_health``'s sensor is deferred (under ``dag.test()``: the best case), SIGKILL
    the driver at a random moment of the poll interval; return (kill -> diagnosis DEAD, kill -> first
    batch committed by the recovered run, the crash-loop backoff the recover operator slept, which is part
    of the second)."""
    victim = _processing(job)
    killed_at: list[float] = []
    _Watching.install()
    _Watching.event.clear()

    def kill_when_watched():
        if not _Watching.event.wait(120):
            return
        time.sleep(random.uniform(0, POLL_INTERVAL_S))
        killed_at.append(time.time())
        kill_driver_tree(victim.pid)

    killer = threading.Thread(target=kill_when_watched, daemon=True)
    killer.start()
    tasks = stack.trigger_ok("bench_polling_health")
    killer.join(30)
    diagnosis, recovered = tasks["health"], tasks["recover"]
    if not killed_at or diagnosis["health"] != "DEAD" or diagnosis["run_id"] != victim.run_id:
        raise RuntimeError(f"bench_polling_health did not see the killed run DEAD: {diagnosis}")
    first = job.wait_first_commit(run_id=recovered["run_id"])
    return diagnosis["diagnosed_at"] - killed_at[0], first - killed_at[0], recovered.get("backoff_s") or 0.0


def mttr_provider(stack: Stack, repeats: int, total: Audit) -> tuple[list[float], list[float]]:
    """A fresh job per run: the recover operator backs off on consecutive restarts of one job (crash-loop
    protection, 5 s doubling) and stops at its budget; a kill of a healthy job meets neither."""
    detect, mttr = [], []
    for attempt in range(repeats):
        job = stack.new_job("mttr")
        producer = stack.producer(job)
        producer.send(1000)
        stack.trigger_ok("stream_deploy")
        with Trickle(producer, chunk=30, pause_s=0.3):
            seen, recovered, _ = kill_and_recover(stack, job)
        detect.append(seen)
        mttr.append(recovered)
        say(f"  provider kill -9 {attempt + 1}/{repeats}: DEAD after {seen:.2f}s, processing again after "
            f"{recovered:.1f}s")
        job.wait_caught_up(producer.produced)
        _finish(stack, job, producer, total)
    return detect, mttr


# -- kill -9 with the baseline -----------------------------------------------------------------------
def mttr_baseline(stack: Stack, repeats: int, total: Audit) -> list[float]:
    """The job attached under SparkSubmitOperator with retries (retry_delay 5 s); the same kills."""
    from airflow_stream_provider.spec import StreamJobSpec

    job = stack.new_job("baseline")
    spec = StreamJobSpec.from_dict({**job.spec, "database_url": job.database_url,
                                    "kafka": {**job.spec["kafka"], "bootstrap_servers": stack.broker.bootstrap}})
    producer = stack.producer(job)
    producer.send(1000)
    seconds: list[float] = []
    failure: list[BaseException] = []
    trickle = Trickle(producer, chunk=30, pause_s=0.3)

    def kill_repeatedly():
        try:
            for attempt in range(repeats):
                victim = _processing(job)
                time.sleep(random.uniform(0, POLL_INTERVAL_S))
                killed_at = time.time()
                kill_driver_tree(victim.pid)
                seconds.append(job.wait_first_commit(after=killed_at + 0.001) - killed_at)
                say(f"  baseline kill -9 {attempt + 1}/{repeats}: processing again after {seconds[-1]:.1f}s")
            trickle.__exit__(None, None, None)
            job.wait_caught_up(producer.produced)
        except BaseException as err:  # reported by the main thread
            failure.append(err)
        finally:  # end the attached run cleanly so the DAG run finishes
            run = job.latest_run()
            if run and run.status in ("STARTING", "RUNNING"):
                job.store.request_stop(run.run_id)

    killer = threading.Thread(target=kill_repeatedly, daemon=True)
    trickle.__enter__()
    killer.start()
    try:
        stack.trigger_ok("bench_baseline", application=EVENTS_JOB, spec=spec.to_json(), conf=stack.spark_conf,
                         env_vars={k: stack.spark_env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON",
                                                                   "SPARK_LOCAL_IP")})
    finally:
        killer.join(60)
        trickle.background.done.set()
    if failure:
        raise failure[0]
    if killer.is_alive():  # the DAG run ended with kills still due: nothing below would mean anything
        raise RuntimeError(f"bench_baseline ended after {len(seconds)} of {repeats} kills: its spark-submit task "
                           f"succeeded instead of failing and being retried")
    producer.close()
    _audit(job, producer, total)
    return seconds


# -- an upgrade the checkpoint cannot take -------------------------------------------------------------
def upgrade_incompatible(stack: Stack, repeats: int, total: Audit) -> tuple[list[float], str]:
    """``stream_upgrade`` to a version with a new stateful operator -> its first committed batch."""
    seconds, error_class = [], ""
    for attempt in range(repeats):
        job, producer = _deployed(stack, "upgrade")
        with Trickle(producer, chunk=30, pause_s=0.3):
            started = time.time()
            upgraded, first, downtime = _upgrade(stack, job, EVENTS_JOB_V2, "2.0")
            seconds.append(first - started)
        error_class = upgraded["preflight"]["error_class"]
        say(f"  incompatible upgrade {attempt + 1}/{repeats}: {upgraded['action']} after preflight "
            f"{upgraded['preflight']['verdict']} ({error_class}, {upgraded['preflight']['seconds']}s); "
            f"v2 processing after {seconds[-1]:.1f}s, {downtime:.1f}s after v1's last batch")
        job.wait_caught_up(producer.produced)
        _finish(stack, job, producer, total)
        from airflow.models.variable import Variable

        Variable.set("stream_job_application", EVENTS_JOB)  # the next repetition starts from version 1
    baseline = (f"no automatic recovery: every retry starts the new version on the old checkpoint and fails "
                f"again ({error_class}); a person must move the checkpoint aside and pass startingOffsets")
    return seconds, baseline


def _deployed(stack: Stack, name: str) -> tuple[Job, object]:
    """A new job deployed with ``stream_deploy`` and caught up with its first 2,000 records."""
    job = stack.new_job(name)
    producer = stack.producer(job)
    producer.send(2000)
    stack.trigger_ok("stream_deploy")
    job.wait_caught_up(producer.produced)
    return job, producer


def _upgrade(stack: Stack, job: Job, application: str, version: str, **params) -> tuple[dict, float, float]:
    """``stream_upgrade`` to ``application``: its result, when the new run first committed, and the
    downtime it caused (the old run's last committed batch -> the new run's first)."""
    old = job.latest_run()
    upgraded = stack.trigger_ok("stream_upgrade", application=application, version=version, **params)["upgrade"]
    first = job.wait_first_commit(run_id=upgraded["run_id"])
    return upgraded, first, first - job.store.get_run(old.run_id).last_batch_at


def upgrade_prewarmed(stack: Stack, repeats: int, total: Audit) -> dict[str, list[float]]:
    """``stream_upgrade`` with ``prewarm``: the new version warms up beside the old one and starts once
    the old run stopped.  Per repetition a compatible upgrade (same code, new label; same generation) and
    an incompatible one (a new stateful operator; generation 2 from the stored offsets), each timed from
    the old run's last committed batch to the new run's first, the incompatible one also from the trigger."""
    from airflow.models.variable import Variable

    found = {"upgrade_downtime_s/compatible": [], "upgrade_downtime_s/incompatible": [],
             "upgrade_incompatible_prewarmed_s": []}
    for attempt in range(repeats):
        job, producer = _deployed(stack, "upgrade-prewarmed")
        with Trickle(producer, chunk=30, pause_s=0.3):
            for kind, application, version in (("compatible", EVENTS_JOB, "1.1"),
                                               ("incompatible", EVENTS_JOB_V2, "2.0")):
                started = time.time()
                upgraded, first, downtime = _upgrade(stack, job, application, version, prewarm=True)
                if not upgraded.get("prewarmed"):
                    raise RuntimeError(f"the {kind} upgrade did not start its successor: {upgraded}")
                found[f"upgrade_downtime_s/{kind}"].append(downtime)
                if kind == "incompatible":
                    found["upgrade_incompatible_prewarmed_s"].append(first - started)
                say(f"  prewarmed {kind} upgrade {attempt + 1}/{repeats}: {upgraded['action']}, "
                    f"{downtime:.2f}s without a committed batch")
        job.wait_caught_up(producer.produced)
        _finish(stack, job, producer, total)
        Variable.set("stream_job_application", EVENTS_JOB)  # the next repetition starts from version 1
    return found


# -- scaling -------------------------------------------------------------------------------------------
def _reset(stack: Stack, job: Job) -> float:
    """``bench_reset`` on a healthy, busy job -> the new generation's first committed batch."""
    started = time.time()
    reset = stack.trigger_ok("bench_reset")["reset"]
    return job.wait_first_commit(generation=reset["generation"], after=started) - started


def _committed_batches(job: Job, generation: int) -> int:
    from sqlalchemy import func, select

    from airflow_stream_provider.state import schema

    ledger = schema.batches
    with job.store.engine.connect() as conn:
        return conn.execute(select(func.count(func.distinct(ledger.c.batch_id))).where(
            ledger.c.job_id == job.job_id, ledger.c.generation == generation)).scalar() or 0


def by_history(stack: Stack, levels: list[int], total: Audit) -> dict[str, list]:
    """Recovery with 10 / 100 / 1000 committed batches in one generation's checkpoint: tiny batches (three
    records) build the history of one job, killed at each level; then a reset at the last.  The topic
    has one partition, which makes a tiny batch cheapest (one Spark task per stage): the series is about
    the history, the partitions series about partitions.

    The recover operator backs off on consecutive restarts of a job (5 s, then 10 s): that deliberate
    wait is subtracted, and reported, so the series shows what the history costs.
    """
    series: dict[str, list] = {"batches": [], "recovery_s": [], "backoff_s": [], "reset_s": []}
    job = stack.new_job("history", partitions=1, max_offsets=3, trigger_interval="100 milliseconds")
    producer = stack.producer(job)
    producer.send(3 * max(levels) + 30)
    started = time.monotonic()
    stack.trigger_ok("stream_deploy")
    with Trickle(producer, chunk=3, pause_s=0.5):
        for level in levels:
            _wait(lambda n=level: _committed_batches(job, 1) >= n, 120 + level * 3, f"{level} committed batches")
            say(f"  {level} committed batches after {time.monotonic() - started:.0f}s")
            _, recovered, backoff = kill_and_recover(stack, job)
            series["batches"].append(level)
            series["recovery_s"].append(recovered - backoff)
            series["backoff_s"].append(backoff)
            say(f"  {level} batches: recovery {recovered - backoff:.1f}s (+ {backoff:.0f}s crash-loop backoff)")
        # The next generation may take normal batches: what is timed is the reset, not the drain.
        stack.set_spec(job, kafka={**job.spec["kafka"], "max_offsets_per_trigger": 2000})
        series["reset_s"].append(_reset(stack, job))
        say(f"  reset with {max(levels)} batches in the checkpoint: {series['reset_s'][-1]:.1f}s")
    job.wait_caught_up(producer.produced)
    _finish(stack, job, producer, total)
    return series


def _recover_then_reset(stack: Stack, job: Job) -> tuple[float, float]:
    _, recovered, _ = kill_and_recover(stack, job)
    return recovered, _reset(stack, job)


def _record_point(stack: Stack, job: Job, producer, total: Audit, series: dict, point: tuple[str, int],
                  timed: tuple[float, float]) -> None:
    """Drain, stop and audit the job; add its (recovery, reset) seconds to the series at ``point``."""
    job.wait_caught_up(producer.produced)
    _finish(stack, job, producer, total)
    (axis, x), (recovered, reset) = point, timed
    series[axis].append(x)
    series["recovery_s"].append(recovered)
    series["reset_s"].append(reset)
    say(f"  {x} {axis}: recovery {recovered:.1f}s, reset {reset:.1f}s")


def by_partitions(stack: Stack, levels: list[int], total: Audit) -> dict[str, list]:
    series = {"partitions": [], "recovery_s": [], "reset_s": []}
    for partitions in levels:
        job = stack.new_job(f"partitions-{partitions}", partitions=partitions, max_offsets=2000)
        producer = stack.producer(job)
        producer.send(max(1000, 30 * partitions))
        stack.trigger_ok("stream_deploy")
        with Trickle(producer, chunk=max(30, partitions), pause_s=0.3):
            timed = _recover_then_reset(stack, job)
        _record_point(stack, job, producer, total, series, ("partitions", partitions), timed)
    return series


# -- the warm standby -----------------------------------------------------------------------------------
#: How long a warm standby waits before its kill, at most (uniformly drawn).
STANDBY_WAIT_S = 90.0


def _warm(job: Job, driver, timeout: float = 300) -> None:
    log = StandbyLog(job.store)

    def waiting():
        if not driver.alive():
            raise RuntimeError(f"standby {driver.run_id} exited while warming up (log: {driver.log_path})")
        record = log.get(driver.run_id)
        return record is not None and record.status == StandbyStatus.WAITING

    _wait(waiting, timeout, f"standby {driver.run_id} to be warm")


def _memory_mb(pid: int, samples: int = 5) -> dict[str, float]:
    """The median of a few looks at a driver tree's RSS and PSS, in MB (a worker may come and go)."""
    looks = []
    for _ in range(samples):
        parts = tree_rss(driver_processes(pid))
        looks.append({"rss": (parts["jvm"] + parts["python"]) / 2**20, "pss": parts["pss"] / 2**20})
        time.sleep(0.5)
    return {key: round(statistics.median(look[key] for look in looks), 1) for key in ("rss", "pss")}


def standby_takeover(stack: Stack, kills: int, total: Audit) -> dict[str, list[float]]:
    """SIGKILL of the active driver's whole tree, with a warm standby waiting -> the first batch the
    standby's run committed; a new standby is started after each takeover, as the health DAG does.

    Also the resident memory of a standby that waits, against the active driver of the same job idle
    (caught up, nothing arriving), both measured at the same moment before the kills."""
    from stack.jobs import JobRunner, make_spec

    job = stack.new_job("standby", database="postgresql")
    spec = make_spec(job.job_id, stack.broker.bootstrap, job.topic, job.database_url,
                     stack.workdir / "checkpoints", trigger_interval="1 second", max_offsets_per_trigger=2000,
                     standby=True)
    runner = JobRunner(spec, stack.workdir / "driver-logs" / job.job_id, conf=stack.spark_conf)
    producer = stack.producer(job)
    producer.send(1000)
    active = runner.start()
    standby = runner.start(standby=True)
    job.wait_caught_up(producer.produced, alive_pid=active.pid)
    _warm(job, standby)
    time.sleep(3)  # both settled: the active run between batches, the standby polling
    idle, waiting = _memory_mb(active.pid), _memory_mb(standby.pid)
    say(f"  memory: idle active driver RSS {idle['rss']:.0f} MB (PSS {idle['pss']:.0f}), waiting standby "
        f"RSS {waiting['rss']:.0f} MB (PSS {waiting['pss']:.0f})")
    found = {"mttr_standby_kill9_s": [], "idle_driver_rss_mb": [idle["rss"]], "idle_driver_pss_mb": [idle["pss"]],
             "standby_rss_mb": [waiting["rss"]], "standby_pss_mb": [waiting["pss"]]}
    found["standby_waited_s"] = []
    with Trickle(producer, chunk=30, pause_s=0.3):
        for kill in range(kills):
            if kill:  # the one started above is warm already
                standby = runner.start(standby=True)
                _warm(job, standby)
                # A standby waits for hours in production: Spark retires Python workers idle for a minute,
                # so some kills come after longer than that.
                time.sleep(random.uniform(0, STANDBY_WAIT_S))
            waited = time.time() - StandbyLog(job.store).get(standby.run_id).ready_at
            job.wait_first_commit(run_id=active.run_id, after=time.time())  # busy: a batch just committed
            time.sleep(random.uniform(0, 1.0))  # anywhere in the next trigger interval
            killed_at = time.time()
            active.kill()  # SIGKILL of its process group: the JVM, the Python driver, every worker
            found["mttr_standby_kill9_s"].append(
                job.wait_first_commit(run_id=standby.run_id, after=killed_at) - killed_at)
            found["standby_waited_s"].append(round(waited, 1))
            say(f"  standby kill -9 {kill + 1}/{kills} (standby warm for {waited:.0f}s): processing again after "
                f"{found['mttr_standby_kill9_s'][-1]:.2f}s")
            active = standby
    job.wait_caught_up(producer.produced, alive_pid=active.pid)
    runner.stop(active)
    runner.store.dispose()
    producer.close()
    _audit(job, producer, total)
    return found
