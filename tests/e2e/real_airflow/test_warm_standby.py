"""The warm standby on a real Airflow (scheduler, triggerer, dag-processor, api-server; LocalExecutor):
``stream_deploy`` starts the job and its standby; each SIGKILL of the active driver is taken over by the
standby on its own, and the always-on watcher's NO_STANDBY event makes ``stream_health`` start the next
standby at once.  The test only kills and observes; it ends with exact counts against Kafka and the
result tables.
"""

from __future__ import annotations

import time

import pytest

from airflow_stream_provider.state.standbys import StandbyLog, StandbyRecord, StandbyStatus
from stack.deployment import StreamDeployment, kill_driver
from stack.events import EventProducer, Trickle
from stack.jobs import check_exactly_once, wait_until

KILLS = 2


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
    tasks = deployment.trigger("stream_deploy")
    state, run_id = tasks["_run"]
    assert state == "success", deployment.explain("stream_deploy", run_id)
    submitted = tasks["submit"][1]
    assert submitted["standby"]["action"] == "started", submitted
    deployment.wait_caught_up(producer.produced)

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
