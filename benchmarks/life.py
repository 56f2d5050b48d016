"""A running job's memory over its life: events arriving steadily, so the driver runs many small batches.

A drain is a few large batches; a stream job's days are thousands of small ones.  What a driver keeps
per batch rather than per record (Spark's records of its jobs, stages and SQL executions, the threads of
its query pools, compiled code) only shows over many batches, so this measures the driver's RSS minute by
minute while a producer keeps sending, and the JVM's thread count with it.  The job then catches up and
stops gracefully, and its results are audited like every other run's.
"""

from __future__ import annotations

import time

import psutil

from benchmarks.audit import Audit, audit
from benchmarks.stack import EVENTS_JOB, Stack, driver_processes, say
from benchmarks.throughput import PeakRss, _batches, start_driver, stop_driver
from stack.events import BackgroundProducer

#: The steady feed: 300 events every 0.1 s at most (the producer's own time comes on top), so the job runs
#: a batch or more a second, each of a few hundred to a few thousand records.
FEED_CHUNK, FEED_PAUSE_S = 300, 0.1


def _jvm_threads(pid: int) -> int:
    for process, java in driver_processes(pid):
        try:
            if java:
                return process.num_threads()
        except psutil.NoSuchProcess:
            pass
    return 0


def running_life(stack: Stack, *, minutes: int, total: Audit) -> dict:
    """One exactly-once job on PostgreSQL fed for ``minutes``: per minute, the driver's peak RSS (JVM,
    Python), the JVM's threads at the minute's end and the batches committed by then."""
    job = stack.new_job("life-postgresql", database="postgresql", max_offsets=100_000)
    producer = stack.producer(job)
    runner, driver = start_driver(stack, job, 100_000, EVENTS_JOB)
    runner.wait_running(driver)
    feed = BackgroundProducer(producer, total=10**9, chunk=FEED_CHUNK, pause_s=FEED_PAUSE_S)
    feed.start()
    found = {"minutes": [], "peak_rss_mb": [], "jvm_mb": [], "python_mb": [], "jvm_threads": [], "batches": []}
    try:
        for minute in range(1, minutes + 1):
            ends = time.monotonic() + 60
            with PeakRss(driver.pid) as memory:
                while time.monotonic() < ends:
                    if not driver.alive() or feed.done.is_set():
                        raise RuntimeError(f"the running job or its feed ended in minute {minute} "
                                           f"({feed.error!r})\n{runner.log_tail(driver)}")
                    time.sleep(0.25)
            peak, parts = memory.peak, memory.peak_parts
            found["minutes"].append(minute)
            found["peak_rss_mb"].append(round(peak / 2**20, 1))
            found["jvm_mb"].append(round(parts["jvm"] / 2**20, 1))
            found["python_mb"].append(round(parts["python"] / 2**20, 1))
            found["jvm_threads"].append(_jvm_threads(driver.pid))
            found["batches"].append(len(_batches(job, True)))
            say(f"  minute {minute}: peak RSS {peak / 2**20:.0f} MB (JVM {parts['jvm'] / 2**20:.0f}, Python "
                f"{parts['python'] / 2**20:.0f}), {found['jvm_threads'][-1]} JVM threads, "
                f"{found['batches'][-1]} batches committed")
    finally:
        feed.done.set()
        feed.join(30)
    job.wait_caught_up(producer.produced, alive_pid=driver.pid)
    stop_driver(runner, driver, "running job")
    found["events"] = producer.produced.total
    checked = audit(job.store, job.job_id, producer.produced)
    say(f"  audit: {checked}")
    total += checked
    producer.close()
    runner.store.dispose()
    return found
