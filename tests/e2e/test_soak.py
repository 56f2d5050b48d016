"""The soak (``make soak``; excluded from the default run): a long stream under repeated faults, repaired
by the provider alone, and exactly-once at the end.

100,000 events (1% malformed) are produced at a steady pace over about ten minutes while the driver's
whole process group is SIGKILLed 20 times at random moments (the health DAG finds it DEAD and restarts
it from its checkpoint each time), stopped and started again gracefully 3 times (stop DAG, deploy DAG),
and upgraded once to ``spark_jobs/events_job_v2.py``, whose checkpoint is incompatible (upgrade DAG:
preflight, archive, new generation from the stored offsets).  Then: 0 lost, 0 duplicated, per-minute
aggregates equal to a recomputation, every record in the ledger once.

Sizes come from the environment: ``SOAK_EVENTS`` (100000), ``SOAK_KILLS`` (20), ``SOAK_STOP_ROUNDS``
(3), ``SOAK_PRODUCE_SECONDS`` (600), ``SOAK_SEED`` (2026).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time

import pytest

from airflow_stream_provider import failures, local_driver
from stack.events import EventProducer
from stack.jobs import REPO, check_exactly_once, wait_until
from tests.dags import provider_scenarios as dags
from tests.dags import soak_scenario
from tests.dagtest.dagruns import caught_up, run_dag

EVENTS = int(os.environ.get("SOAK_EVENTS", 100_000))
KILLS = int(os.environ.get("SOAK_KILLS", 20))
STOP_ROUNDS = int(os.environ.get("SOAK_STOP_ROUNDS", 3))
PRODUCE_SECONDS = float(os.environ.get("SOAK_PRODUCE_SECONDS", 600))
SEED = int(os.environ.get("SOAK_SEED", 2026))
V2 = str(REPO / "spark_jobs" / "events_job_v2.py")

# Longer than the default per-test timeout (pyproject's --timeout); SOAK_TIMEOUT overrides it.
pytestmark = [pytest.mark.soak, pytest.mark.timeout(int(os.environ.get("SOAK_TIMEOUT", 3600)))]


class PacedProducer(threading.Thread):
    """Produces ``total`` events evenly over ``seconds``, as a live topic receives them."""

    def __init__(self, producer: EventProducer, total: int, seconds: float, chunk: int = 100):
        super().__init__(daemon=True)
        self.producer, self.total, self.seconds, self.chunk = producer, total, seconds, chunk
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        try:
            while self.producer.sent < self.total and not self.done.is_set():
                due = started + self.seconds * self.producer.sent / self.total
                self.done.wait(max(0.0, due - time.monotonic()))
                self.producer.send(min(self.chunk, self.total - self.producer.sent))
        except BaseException as err:
            self.error = err
        finally:
            self.done.set()


def _plan(rng: random.Random) -> list[str]:
    """The order of faults: kills, with the stop/start rounds and the upgrade spread between them."""
    steps = ["kill"] * KILLS
    for n in range(STOP_ROUNDS):
        steps.insert(round((n + 1) * len(steps) / (STOP_ROUNDS + 1)), "stop")
    steps.insert(max(2, len(steps) // 2 + rng.randrange(-2, 3)), "upgrade")
    return steps


def _kill_group(pid: int) -> None:
    """SIGKILL to the driver's whole process group (JVM, Python driver, Python workers): a machine dying."""
    local_driver.signal_group(os.getpgid(pid), signal.SIGKILL)


