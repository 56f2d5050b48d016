"""What exactly-once costs: the example job draining a backlog through the transactional sink, the same
pipeline through a plain append sink (at-least-once), and kafka-python reading the same backlog with no
Spark at all; plus the driver's peak memory as the backlog grows (batches are bounded, so it must not).

Rates are steady-state: records of every batch after the first, over the time from the first batch's
commit to the last one's.  The first batch also pays for starting Python workers; that cost is the cold
start, measured on its own.  A new driver's JVM is still compiling the per-record code in its next two
large batches, so a 300,000-event drain is mostly that; the warm rate, over the batches after
``WARM_UP_BATCHES`` of a longer drain, is what a running job sustains.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path

import psutil
from sqlalchemy import func, inspect, select, text

from benchmarks.audit import Audit, audit
from benchmarks.stack import (
    AT_LEAST_ONCE_JOB,
    EVENTS_JOB,
    Job,
    Stack,
    cpu_seconds,
    driver_processes,
    jvm_thread_cpu,
    say,
    signal_driver_tree,
    tree_cpu,
    tree_rss,
)
from stack.jobs import JobRunner, make_spec


class PeakRss(threading.Thread):
    """Samples the driver's process tree every 0.25 s; with ``broker_pid``, also the CPU time spent by it,
    the PostgreSQL server and the broker (``cpu``: epoch time and cumulative seconds by kind), and every
    second its JVM's by kind of thread (``jvm_threads``, the same form: reading ~300 threads' ``/proc``
    entries costs more than a process's)."""

    def __init__(self, pid: int, broker_pid: int | None = None):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.peak_parts = {"jvm": 0, "python": 0}  # at the peak of the total
        self.peak_pss = 0
        self.broker_pid = broker_pid
        self.cpu: list[tuple[float, dict[str, float]]] = []
        self.jvm_threads: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        rounds = 0
        while not self.done.is_set():
            processes = driver_processes(self.pid)  # listed once a round, for each of the readings below
            parts = tree_rss(processes)
            self.peak_pss = max(self.peak_pss, parts.pop("pss"))
            if sum(parts.values()) > self.peak:
                self.peak, self.peak_parts = sum(parts.values()), parts
            if self.broker_pid is not None:
                self.cpu.append((time.time(), tree_cpu(processes, self.broker_pid)))
                if rounds % 4 == 0:
                    self.jvm_threads.append((time.time(), jvm_thread_cpu(processes)))
            rounds += 1
            self.done.wait(0.25)

    def __enter__(self) -> PeakRss:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join(5)


def cpu_per_records(samples: list[tuple[float, dict[str, float]]], batches: list[tuple[int, float]],
                    per: int = 100_000, skip: int | None = None) -> dict[str, float] | None:
    """CPU seconds by kind per ``per`` records over the warm batches (the window ``warm_rate`` times; with
    ``skip=0``, the one ``steady_rate`` times), from the samples nearest its ends; ``wall`` is the
    window's length per ``per`` records."""
    window = batches[WARM_UP_BATCHES - 1 if skip is None else skip:]
    if len(window) < 2 or len(samples) < 2:
        return None
    start, end = window[0][1], window[-1][1]
    first = min(samples, key=lambda sample: abs(sample[0] - start))
    last = min(samples, key=lambda sample: abs(sample[0] - end))
    records = sum(n for n, _ in window[1:])
    if last[0] <= first[0] or not records:
        return None
    scale = per / records
    found = {kind: max(0.0, last[1][kind] - first[1][kind]) * scale for kind in last[1]}
    found["wall"] = (last[0] - first[0]) * scale
    return found


def _batches(job: Job, exactly_once: bool) -> list[tuple[int, float]]:
    """(records, commit time) per batch, in batch order, from the ledger or the append sink's log."""
    from airflow_stream_provider.state import schema

    with job.store.engine.connect() as conn:
        if exactly_once:
            ledger = schema.batches
            rows = conn.execute(
                select(func.sum(ledger.c.rows_read), func.max(ledger.c.committed_at))
                .where(ledger.c.job_id == job.job_id).group_by(ledger.c.batch_id).order_by(ledger.c.batch_id)).all()
        elif inspect(conn).has_table("alo_batches"):  # created by the driver with its first batch
            rows = conn.execute(text("SELECT rows_read, written_at FROM alo_batches ORDER BY batch_id")).all()
        else:
            rows = []
    return [(int(n), float(at)) for n, at in rows if n]


#: Spark's phases outside the sink (StreamingQueryProgress.durationMs), as the breakdown names them.
SPARK_PHASES = {"latestOffset": "spark_latest_offset", "queryPlanning": "spark_plan", "getBatch": "spark_get_batch",
                "walCommit": "spark_wal_commit", "commitOffsets": "spark_commit_offsets"}


