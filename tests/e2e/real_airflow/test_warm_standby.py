"""The warm standby on a real Airflow (scheduler, triggerer, dag-processor, api-server; LocalExecutor):
``stream_deploy`` starts the job and its standby; each SIGKILL of the active driver is taken over by the
standby on its own, and the always-on watcher's NO_STANDBY event makes ``stream_health`` start the next
standby at once.  The test only kills and observes; it ends with exact counts against Kafka and the
result tables.
"""

from __future__ import annotations

import time

import pytest

from airflow_stream_provider.lifecycle.controller import STANDBY_FAILURES_MAX
from airflow_stream_provider.state.standbys import StandbyLog, StandbyRecord, StandbyStatus
from stack.deployment import StreamDeployment, kill_driver
from stack.events import EventProducer, Trickle
from stack.jobs import check_exactly_once, wait_until

KILLS = 2
#: How long a standby warms up before the test kills it: several of the watcher's 1 s polls
WATCHED_WARMING_S = 3.0


@pytest.fixture
def deployment_options() -> dict:
    return {"spec": {"standby": True}}


def _warm_standby(deployment: StreamDeployment, known: list[str], timeout: float = 300) -> StandbyRecord:
    """A standby of the job other than ``known`` once it is warm and waiting."""
    log = StandbyLog(deployment.store)

    def waiting():
        fresh = [s for s in log.live(deployment.job_id)
                 if s.standby_id not in known and s.status == StandbyStatus.WAITING]
        return fresh[0] if fresh else None

    return wait_until(waiting, timeout, "a new standby to be warm",
                      on_timeout=lambda: "\n".join(s.describe() for s in log.recent(deployment.job_id)))


def _standby_started_by_health(deployment: StreamDeployment, standby_id: str) -> dict:
    """The ``stream_health`` run whose recover task started ``standby_id``."""
    def found():
        for run in deployment.health_runs():
            state, result = deployment.tasks("stream_health", run["dag_run_id"]).get("recover", (None, None))
            if state == "success" and ((result or {}).get("standby") or {}).get("standby_id") == standby_id:
                return run
        return None

    return wait_until(found, 60, f"the stream_health run that started standby {standby_id}", interval=1.0)


def test_each_takeover_is_followed_by_a_new_standby_from_the_watcher(deployment, broker, topic, figures):
    producer = EventProducer(broker, topic, seed=11)
    producer.send(1500)
    submitted = deployment.deploy(producer.produced)["submit"][1]
    assert submitted["standby"]["action"] == "started", submitted

    known: list[str] = []
    seconds: list[float] = []
    with Trickle(producer, chunk=10, pause_s=0.5):
        for kill in range(KILLS):
            standby = _warm_standby(deployment, known)
            if kill:  # the first came with the deploy; each later one from the watcher's event
                health_run = _standby_started_by_health(deployment, standby.standby_id)
                assert health_run["run_type"] == "asset_triggered", health_run
            known.append(standby.standby_id)
            victim = deployment.processing()
            killed_at = time.time()
            kill_driver(victim["pid"])
            taken = deployment.processing(120, other_than=victim["run_id"], after=killed_at)
            assert taken["run_id"] == standby.standby_id, "the standby took over, not a cold restart"
            seconds.append(taken["committed_at"] - killed_at)
        last = _warm_standby(deployment, known)  # the watcher replaced the standby used last, too
        _standby_started_by_health(deployment, last.standby_id)

    producer.send(300)
    deployment.wait_caught_up(producer.produced)
    tasks = deployment.trigger("stream_stop")
    assert tasks["stop"][0] == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(deployment.store, deployment.job_id, producer.produced)

    runs = deployment.runs()
    assert [r.run_id for r in runs[1:]] == known, "one run per driver life: every restart was a takeover"
    assert [r.status for r in runs] == ["DEAD"] * KILLS + ["STOPPED"], [(r.run_id[:8], r.status) for r in runs]
    log = StandbyLog(deployment.store)
    assert [log.get(s).status for s in known] == [StandbyStatus.TOOK_OVER] * KILLS
    assert log.get(last.standby_id).status == StandbyStatus.ENDED, "the stop ended the waiting standby"
    wait_until(lambda: not StandbyLog(deployment.store).live(deployment.job_id), 60, "no live standby")
    figures.record("real airflow kill -9 taken over by the warm standby", seconds=[round(s, 1) for s in seconds],
                   **counts)


def test_standbys_that_keep_dying_while_warming_up_are_not_started_without_end(deployment, broker, topic):
    """Each standby dies (SIGKILL) while it warms up, as one that cannot live beside the active driver would
    (a fixed port, too little memory).  The watcher reports NO_STANDBY after each death and ``stream_health``
    starts the next, until three have died in a row: then its ``recover`` fails once, naming the last
    standby's evidence and log, and starts no other.  The active run processes throughout."""
    producer = EventProducer(broker, topic, seed=13)
    producer.send(600)
    deployment.deploy(producer.produced)
    active = deployment.latest_run()
    log = StandbyLog(deployment.store)
    killed: list[str] = []

    def started() -> StandbyRecord | None:
        fresh = [s for s in log.live(deployment.job_id) if s.standby_id not in killed]
        return fresh[0] if fresh else None

    def died_warming_up() -> int:
        """How many of the newest standbys in a row died before they were warm."""
        newest = [log.get(s) for s in killed[::-1]]
        return next((n for n, s in enumerate(newest) if s.ready_at is not None), len(newest))

    # The deploy's standby (it may be warm already: then its death does not count), then each one
    # stream_health starts on the watcher's NO_STANDBY, killed a few seconds into its warm-up (a JVM's start
    # takes longer), once the watcher has seen it warming: a death it never saw is no new transition
    while died_warming_up() < STANDBY_FAILURES_MAX:
        standby = wait_until(started, 180, "a new standby",
                             on_timeout=lambda: "\n".join(s.describe() for s in log.recent(deployment.job_id)))
        time.sleep(max(0.0, standby.started_at + WATCHED_WARMING_S - time.time()))
        kill_driver(standby.pid)
        killed.append(standby.standby_id)
        assert len(killed) <= STANDBY_FAILURES_MAX + 2, [log.get(s).describe() for s in killed]

    (failed,) = wait_until(lambda: deployment.failed_health_runs("recover"), 180,
                           "stream_health's recover to fail, withholding the next standby", interval=1.0)
    assert failed["run_type"] == "asset_triggered", failed
    text = deployment.airflow.task_log("stream_health", failed["dag_run_id"], "recover")
    assert f"its last {STANDBY_FAILURES_MAX} standbys died while warming up" in text, text[-3000:]
    assert "Read the standby's log" in text, text[-3000:]
    time.sleep(10)  # nothing starts another: the persisting condition makes no further event
    assert [s.standby_id for s in log.recent(deployment.job_id, 10)] == killed[::-1]
    assert [log.get(s).status for s in killed] == [StandbyStatus.DEAD] * len(killed)
    assert deployment.failed_health_runs("recover") == [failed]

    producer.send(300)
    deployment.wait_caught_up(producer.produced)
    assert deployment.latest_run().run_id == active.run_id, "the active run processed throughout"
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)
