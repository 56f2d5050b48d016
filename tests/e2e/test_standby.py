"""The warm standby end to end: real drivers in their own processes, SIGKILLs, a paused zombie.

Each test ends with exact counts against Kafka and the result tables (``check_exactly_once``).  The
replacement standby after each takeover is started here, as the controller's ``ensure_standby`` does
from the health DAG (tested on its own in ``tests/integration``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from dataclasses import replace
from pathlib import Path

import pytest

from airflow_stream_provider import failures
from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus
from stack.events import EventProducer, Trickle
from stack.jobs import check_exactly_once, freeze_between_transactions, wait_until

#: SIGKILLs of the active driver in the kill test; each is taken over by a standby that is warm by then.
#: The default run has one here (each costs a standby's warm-up, about half a minute) and two more on a
#: real Airflow (``real_airflow/test_warm_standby.py``); ``make soak`` runs ten, and ``make bench``
#: (section ``standby``) times ten.
KILLS = int(os.environ.get("STREAM_STANDBY_KILLS", "1"))
#: Standbys here run their warm-up again every 10 s (45 s in production): some takeovers meet a re-warm in
#: flight.
REWARM_OFTEN = {"STREAM_STANDBY_REWARM_S": "10"}
BESIDE_A_WARM_UP = str(Path(__file__).resolve().parents[1] / "fixtures" / "jobs" / "beside_a_warm_up_query.py")


def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _waiting(runner, standby, timeout: float = 240):
    """The standby's row once it is warm and waiting; fails at once if its driver exited."""
    log = StandbyLog(runner.store)

    def ready():
        if not standby.alive():
            raise AssertionError(f"the standby exited while warming up\n{runner.log_tail(standby)}")
        record = log.get(standby.run_id)
        return record if record and record.status == StandbyStatus.WAITING else None

    return wait_until(ready, timeout, "the standby to be warm", on_timeout=lambda: runner.log_tail(standby))


def _processing_after(runner, run_id: str, after: float, timeout: float = 120) -> float:
    return wait_until(lambda: runner.store.first_commit(runner.spec.job_id, run_id, after), timeout,
                      f"run {run_id} to commit a batch", interval=0.05,
                      on_timeout=lambda: runner.log_tail(next(d for d in runner.drivers if d.run_id == run_id)))