#: Batches a new driver runs before its rate is a running job's: the first, small one, and two in which the
#: JVM compiles the per-record code (measured on 2 cores, 100,000-record batches: read_parse 5.0 and 2.9 s,
#: then 1.5-1.9 s a batch for the rest of a 1,500,000-event drain).
WARM_UP_BATCHES = 3


def breakdown(log_path: str, skip: int = 1) -> dict[str, float]:
    """Seconds per phase over the steady batches (every batch with records after the first ``skip``), from
    the driver's progress lines: Spark's own phases plus the sink's (``BatchClock``); ``other`` is what the
    trigger took beyond them."""
    totals: dict[str, float] = {}
    progress = [json.loads(line.split(" progress ", 1)[1]) for line in Path(log_path).read_text().splitlines()
                if " progress {" in line]
    steady = [p for p in progress if p["input_rows"]][skip:]
    for p in steady:
        spark = p["duration_ms"]
        phases = {name: spark.get(key, 0) / 1000 for key, name in SPARK_PHASES.items()}
        phases.update({f"sink_{k}": v for k, v in (p.get("sink_s") or {}).items()})
        phases["other"] = max(0.0, spark.get("triggerExecution", 0) / 1000 - sum(phases.values()))
        for name, seconds in phases.items():
            totals[name] = totals.get(name, 0.0) + seconds
    totals["batches"] = len(steady)
    return totals


def say_breakdown(kind: str, found: dict[str, float]) -> None:
    if not found["batches"]:  # a driver without the harness's progress lines (the append sink)
        return
    total = sum(v for k, v in found.items() if k != "batches") or 1e-9
    parts = ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in sorted(found.items(), key=lambda kv: -kv[1])
                      if k != "batches" and v >= 0.005)
    say(f"  {kind} where the time goes over {found['batches']:.0f} steady batches ({total:.1f} s): {parts}")


def steady_rate(batches: list[tuple[int, float]]) -> float | None:
    if len(batches) < 2:
        return None
    records = sum(n for n, _ in batches[1:])
    return records / max(batches[-1][1] - batches[0][1], 1e-6)


def warm_rate(batches: list[tuple[int, float]]) -> float | None:
    """The steady rate over the batches after ``WARM_UP_BATCHES``: timed from the last warm-up batch's commit."""
    return steady_rate(batches[WARM_UP_BATCHES - 1:])


#: How long after its start a running job receives the burst: past the minute after which Spark reaps a Python
#: worker kind's idle workers, so the row is a running job's whatever the harness let go of itself.
START_WORKERS_REAPED_S = 75