def test_soak(stream, broker, figures, capsys):
    state, job_id = stream["state"], stream["job_id"]
    spec = {**stream["params"]["spec"], "trigger_interval": "1 second",
            "kafka": {**stream["params"]["spec"]["kafka"], "max_offsets_per_trigger": 4000}}
    params = {**stream["params"], "spec": spec}
    rng = random.Random(SEED)
    producer = EventProducer(broker, stream["topic"], seed=SEED, malformed_ratio=0.01)
    pacer = PacedProducer(producer, EVENTS, PRODUCE_SECONDS)
    began = time.monotonic()

    def say(message: str) -> None:
        elapsed = time.monotonic() - began
        applied = sum(state.stored_offsets(job_id).values())
        with capsys.disabled():
            print(f"[soak {int(elapsed // 60):02d}:{int(elapsed % 60):02d}] {message} | produced {producer.sent:,}"
                  f", offsets applied {applied:,}", flush=True)

    recoveries: list[float] = []
    kills = stop_rounds = 0
    upgraded = None
    try:
        status, tasks = run_dag(dags.deploy, params)
        assert status == "success", tasks
        say(f"deployed version 1.0: run {tasks['submit'][1]['run_id'][:8]}")
        pacer.start()
        for step in _plan(rng):
            assert pacer.error is None, pacer.error
            run = state.latest_run(job_id)
            if step == "kill":
                # a random moment of the run: during its first batch (a quarter of the kills), or once it
                # committed a batch: in the middle of a later one or between two
                if rng.random() < 0.25:
                    delay = rng.uniform(0.5, 8.0)
                    time.sleep(delay)
                    moment = f"{delay:.1f}s after its query started"
                else:
                    wait_until(lambda r=run: state.store.get_run(r.run_id).last_batch_id is not None, 300,
                               "the run to commit a batch")
                    delay = rng.uniform(0.0, 5.0)
                    time.sleep(delay)
                    moment = f"{delay:.1f}s after its first committed batch"
                run = state.store.get_run(run.run_id)
                assert local_driver.process_alive(run.pid), f"run {run.run_id} died on its own"
                killed_at = time.time()
                _kill_group(run.pid)
                kills += 1
                status, tasks = run_dag(soak_scenario.soak_health, params)
                assert status == "success", tasks
                found, recovered = tasks["health"][1], tasks["recover"][1]
                assert found["health"] == "DEAD" and found["run_id"] == run.run_id, found
                assert recovered["action"] == "restart", recovered
                seconds = state.store.get_run(recovered["run_id"]).query_started_at - killed_at
                recoveries.append(seconds)
                say(f"kill {kills}/{KILLS} of run {run.run_id[:8]} {moment} (last committed batch "
                    f"{run.last_batch_id}): DEAD -> restart, query running again after {seconds:.1f}s")
            elif step == "stop":
                status, tasks = run_dag(dags.stop, params)
                assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
                assert tasks["stop"][1]["exit_code"] == failures.EXIT_STOPPED
                stopped_s = tasks["stop"][1]["seconds"]
                time.sleep(rng.uniform(1.0, 5.0))  # records arrive while it is stopped
                status, tasks = run_dag(dags.deploy, params)
                assert status == "success", tasks
                stop_rounds += 1
                say(f"stop/start round {stop_rounds}/{STOP_ROUNDS}: stopped in {stopped_s}s, started run "
                    f"{tasks['submit'][1]['run_id'][:8]}")
            else:
                params = {**params, "application": V2, "spec": {**params["spec"], "version": "2.0"}}
                status, tasks = run_dag(dags.upgrade, params, reset_policy="after_preflight")
                assert status == "success", tasks
                upgraded = tasks["upgrade"][1]
                assert upgraded["preflight"]["verdict"] == "incompatible", upgraded["preflight"]
                assert upgraded["action"] == "reset" and upgraded["generation"] == 2, upgraded
                say(f"upgrade to 2.0: preflight {upgraded['preflight']['verdict']} "
                    f"({upgraded['preflight']['error_class']}), generation 1 archived, generation 2 from "
                    f"{upgraded['starting_offsets']}")
        pacer.join(PRODUCE_SECONDS + 300)
        assert pacer.error is None and producer.sent == EVENTS, (pacer.error, producer.sent)
        say("all events produced; waiting for the job to catch up")
        caught_up(state, job_id, producer, timeout=900)
        status, tasks = run_dag(dags.stop, params)
        assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    finally:
        pacer.done.set()
    counts = check_exactly_once(state.store, job_id, producer.produced)
    counts["ledger_rows"] = counts.pop("batches")  # one per batch and partition
    restarts = [r["action"] for r in state.restarts_since(job_id, 0)]
    assert counts["read"] == EVENTS and kills == KILLS and stop_rounds == STOP_ROUNDS and upgraded
    result = {
        "produced": EVENTS, "malformed": len(producer.produced.malformed), **counts, "lost": 0, "duplicated": 0,
        "kills": kills, "recoveries": restarts.count("restart"), "resets": restarts.count("reset"), "stop_rounds": stop_rounds, "upgrades": 1,
        "recovery_seconds_median": round(statistics.median(recoveries), 1),
        "recovery_seconds_max": round(max(recoveries), 1),
        "minutes": round((time.monotonic() - began) / 60, 1),
    }
    say("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    figures.record("soak", **result)
