"""The runtime end to end: real drivers in their own processes, a real broker, real databases.

Every test ends with exact counts: each valid event applied once, each malformed record dead-lettered
once, KPIs equal to a recomputation, stored offsets equal to Kafka's end offsets, a contiguous ledger.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from airflow_stream_provider import failures, kafka_offsets
from airflow_stream_provider.runtime.harness import ARROW_POOL_ENV
from airflow_stream_provider.runtime.planner_workers import planner_kind
from stack.events import BackgroundProducer, EventProducer
from stack.jobs import check_exactly_once, wait_until
from tests.backends import POSTGRESQL_THEN_SQLITE_IN_SOAK

#: a job whose batch never ends: its ``results`` sleeps for an hour
STUCK_ON_BATCH = Path(__file__).resolve().parents[1] / "fixtures" / "jobs" / "stuck_on_batch.py"
#: a job whose start hangs once its run is registered
HANGS_ON_START = STUCK_ON_BATCH.with_name("hangs_on_start.py")


def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _worker_arrow_pools(pid: int) -> list[str | None]:
    """The Arrow allocator each of the driver's reading Python workers was started with."""
    pools = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            if "pyspark.worker" in " ".join(process.cmdline()):
                pools.append(process.environ().get(ARROW_POOL_ENV))
        except psutil.NoSuchProcess:  # a worker Spark let go between the listing and the look
            pass
    return pools


def _planner_processes(pid: int) -> list[str]:
    """The planner kind (data source lookup, creation, read planning) of each of the driver's Python
    processes that runs one: daemons and the workers they forked, which keep the daemon's command line."""
    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if kind := planner_kind(command):
            found.append(kind)
    return found


def _jvm_thread_names(pid: int) -> list[str]:
    """The native names of the driver JVM's threads (a Java thread's name, cut to 15 characters)."""
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        if "java" in process.name():
            names = []
            for task in process.threads():
                try:
                    with open(f"/proc/{process.pid}/task/{task.id}/comm") as comm:
                        names.append(comm.read().strip())
                except FileNotFoundError:  # a thread that ended between the listing and the look
                    pass
            return names
    raise AssertionError(f"no JVM in the driver's process tree {pid}")


@POSTGRESQL_THEN_SQLITE_IN_SOAK
def test_graceful_stop_and_restart(broker, topic, runner, figures):
    producer = EventProducer(broker, topic)
    producer.send(3000)
    driver = runner.start()
    runner.wait_running(driver)
    runner.wait_caught_up(_end(producer), driver)
    # Spark's Python workers (reading, planning) hand freed Arrow buffers back: the system allocator
    pools = _worker_arrow_pools(driver.pid)
    assert pools and set(pools) == {"system"}, pools
    # the query's start planned the source in Python; its planner daemons and their workers are gone once
    # it ran a batch, and the batches after it need none
    assert _planner_processes(driver.pid) == []
    producer.send(1000)
    runner.wait_caught_up(_end(producer), driver)
    assert _planner_processes(driver.pid) == []
    # no adaptive execution in the batches' queries (``LONG_RUNNING_DRIVER_CONF``): its stage pools would
    # hold a thread per query for an idle minute
    threads = _jvm_thread_names(driver.pid)
    assert not [n for n in threads if n.startswith(("shuffle-exchang", "ResultQueryStag"))], sorted(set(threads))
    asked = time.monotonic()
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED
    stop_s = time.monotonic() - asked
    row = runner.run_row(driver)
    assert (row.status, row.exit_code, row.failure_kind) == ("STOPPED", 0, None)
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)

    # records produced while stopped are picked up by the next run, nothing repeated; this time the
    # stop comes as SIGTERM to the Python driver, the stop operator's first escalation
    producer.send(700)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    os.kill(runner.run_row(driver).pid, signal.SIGTERM)
    assert driver.wait(60) == failures.EXIT_STOPPED, runner.log_tail(driver)
    assert runner.run_row(driver).status == "STOPPED"
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == 4700
    # progress is visible to standard Kafka lag tooling through the job's consumer group
    group = runner.spec.kafka.consumer_group(runner.spec.job_id)
    assert broker.group_offsets(group) == _end(producer)

    # a stop that comes while the driver starts (SIGTERM as soon as its run is registered) ends the start
    # cleanly; the process used to die of the signal, its run left STARTING until found DEAD
    driver = runner.start()
    registered = wait_until(lambda: runner.run_row(driver), 120, "the run to register",
                            on_timeout=lambda: runner.log_tail(driver))
    os.kill(registered.pid, signal.SIGTERM)
    assert driver.wait(120) == failures.EXIT_STOPPED, runner.log_tail(driver)
    assert runner.run_row(driver).status == "STOPPED"
    assert check_exactly_once(runner.store, runner.spec.job_id, producer.produced)["read"] == 4700
    figures.record(f"graceful stop [{runner.store.dialect}]", stop_seconds=round(stop_s, 1), **counts)