def drain(stack: Stack, *, exactly_once: bool, database: str, backlog: int, max_offsets: int,
          total: Audit, reader: str = "kafka-python", burst_after: float | None = None,
          application: str | None = None, java_options: str = "", warm: bool = False) -> dict:
    """One driver drains a backlog of ``backlog`` events (the run's shared one of that size, ``Stack.backlog``);
    returns its rate and peak memory.  ``reader``:
    the Python source's read-task client (``kafka.reader``); ``application``: an exactly-once job other
    than the example job; ``java_options``: added to the driver's; ``warm``: also the rate and breakdown
    over the batches after ``WARM_UP_BATCHES`` (a drain long enough to leave several).

    With ``burst_after``, the backlog is a burst that a running job receives: the driver starts on an empty
    topic, runs that long, and is paused (SIGSTOP to its whole tree) while the burst is produced, so it
    finds all of it at once and reads it in the same batches as a driver started on it; memory is sampled
    from the burst on."""
    sink = "eos" if exactly_once else "alo"
    kind = sink if reader == "kafka-python" else f"{sink} ({reader} reader)"
    kind += "" if application is None else f" ({Path(application).stem})"
    kind += "" if burst_after is None else f" (a burst {burst_after:.0f} s into a run)"
    if burst_after is None:  # a backlog waiting before the driver starts: the run's shared one of that size
        produced, producer = stack.backlog(backlog), None
        job = stack.new_job(f"{sink}-{database}", database=database, max_offsets=max_offsets, topic=produced.topic)
    else:  # a burst into this job's own topic while it runs
        job = stack.new_job(f"{sink}-{database}", database=database, max_offsets=max_offsets)
        producer = stack.producer(job)
        produced = producer.produced
    runner, driver = start_driver(stack, job, max_offsets,
                            (application or EVENTS_JOB) if exactly_once else AT_LEAST_ONCE_JOB, reader, java_options)
    if burst_after is not None:
        spawned = time.monotonic()
        runner.wait_running(driver)
        time.sleep(max(0.0, spawned + burst_after - time.monotonic()))
        _send_paused(driver, producer, backlog)
    # the CPU by process and JVM thread: for the warm window, and over the window a new driver's exactly-once
    # rate on PostgreSQL is timed in (what `eos_vs_raw` is judged on); a sample a second of ~300 threads' /proc
    sample_cpu = warm or (exactly_once and database == "postgresql" and burst_after is None
                          and reader == "kafka-python" and application is None)
    with PeakRss(driver.pid, stack.broker.process.pid if sample_cpu else None) as memory:
        _wait_applied(job, driver, runner, produced.total, f"{kind}/{database}", exactly_once)
    jvm_cpu = jvm_thread_cpu(driver_processes(driver.pid))  # over the driver's life: its start, then the drain
    stop_driver(runner, driver, f"{kind}/{database}")
    batches = _batches(job, exactly_once)
    if exactly_once:
        found = audit(job.store, job.job_id, produced)
        say(f"  audit: {found}")
        total += found
    if producer is not None:
        producer.close()
    runner.store.dispose()
    phases = breakdown(driver.log_path)
    say_breakdown(f"{kind} on {database}", phases)
    warm_msgs_s = warm_rate(batches) if warm else None
    result = {"msgs_s": steady_rate(batches), "batches": len(batches), "peak_rss_mb": memory.peak / 2**20,
              "breakdown_s": phases, "warm_msgs_s": warm_msgs_s,
              "warm_breakdown_s": breakdown(driver.log_path, skip=WARM_UP_BATCHES) if warm_msgs_s else None,
              "warm_cpu_s": cpu_per_records(memory.cpu, batches) if warm_msgs_s else None,
              "warm_jvm_thread_cpu_s": cpu_per_records(memory.jvm_threads, batches) if warm_msgs_s else None,
              "peak_rss_jvm_mb": memory.peak_parts["jvm"] / 2**20,
              "peak_rss_python_mb": memory.peak_parts["python"] / 2**20, "peak_pss_mb": memory.peak_pss / 2**20,
              "jvm_thread_cpu_s": jvm_cpu, "topic": job.topic,
              "steady_cpu_s": cpu_per_records(memory.cpu, batches, skip=0) if sample_cpu else None,
              "steady_jvm_thread_cpu_s": cpu_per_records(memory.jvm_threads, batches, skip=0) if sample_cpu else None}
    if warm_msgs_s:
        say(f"  {kind} on {database}: {warm_msgs_s:.0f} msgs/s over the batches after the first {WARM_UP_BATCHES}")
    if result["warm_cpu_s"]:
        say_cpu(f"{kind} on {database}, warm", result["warm_cpu_s"])
    elif result["steady_cpu_s"]:
        say_cpu(f"{kind} on {database}, over the rate's window", result["steady_cpu_s"])
    say(f"  {kind} on {database}: the JVM's CPU seconds over the driver's life by thread, "
        + ", ".join(f"{k} {v:.1f}" for k, v in jvm_cpu.items()))
    say(f"  {kind} on {database}: {backlog} events in {len(batches)} batches, {result['msgs_s']:.0f} msgs/s, "
        f"peak driver RSS {result['peak_rss_mb']:.0f} MB (JVM {result['peak_rss_jvm_mb']:.0f}, Python "
        f"{result['peak_rss_python_mb']:.0f}); peak PSS {result['peak_pss_mb']:.0f} MB")
    return result


def say_cpu(kind: str, found: dict[str, float]) -> None:
    spent = sum(v for k, v in found.items() if k != "wall")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in found.items() if k != "wall")
    say(f"  {kind}: CPU s per 100,000 records {spent:.2f} ({parts}) in {found['wall']:.2f} s: "
        f"{spent / found['wall']:.2f} cores busy")