def _kill_and_take_over(runner, active, rng: random.Random, seconds: list[float]):
    """Start a standby, let it warm up, SIGKILL the active driver's process group in the middle of its
    work; return the standby once its run committed a batch (and record how long that took)."""
    standby = runner.start(standby=True, env=REWARM_OFTEN)
    _waiting(runner, standby)
    _processing_after(runner, active.run_id, time.time())  # the active run is busy right now
    time.sleep(rng.uniform(0, 0.8))
    killed_at = time.time()
    active.kill()
    seconds.append(_processing_after(runner, standby.run_id, killed_at) - killed_at)
    replaced = runner.store.get_run(active.run_id)
    assert replaced.status == "DEAD" and f"standby {standby.run_id} took over" in replaced.termination_message
    took = StandbyLog(runner.store).get(standby.run_id)
    assert took.status == StandbyStatus.TOOK_OVER and took.replaced_run_id == active.run_id
    assert runner.store.latest_run(runner.spec.job_id).run_id == standby.run_id
    return standby


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_kill9_of_the_active_driver_is_taken_over_by_the_standby(broker, topic, runner, figures):
    """KILLS SIGKILLs of the active driver's whole process group, each at a random moment of a batch while
    events keep arriving; each time the warm standby takes over on the same generation."""
    rng = random.Random(20261124)
    runner.spec = replace(runner.spec, standby=True)
    producer = EventProducer(broker, topic, malformed_ratio=0.01)
    producer.send(1500)
    active = runner.start()
    runner.wait_running(active)
    seconds = []
    with Trickle(producer, chunk=10, pause_s=0.2):  # events keep arriving through every kill
        for _ in range(KILLS):
            active = _kill_and_take_over(runner, active, rng, seconds)
    runner.wait_caught_up(_end(producer), active)
    assert runner.stop(active) == failures.EXIT_STOPPED
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    assert counts["read"] == producer.produced.total
    epochs = [run.epoch for run in runner.store.runs(runner.spec.job_id)]
    assert epochs == sorted(epochs) and len(epochs) == KILLS + 1  # one run per driver life, no double start
    figures.record("standby takeover after kill -9", kills=KILLS, median_s=round(statistics.median(seconds), 2),
                   max_s=round(max(seconds), 2), **counts)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_killed_standby_leaves_the_active_run_alone_and_a_replacement_takes_over(broker, topic, runner):
    runner.spec = replace(runner.spec, standby=True)
    producer = EventProducer(broker, topic)
    producer.send(1200)
    active = runner.start()
    first = runner.start(standby=True, env=REWARM_OFTEN)
    _waiting(runner, first)
    first.kill()  # SIGKILL of the standby's whole process group
    producer.send(600)
    runner.wait_caught_up(_end(producer), active)  # the active run never noticed
    assert runner.store.latest_run(runner.spec.job_id).run_id == active.run_id
    assert StandbyLog(runner.store).get(first.run_id).status == StandbyStatus.WAITING  # until someone checks

    replacement = runner.start(standby=True, env=REWARM_OFTEN)
    _waiting(runner, replacement)
    active.kill()
    producer.send(600)
    _processing_after(runner, replacement.run_id, 0.0)
    runner.wait_caught_up(_end(producer), replacement)
    assert runner.stop(replacement) == failures.EXIT_STOPPED
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_standby_and_zombie_race_for_the_epoch(broker, topic, runner, figures):
    """The active driver is paused (SIGSTOP: a long GC pause, a frozen VM): its heartbeat goes stale and
    the standby takes over although the process lives.  Resumed, the zombie races the new run; the epoch
    decides: the zombie commits nothing and ends itself, fenced."""
    runner.spec = replace(runner.spec, standby=True, heartbeat_timeout_seconds=5.0)
    producer = EventProducer(broker, topic)
    producer.send(1500)
    zombie = runner.start()
    standby = runner.start(standby=True, env=REWARM_OFTEN)
    _waiting(runner, standby)
    runner.wait_caught_up(_end(producer), zombie)
    producer.send(900)  # the zombie may be in the middle of these when it freezes
    _processing_after(runner, zombie.run_id, time.time())
    freeze_between_transactions(runner.store.engine.url.database, zombie.pid)
    paused = time.time()
    # Records for the standby to commit: the zombie may have finished its batch just before it froze, and
    # a caught-up stream commits nothing.  Resumed, the zombie sees them too.
    producer.send(600)
    try:
        taken = _processing_after(runner, standby.run_id, paused, timeout=90)
        zombie_row = runner.store.get_run(zombie.run_id)
        assert zombie_row.status == "DEAD" and "no heartbeat" in zombie_row.termination_message
    finally:
        os.killpg(zombie.pid, signal.SIGCONT)
        resumed = time.time()
    assert zombie.wait(120) == failures.EXIT_CONCURRENT, runner.log_tail(zombie)
    # Three guards fence it, whichever comes first: its heartbeat reads the newer epoch, its commit is
    # refused for the epoch, or Spark refuses to log a batch the standby already logged in the checkpoint.
    ended = runner.store.get_run(zombie.run_id)
    assert ended.failure_kind == failures.FailureKind.CONCURRENT.value, ended
    by_spark = failures.classify(ended.termination_message, ended.error_class).signature
    assert "current epoch is" in ended.termination_message or by_spark == "concurrent-checkpoint-writer", ended
    assert runner.store.first_commit(runner.spec.job_id, zombie.run_id, resumed) is None
    runner.wait_caught_up(_end(producer), standby)
    assert runner.stop(standby) == failures.EXIT_STOPPED
    counts = check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
    figures.record("standby takeover of a paused driver", seconds_after_pause=round(taken - paused, 1), **counts)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_standby_of_another_version_is_refused_with_both_versions_named(broker, topic, runner):
    producer = EventProducer(broker, topic)
    producer.send(300)
    active = runner.start()
    runner.wait_running(active)
    other = runner.start(replace(runner.spec, version="2.0"), standby=True)
    assert other.wait(240) == failures.EXIT_CONFIG, runner.log_tail(other)
    record = StandbyLog(runner.store).get(other.run_id)
    assert record.status == StandbyStatus.REFUSED
    assert "'2.0'" in record.message and "'1.0'" in record.message
    assert runner.store.latest_run(runner.spec.job_id).run_id == active.run_id and active.alive()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_run_records_its_own_query_only(broker, topic, runner):
    """A warm-up query still running beside the job's (as a standby's re-warm may be at its takeover): its
    batches are no progress of the run, nor a batch a graceful stop waits for."""
    runner.application = BESIDE_A_WARM_UP
    producer = EventProducer(broker, topic)
    producer.send(600)
    driver = runner.start()
    runner.wait_caught_up(_end(producer), driver)
    # the commit's own record of the batch comes first, the listener's progress (with sources) after it
    wait_until(lambda: "sources" in json.loads(runner.run_row(driver).last_progress or "{}"), 60,
               "the listener to record the batch's progress", on_timeout=lambda: runner.log_tail(driver))
    seen = []
    for _ in range(10):  # the warm-up query ends a batch every 200 ms
        seen.append(runner.run_row(driver).last_progress)
        time.sleep(0.25)
    sources = [[s["end"] for s in json.loads(p)["sources"]] for p in seen]
    assert all(ends and all(isinstance(e, dict) and topic in e for e in ends) for ends in sources), sources
    assert runner.stop(driver) == failures.EXIT_STOPPED, runner.log_tail(driver)
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