@POSTGRESQL_THEN_SQLITE_IN_SOAK
def test_kill9_exactly_once(broker, topic, runner, figures):
    """SIGKILL the whole driver (JVM + Python) at random moments while 20,000 events arrive."""
    rng = random.Random(20261122)
    producer = EventProducer(broker, topic, malformed_ratio=0.01)
    background = BackgroundProducer(producer, total=20_000, chunk=250, pause_s=0.5)
    background.start()
    kills, early_kills = 0, 0
    while kills < 5 or (not background.done.is_set() and kills < 12):
        driver = runner.start()
        if rng.random() < 0.25:  # during start-up or the first batch
            time.sleep(rng.uniform(2.0, 9.0))
            early_kills += 1
        else:  # after this run committed a batch: lands during a batch or between two
            runner.wait_running(driver)
            before = runner.committed_batches()
            wait_until(lambda d=driver, b=before: runner.committed_batches() > b or not d.alive(), 120,
                       "a batch committed by this run", on_timeout=lambda d=driver: runner.log_tail(d))
            assert driver.alive(), runner.log_tail(driver)
            time.sleep(rng.uniform(0.0, 2.0))
        driver.kill()
        kills += 1
        row = runner.run_row(driver)  # None when killed before it registered its run
        assert row is None or row.ended_at is None, "a killed driver cannot record its end"
    background.join(120)
    assert background.error is None, background.error
    assert producer.sent == 20_000
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver, timeout=400)
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == 20_000
    figures.record(f"kill -9 [{runner.store.dialect}]", kills=kills, kills_before_first_batch=early_kills,
                   produced=producer.sent, malformed=len(producer.produced.malformed), **counts)


# In ``make soak``: the optional reader is not the tested default path; what it reads is proven against
# kafka-python's reads by ``tests/integration/test_confluent_reader.py`` in the default run.
@pytest.mark.soak
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_confluent_reader_is_exactly_once_through_kill9(broker, topic, runner, figures):
    """The optional fast reader (kafka.reader: confluent-kafka) through a SIGKILL in a batch: the replayed
    batch reads the same records, counts exact.  SQLite only: the reader does not touch the database."""
    runner.spec = dataclasses.replace(runner.spec, kafka=dataclasses.replace(runner.spec.kafka,
                                                                             reader="confluent-kafka"))
    producer = EventProducer(broker, topic, malformed_ratio=0.01)
    producer.send(6000)
    driver = runner.start()
    runner.wait_running(driver)
    wait_until(lambda: runner.committed_batches() > 0 or not driver.alive(), 120, "a first committed batch",
               on_timeout=lambda: runner.log_tail(driver))
    assert driver.alive(), runner.log_tail(driver)
    assert "through the python Kafka source (confluent-kafka reader)" in runner.log_tail(driver, lines=400)
    driver.kill()
    producer.send(2000)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    assert runner.stop(driver, timeout=60) == failures.EXIT_STOPPED
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == 8000
    figures.record("confluent reader, kill -9 [sqlite]", **counts)


# The seam's database side (start offsets vs stored offsets, gap refusal) runs on both databases in
# test_transaction.py; kill -9 and graceful stop cover PostgreSQL end to end.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_new_generation_starts_from_stored_offsets(broker, topic, runner):
    producer = EventProducer(broker, topic)
    producer.send(2000)
    runner.process_backlog(_end(producer))
    stored = runner.store.stored_offsets(runner.spec.job_id)

    # archive generation 1 (never delete), then resume generation 2 from the database's offsets
    archive = f"{runner.spec.job_root}/archive/gen-1"
    shutil.move(runner.spec.checkpoint_path, archive)
    producer.send(1500)
    gen2 = runner.spec.with_generation(2, starting_offsets=kafka_offsets.to_spark_json(stored))
    driver = runner.start(gen2)
    runner.wait_caught_up(_end(producer), driver)
    producer.send(500)
    runner.wait_caught_up(_end(producer), driver)
    assert runner.stop(driver) == failures.EXIT_STOPPED
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == 4000
    first_gen2 = runner.store.get_generation(runner.spec.job_id, 2)
    assert kafka_offsets.from_spark_json(first_gen2["starting_offsets"]) == stored