def running_bursts(stack: Stack, *, warm_up: int, burst: int, bursts: int, max_offsets: int, total: Audit) -> dict:
    """What a job that has run for a while sustains: one driver on a topic of its own drains ``warm_up``
    events (its JVM compiles what the per-record and per-batch code needs, which the warm batches of a
    single drain are still doing), then receives ``bursts`` bursts of ``burst`` events, each produced
    while its process tree is paused so that it reads the burst in full batches.  Returns each burst's rate
    (``steady_rate``), CPU per 100,000 records and peak RSS, and raw kafka-python reading the same topic."""
    job = stack.new_job("running-postgresql", database="postgresql", max_offsets=max_offsets)
    producer = stack.producer(job)
    say(f"  producing the {warm_up:,}-event warm-up")
    producer.send(warm_up)
    runner, driver = start_driver(stack, job, max_offsets, EVENTS_JOB)
    found: dict = {"warm_up": warm_up, "burst": burst, "msgs_s": [], "cpu_per_100k": [], "peak_rss_mb": []}
    try:
        _wait_applied(job, driver, runner, producer.produced.total)
        say(f"  warm-up drained: {len(_batches(job, True))} batches")
        for n in range(bursts):
            before = len(_batches(job, True))
            _send_paused(driver, producer, burst)
            with PeakRss(driver.pid, stack.broker.process.pid) as memory:
                _wait_applied(job, driver, runner, producer.produced.total)
            batches = _batches(job, True)[before:]
            found["msgs_s"].append(steady_rate(batches))
            found["cpu_per_100k"].append(cpu_per_records(memory.cpu, batches, skip=0))
            found["peak_rss_mb"].append(round(memory.peak / 2**20, 1))
            say(f"  burst {n + 1}/{bursts}: {burst:,} events in {len(batches)} batches, {found['msgs_s'][-1]:.0f} "
                f"msgs/s, peak driver RSS {found['peak_rss_mb'][-1]:.0f} MB")
    finally:
        stop_driver(runner, driver, "running job")
    checked = audit(job.store, job.job_id, producer.produced)
    say(f"  audit: {checked}")
    total += checked
    found["raw_consume_msgs_s"] = [raw_consume(stack, job.topic, producer.produced.total)]
    say(f"  raw kafka-python, the same topic: {found['raw_consume_msgs_s'][-1]:.0f} msgs/s")
    producer.close()
    runner.store.dispose()
    return found


def start_driver(stack: Stack, job: Job, max_offsets: int, application: str, reader: str = "kafka-python",
           java_options: str = "") -> tuple[JobRunner, object]:
    """A driver of ``application`` for ``job``, polling every 100 ms for at most ``max_offsets`` a batch;
    ``java_options`` are added to the stack's."""
    spec = make_spec(job.job_id, stack.broker.bootstrap, job.topic, job.database_url, stack.workdir / "checkpoints",
                     trigger_interval="100 milliseconds", max_offsets_per_trigger=max_offsets)
    spec = dataclasses.replace(spec, kafka=dataclasses.replace(spec.kafka, reader=reader))
    conf = dict(stack.spark_conf)
    if java_options:
        key = "spark.driver.extraJavaOptions"
        conf[key] = f"{conf.get(key, '')} {java_options}".strip()
    runner = JobRunner(spec, stack.workdir / "driver-logs" / job.job_id, application=application, conf=conf)
    return runner, runner.start()


def stop_driver(runner: JobRunner, driver, what: str) -> None:
    """Stop gracefully; a driver that does not end cleanly fails the section with its log's tail."""
    code = runner.stop(driver)
    if code != 0:
        raise RuntimeError(f"{what}: graceful stop ended with {code}\n{runner.log_tail(driver)}")


def _send_paused(driver, producer, events: int) -> None:
    """Produce ``events`` while the driver's whole tree is stopped, so that it finds all of them at once and
    reads them in full batches, as a driver started on them would."""
    signal_driver_tree(driver.pid, signal.SIGSTOP)
    try:
        producer.send(events)
    finally:
        signal_driver_tree(driver.pid, signal.SIGCONT)


def _wait_applied(job: Job, driver, runner: JobRunner, records: int, what: str = "the running job",
                  exactly_once: bool = True) -> None:
    """Until the job's batches hold ``records`` records; a driver that ended or ten minutes fail it."""
    deadline = time.monotonic() + 600
    while sum(n for n, _ in _batches(job, exactly_once)) < records:
        if time.monotonic() > deadline or not driver.alive():
            raise RuntimeError(f"{what} did not apply {records} records\n{runner.log_tail(driver)}")
        time.sleep(0.25)


def raw_consume(stack: Stack, topic: str, expected: int, cpu: dict[str, float] | None = None) -> float:
    """kafka-python alone reading the whole topic: the ceiling for a Python source.  With ``cpu``, fills it
    with the CPU seconds per 100,000 records of the consumer (this process: nothing else runs in it
    meanwhile) and of the broker, and the wall seconds."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=stack.broker.bootstrap, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        end = consumer.end_offsets(partitions)
        position = {tp: 0 for tp in partitions}
        read = 0
        broker = psutil.Process(stack.broker.process.pid)
        started, cpu_started, broker_started = time.monotonic(), time.process_time(), cpu_seconds(broker)
        while any(position[tp] < end[tp] for tp in partitions):
            for tp, records in consumer.poll(timeout_ms=500, max_records=10_000).items():
                read += len(records)
                position[tp] = records[-1].offset + 1
        seconds = time.monotonic() - started
        if cpu is not None and read:
            scale = 100_000 / read
            cpu.update(consumer=(time.process_time() - cpu_started) * scale,
                       broker=(cpu_seconds(broker) - broker_started) * scale, wall=seconds * scale)
    finally:
        consumer.close()
    if read < expected:
        raise RuntimeError(f"raw consumer read {read} of {expected} records of {topic}")
    return read / seconds