# Fencing's database side (the epoch check under the job row's lock) runs on both databases in
# test_transaction.py; end to end, what matters is the driver's reaction, the same on either.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_zombie_driver_is_fenced(broker, topic, runner):
    producer = EventProducer(broker, topic)
    producer.send(1000)
    zombie = runner.start()
    runner.wait_caught_up(_end(producer), zombie)
    before = runner.store.stored_offsets(runner.spec.job_id)
    # A newer driver registers for the job (what a second submit does first): it takes the epoch.
    newer = runner.store.begin_run(runner.spec.job_id, runner.spec.generation, runner.spec.version)
    producer.send(600)
    assert zombie.wait(120) == failures.EXIT_CONCURRENT, runner.log_tail(zombie)
    row = runner.run_row(zombie)
    assert row.failure_kind == "CONCURRENT"
    assert f"current epoch is {newer.epoch}" in row.termination_message
    assert runner.store.stored_offsets(runner.spec.job_id) == before  # the zombie committed nothing

    runner.process_backlog(_end(producer))
    assert check_exactly_once(runner.store, runner.spec.job_id, producer.produced)["read"] == 1600


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("held_up", ["in_its_stop", "in_its_start"])
def test_a_fenced_driver_held_up_ends_itself(broker, topic, runner, held_up):
    """The job is restarted from another host, which cannot signal this driver: the new run takes the epoch.
    The driver is held up where its main loop cannot see that: in its query's stop, which waits for good on
    a batch that never ends (a hung call in the job's ``results``: Spark cannot interrupt a Python
    callback), or in a start that hangs once registered (a dependency that never answers).  The fence
    watch ends the process one heartbeat timeout later, recorded as fenced."""
    runner.application = str(STUCK_ON_BATCH if held_up == "in_its_stop" else HANGS_ON_START)
    runner.spec = dataclasses.replace(runner.spec, heartbeat_timeout_seconds=6.0)
    producer = EventProducer(broker, topic)
    producer.send(300)
    zombie = runner.start()
    if held_up == "in_its_stop":
        runner.wait_running(zombie)
        wait_until(lambda: "the batch's results hang" in runner.log_tail(zombie, 400), 120, "the batch to hang",
                   on_timeout=lambda: runner.log_tail(zombie))
    else:
        wait_until(lambda: runner.run_row(zombie), 120, "the driver to register",
                   on_timeout=lambda: runner.log_tail(zombie))
    newer = runner.store.begin_run(runner.spec.job_id, runner.spec.generation, runner.spec.version,
                                   host="elsewhere (00000000)", pid=1)
    taken = time.monotonic()
    assert zombie.wait(90) == failures.EXIT_CONCURRENT, runner.log_tail(zombie)
    assert time.monotonic() - taken >= 6.0, "ended by its main loop: it was not held up"
    row = runner.run_row(zombie)
    assert row.failure_kind == "CONCURRENT", row
    assert "did not end within 6s" in row.termination_message, row.termination_message
    assert f"current epoch is {newer.epoch}" in row.termination_message
    assert runner.committed_batches() == 0


# Detection happens against Kafka before anything touches the database: one database suffices.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_data_loss_names_the_lost_ranges(broker, topic, runner):
    producer = EventProducer(broker, topic)
    producer.send(900)
    runner.process_backlog(_end(producer))
    stored = runner.store.stored_offsets(runner.spec.job_id)

    # The topic is recreated: the offsets the checkpoint and the database hold are gone from Kafka.
    broker.delete_topic(topic)
    broker.create_topic(topic, 3)
    EventProducer(broker, topic, seed=99).send(30)

    driver = runner.start()
    assert driver.wait(180) == failures.EXIT_DATA_LOSS, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert row.failure_kind == "DATA_LOSS" and row.error_class.startswith("KAFKA_DATA_LOSS")
    for (t, p), position in stored.items():
        assert f"{t}-{p} [" in row.termination_message and f", {position})" in row.termination_message

    # Resuming a new generation from the stored offsets is refused before the query starts (invariant 5).
    gen2 = runner.spec.with_generation(2, starting_offsets=kafka_offsets.to_spark_json(stored))
    driver = runner.start(gen2)
    assert driver.wait(180) == failures.EXIT_DATA_LOSS, runner.log_tail(driver)
    row = runner.run_row(driver)
    assert row.query_started_at is None and "offsets went backwards" in row.termination_message
    assert runner.store.stored_offsets(runner.spec.job_id) == stored
