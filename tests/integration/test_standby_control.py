"""The Airflow side of the warm standby: finding a dead one, refusing one the Spark connection cannot give.

The drivers here are plain processes that have exited: what is checked is how the controller reads the
standby table and the process table, on both databases; the standby drivers themselves run in
``tests/e2e/test_standby.py``.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider import local_driver
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.controller import StreamJobController
from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus
from tests.dagtest import airflow as airflow_stack


def _controller(database_url: str, spark_conn_id: str = "spark_default") -> StreamJobController:
    spec = StreamJobSpec("orders", "1.0", KafkaSpec("127.0.0.1:9092", ("orders",)), "/tmp/ckpt", database_url,
                         standby=True)
    return StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(),
                               driver=StreamDriverHook(spark_conn_id))


def test_a_standby_whose_process_is_gone_is_recorded_dead_and_not_offered(state_store, database_url):
    import socket

    log = StandbyLog(state_store)
    gone = subprocess.Popen(["true"])
    gone.wait()
    log.register("s-gone", "orders", "1.0", 1, host=socket.gethostname(), pid=gone.pid, log_path=None)
    with subprocess.Popen(["sleep", "30"]) as alive:
        log.register("s-alive", "orders", "1.0", 1, host=socket.gethostname(), pid=alive.pid, log_path=None)
        controller = _controller(database_url)
        assert controller.live_standby().standby_id == "s-alive"
        alive.kill()
    dead = log.get("s-gone")
    assert dead.status == StandbyStatus.DEAD and f"pid {gone.pid}" in dead.message
    assert [s.standby_id for s in log.live("orders")] == ["s-alive"]
    assert controller.end_standbys("the job is being stopped") == ["s-alive"]
    assert log.get("s-alive").status == StandbyStatus.ENDED


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_standby_on_a_cluster_deploy_mode_fails_before_anything_starts(state_store, database_url, monkeypatch):
    monkeypatch.setenv(*airflow_stack.connection_env("spark_yarn_cluster", conn_type="spark", host="yarn",
                                                     extra={"deploy-mode": "cluster"}))
    controller = _controller(database_url, "spark_yarn_cluster")
    with pytest.raises(AirflowFailException) as err:
        controller.check_before_start(controller.spec)
    message = str(err.value)
    assert "'standby'" in message and "cluster deploy mode" in message and "nothing was started" in message


def test_only_the_run_holding_the_expected_epoch_is_taken_over(state_store):
    """Two standbys see the same dead run: the epoch decides, the second registers nothing."""
    first = state_store.begin_run("orders", 1, "1.0")
    won = state_store.begin_run("orders", 1, "1.0", run_id="standby-a", expected_epoch=first.epoch)
    lost = state_store.begin_run("orders", 1, "1.0", run_id="standby-b", expected_epoch=first.epoch)
    assert won.epoch == first.epoch + 1 and lost is None
    assert state_store.get_run("standby-b") is None
    assert state_store.current_epoch("orders") == won.epoch


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_standby_recorded_by_its_launcher_is_taken_over_by_its_driver_unless_ended_first(state_store):
    """The launcher records the standby at once (so nobody starts a second one while its JVM starts); the
    driver's registration updates that row, and a standby ended in between (the job was stopped) is told."""
    log = StandbyLog(state_store)
    assert log.register("s-1", "orders", "1.0", 1, host="h", pid=100, log_path="/logs/a")
    assert log.register("s-1", "orders", "1.0", 1, host="h", pid=101, log_path="/logs/a")
    record = log.get("s-1")
    assert (record.pid, record.status) == (101, StandbyStatus.WARMING)
    log.register("s-2", "orders", "1.0", 1, host="h", pid=102, log_path=None)
    assert log.end_all("orders", "the job is being stopped") == ["s-1", "s-2"]
    assert not log.register("s-2", "orders", "1.0", 1, host="h", pid=103, log_path=None)
    assert log.get("s-2").status == StandbyStatus.ENDED and log.get("s-2").pid == 102


def test_a_successor_is_released_once_and_is_no_standby_to_the_health_check(state_store, database_url):
    """An upgrade's successor waits for its release; the health check neither offers it as the job's standby
    nor reports it missing; a release names the generation, offsets and epoch, and only a live one takes."""
    import socket

    log = StandbyLog(state_store)
    with subprocess.Popen(["sleep", "30"]) as process:
        log.register("succ", "orders", "2.0", 1, host=socket.gethostname(), pid=process.pid, log_path=None,
                     role="successor")
        controller = _controller(database_url)
        assert controller.live_standby() is None, "a successor is not the job's standby"
        assert log.get("succ").successor and log.live("orders", role="successor")[0].standby_id == "succ"
        assert log.release("succ", 2, '{"orders":{"0":42}}', 7)
        record = log.get("succ")
        assert (record.release_generation, record.release_offsets, record.release_epoch) == (
            2, '{"orders":{"0":42}}', 7)
        process.kill()
    with state_store.engine.begin() as conn:
        assert log.took_over(conn, "succ", None, "released by the upgrade")
    assert not log.release("succ", 3, None, 8), "an ended successor is not released again"


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_standby_or_successor_started_on_another_host_is_waited_for_by_its_row(state_store, database_url):
    """The launch a takeover or an upgrade's release waits for carries the host its standby runs on: a
    triggerer elsewhere (the compose stack's own container) cannot see that pid, which is no sign the
    standby exited before registering."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process on this host has any more
    log = StandbyLog(state_store)
    log.register("far", "orders", "1.0", 1, host="another-host", pid=gone.pid, log_path=None)
    log.register("far-successor", "orders", "2.0", 1, host="another-host", pid=gone.pid, log_path=None,
                 role="successor")
    failed = state_store.begin_run("orders", 1, "1.0")
    controller = _controller(database_url)
    standby = controller.standby_launch(log.get("far"), state_store.get_run(failed.run_id), "/jobs/orders.py")
    successor = controller.release_successor({"standby_id": "far-successor", "application": "/jobs/orders.py",
                                              "spec": controller.spec.to_json()}, 2, None)
    for launch in (standby, successor):
        wait = controller.launch_wait(launch, "ready", 60)
        assert (wait.host, wait.pid) == ("another-host", gone.pid), launch
        assert local_driver.launch_alive(wait.pid, wait.host, wait.started_at) is None, "judged by this host's pids"


def _successor(store, database_url, standby_id: str):
    """A successor's own side (``runtime.standby``) registered in the state database, without its Spark
    session: what is checked is when its wait ends, which reads the database only."""
    import os

    from airflow_stream_provider.runtime.standby import Standby

    spec = StreamJobSpec("orders", "2.0", KafkaSpec("127.0.0.1:9092", ("orders",)), "/tmp/ckpt", database_url)
    successor = Standby(store, spec, standby_id, pid=os.getpid(), log_path=None, successor=True)
    assert successor.register()
    return successor


def _polls(count: int):
    """A wait's ``stop_signalled`` that signals after ``count`` polls (of ``POLL_S``): a successor that
    does not end by itself ends there, as SIGTERM."""
    left = iter(range(count))
    return lambda: next(left, None) is None


def _upgrade_holding(store, standby_id: str) -> str:
    from airflow_stream_provider.state.upgrades import UpgradeLog

    return UpgradeLog(store).begin("orders", "1.0", "2.0", {"successor": {"standby_id": standby_id}})


def test_a_successor_no_upgrade_will_release_ends_by_itself(store, database_url, monkeypatch):
    """An upgrade task that died without running either ``on_kill`` (its worker and triggerer lost, or a
    deferred one on Airflow before 3.3): its successor would wait for a release without end, holding a
    driver's memory.  It ends once its upgrade finished without releasing it, or
    stopped moving, or when no upgrade took it; a live upgrade's successor waits, and a released one
    starts even if its upgrade finished meanwhile."""
    from sqlalchemy import update

    from airflow_stream_provider.runtime import standby as standby_module
    from airflow_stream_provider.runtime.standby import Takeover
    from airflow_stream_provider.state.upgrades import UPGRADE_STALE_S, UpgradeLog, UpgradePhase, upgrades

    log, upgrade_log = StandbyLog(store), UpgradeLog(store)
    waiting = _successor(store, database_url, "succ-waits")
    _upgrade_holding(store, "succ-waits")
    assert waiting.wait(_polls(3)).why == "SIGTERM", "a live upgrade's successor waits"

    finished = _successor(store, database_url, "succ-finished")
    upgrade_id = _upgrade_holding(store, "succ-finished")
    upgrade_log.move(upgrade_id, UpgradePhase.DONE, {"successor": {"standby_id": "succ-finished"}}, "failed")
    assert "ended (failed) without releasing it" in finished.wait(_polls(25)).why
    assert log.get("succ-finished").status == StandbyStatus.ENDED

    stale = _successor(store, database_url, "succ-stale")
    upgrade_id = _upgrade_holding(store, "succ-stale")
    with store.engine.begin() as conn:  # its task was killed half an hour ago
        conn.execute(update(upgrades).where(upgrades.c.upgrade_id == upgrade_id)
                     .values(updated_at=upgrades.c.updated_at - UPGRADE_STALE_S - 1))
    assert "has stayed in phase PREFLIGHT" in stale.wait(_polls(25)).why
    assert log.get("succ-stale").status == StandbyStatus.ENDED

    unheld = _successor(store, database_url, "succ-unheld")
    monkeypatch.setattr(standby_module, "UPGRADE_STALE_S", 0.0)  # as if it had waited that long
    assert "no upgrade of job orders holds it" in unheld.wait(_polls(25)).why
    monkeypatch.undo()

    released = _successor(store, database_url, "succ-released")
    ticket = store.begin_run("orders", 1, "1.0")
    upgrade_id = _upgrade_holding(store, "succ-released")
    assert log.release("succ-released", 1, None, ticket.epoch)
    upgrade_log.move(upgrade_id, UpgradePhase.DONE, {}, "upgraded")
    took = released.wait(_polls(25))
    assert isinstance(took, Takeover) and took.ticket.epoch > ticket.epoch


def test_a_standby_ended_while_its_warm_up_hangs_in_the_job_code_ends(store, database_url, monkeypatch):
    """The new version's code never returns (a hung call in its results), so the warm-up query over it
    neither finishes nor stops.  Ended meanwhile (the upgrade aborted, its task killed), the successor
    ends at its next heartbeat instead of holding a driver until the call returns; not ended, it waits
    without its warm-up once that has had its time."""
    import threading
    import time

    from airflow_stream_provider.runtime import standby as standby_module

    hung = threading.Event()  # the job's code: returns only when the test ends

    def warm_up_query(checkpoint: str):
        hung.wait()

    log = StandbyLog(store)
    try:
        ended = _successor(store, database_url, "succ-hung")
        threading.Timer(1.0, log.end, ("succ-hung", StandbyStatus.ENDED, "the upgrade was aborted")).start()
        began = time.monotonic()
        verdict = ended.warm_up(warm_up_query, _polls(200))
        assert "asked to end (the upgrade was aborted)" in verdict.why, verdict
        assert time.monotonic() - began < 10

        monkeypatch.setattr(standby_module, "WARM_UP_TIMEOUT_S", 0.5)
        monkeypatch.setattr(standby_module, "WARM_UP_STOP_S", 0.5)
        waits = _successor(store, database_url, "succ-waits-without")
        assert isinstance(waits.warm_up(warm_up_query, _polls(200)), float)
        assert log.get("succ-waits-without").status == StandbyStatus.WAITING
        assert waits.rewarming(), "the hung warm-up is the one in flight: no second one is started beside it"
    finally:
        hung.set()


def _died_warming(log: StandbyLog, standby_id: str, *, warmed: bool = False, age: float = 10.0) -> None:
    """A standby the health check found gone: while warming up, or (``warmed``) after it was ready."""
    import socket

    log.register(standby_id, "orders", "1.0", 1, host=socket.gethostname(), pid=999_999,
                 log_path=f"/logs/{standby_id}.log")
    if warmed:
        log.ready(standby_id)
    log.end(standby_id, StandbyStatus.DEAD, "its driver process (pid 999999) is gone: Address already in use")
    log._update(standby_id, ended_at=time.time() - age, started_at=time.time() - age - 5)


def test_standbys_that_keep_dying_while_warming_up_are_not_started_again_and_again(state_store, database_url):
    """A standby that cannot come up beside the active driver (a fixed spark.driver.port) dies warming up;
    the watcher reports NO_STANDBY and the health DAG's recover starts the next one, which dies the same
    way: a loop of green DAG runs and JVM starts.  After three in a row, none is started, and the recover
    that was run for the missing standby fails saying why, with the last one's evidence."""
    from airflow_stream_provider.lifecycle import controller as controller_module
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator

    controller = _controller(database_url)
    log = StandbyLog(state_store)
    run_id = state_store.begin_run("orders", 1, "1.0").run_id
    state_store.mark_query_started(run_id)
    state_store.record_launch(run_id, "/jobs/orders.py", controller.spec.to_json())
    _died_warming(log, "s-warmed", warmed=True, age=100)  # warmed up, then killed: no part of a loop
    _died_warming(log, "s-1", age=60)
    _died_warming(log, "s-2", age=30)
    assert controller.standby_withheld() is None, "two in a row: the next one is still started"
    _died_warming(log, "s-3", age=5)

    withheld = controller.standby_withheld()
    assert withheld.startswith("job orders: its last 3 standbys died while warming up, the latest 5s ago "
                               "(its driver process (pid 999999) is gone: Address already in use)"), withheld
    assert "(/logs/s-3.log)" in withheld and "spark.driver.port" in withheld
    assert controller.ensure_standby(None) == {"standby_id": None, "status": None, "action": "withheld",
                                               "why": withheld}
    assert [s.standby_id for s in log.live("orders")] == [], "nothing was started"
    later = controller.standby_withheld(now=time.time() + controller_module.STANDBY_FAILURE_WINDOW_S)
    assert later is None, "once the window has passed since the first, one more is tried"

    spec = {"job_id": "orders", "version": "1.0", "checkpoint_root": "/tmp/ckpt", "kafka": {"topics": ["orders"]},
            "standby": True}
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="/jobs/orders.py")
    with pytest.raises(AirflowFailException, match="its last 3 standbys died while warming up"):
        recover.execute({})
    assert [s.standby_id for s in log.live("orders")] == []


def test_a_standby_that_cannot_be_started_does_not_fail_the_task_that_launched_the_run(state_store, database_url,
                                                                                       monkeypatch):
    """A submit (or a restart) whose run is up, and whose standby's spark-submit then fails: the task that
    launched the run succeeds, saying no standby was started; failed, its retry would find the job running
    ("already runs") or restart it again.  The recover run for a missing standby fails with it instead."""
    from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator

    controller = _controller(database_url)
    run_id = state_store.begin_run("orders", 1, "1.0").run_id
    state_store.mark_query_started(run_id)
    state_store.record_launch(run_id, "/jobs/orders.py", controller.spec.to_json())

    def no_spark_submit(*args, **kwargs):  # a stand-in: spark-submit missing from this worker's PATH
        raise FileNotFoundError(2, "No such file or directory", "spark-submit")

    monkeypatch.setattr(StreamDriverHook, "submit", no_spark_submit)
    said = controller.ensure_standby(None)
    assert said["action"] == "not started" and said["standby_id"] is None, said
    assert said["why"].startswith("job orders: no standby was started: [Errno 2] No such file or directory"), said

    spec = {"job_id": "orders", "version": "1.0", "checkpoint_root": "/tmp/ckpt", "kafka": {"topics": ["orders"]},
            "standby": True}
    recover = RecoverStreamingJobOperator(task_id="recover", spec=spec, application="/jobs/orders.py")
    with pytest.raises(AirflowFailException, match="no standby was started"):
        recover.execute({})


def test_a_waiting_standby_is_judged_by_the_heartbeat_timeout_its_spec_asks_for(state_store, database_url):
    """A job set to heartbeat every 30 s (timeout 120 s), its standby on another host: 60 s between two of
    its heartbeats is no death, for the standby as for the run.  Judged by the watcher's 30 s default, it
    was ended as DEAD, exited, and a new one was started: a JVM warm-up every few minutes, without end."""
    import json
    from dataclasses import replace

    from airflow_stream_provider.diagnosis import Diagnosis, Health, Thresholds
    from airflow_stream_provider.lifecycle.health import with_standby

    log = StandbyLog(state_store)
    run = state_store.begin_run("orders", 1, "1.0")
    state_store.mark_query_started(run.run_id)
    slow = {"job_id": "orders", "standby": True, "heartbeat_seconds": 30.0, "heartbeat_timeout_seconds": 120.0}
    run = replace(state_store.get_run(run.run_id), spec=json.dumps(slow))
    log.register("s-far", "orders", "1.0", 1, host="another-host", pid=4242, log_path=None)
    log.ready("s-far")
    with state_store.engine.begin() as conn:  # its last heartbeat, 60 s ago
        from sqlalchemy import update

        from airflow_stream_provider.state.standbys import standbys
        conn.execute(update(standbys).where(standbys.c.standby_id == "s-far").values(heartbeat_at=time.time() - 60))

    found = with_standby(Diagnosis("orders", Health.HEALTHY, run_id=run.run_id), run, log, Thresholds())
    assert found.standby == StandbyStatus.WAITING.value and log.get("s-far").status == StandbyStatus.WAITING
    controller = _controller(database_url)
    controller.spec = replace(controller.spec, heartbeat_seconds=30.0, heartbeat_timeout_seconds=120.0)
    assert controller.live_standby().standby_id == "s-far"
    # silent past its own timeout, it is gone
    with state_store.engine.begin() as conn:
        conn.execute(update(standbys).where(standbys.c.standby_id == "s-far").values(heartbeat_at=time.time() - 150))
    assert with_standby(Diagnosis("orders", Health.HEALTHY, run_id=run.run_id), run, log,
                        Thresholds()).standby == "MISSING"
    assert log.get("s-far").status == StandbyStatus.DEAD


def _standby(store, database_url, standby_id: str, **spec_changes):
    """A standby's own side (``runtime.standby``) registered in the state database, without its Spark session:
    what is checked is what its polls of the database decide."""
    import os
    from dataclasses import replace

    from airflow_stream_provider.runtime.standby import Standby

    spec = replace(StreamJobSpec("orders", "1.0", KafkaSpec("127.0.0.1:9092", ("orders",)), "/tmp/ckpt",
                                 database_url, standby=True), **spec_changes)
    standby = Standby(store, spec, standby_id, pid=os.getpid(), log_path=None)
    assert standby.register()
    return standby


def _down_for(calls: int, outage: dict, real):
    """``real``, failing as a state database that does not answer for its first ``calls`` calls; ``outage``
    says ``down`` until a call went through (a test's driver heartbeats again after that)."""
    from sqlalchemy.exc import OperationalError

    outage.update(left=calls, down=True)

    def call(*args, **kwargs):
        if outage["left"] > 0:
            outage["left"] -= 1
            raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))
        answer = real(*args, **kwargs)
        outage["down"] = False
        return answer
    return call


def test_a_standby_rides_out_an_outage_of_the_state_database(store, database_url, caplog):
    """The state database goes away (a restart, a failover) while a standby warms up, and again while it
    waits, each time for about the heartbeat timeout.  The standby exited at the first error, its row left
    WARMING or WAITING (one warming counted as died warming up, towards withholding standbys).  Now it tries
    again each poll, saying so once per outage; and it does not take over the run, which could not heartbeat
    during the outage either and heartbeats again once the database is back."""
    import logging
    import threading

    run = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(run.run_id)
    standby = _standby(store, database_url, "s-outage", heartbeat_seconds=0.5, heartbeat_timeout_seconds=2.0)
    warming, waiting = {"down": False}, {"down": False}
    done = threading.Event()

    def driver():  # the active run: heartbeats every 0.5 s, none while the database does not answer
        while not done.is_set():
            if not warming["down"] and not waiting["down"]:
                store.heartbeat(run.run_id)
            done.wait(0.5)

    threading.Thread(target=driver, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="airflow_stream_provider.standby"):
            standby.log.heartbeat = _down_for(10, warming, standby.log.heartbeat)  # 2 s of polls
            standby.log.ready = _down_for(10, warming, standby.log.ready)
            assert isinstance(standby.warm_up(lambda checkpoint: time.sleep(1.0)), float)
            assert StandbyLog(store).get("s-outage").status == StandbyStatus.WAITING

            standby.store.latest_run = _down_for(15, waiting, standby.store.latest_run)  # 3 s of polls
            verdict = standby.wait(_polls(35))
    finally:
        done.set()
    assert verdict.why == "SIGTERM", verdict
    assert store.current_epoch("orders") == run.epoch, "the run that heartbeats apart from the outage was taken over"
    assert store.get_run(run.run_id).status == "RUNNING"
    outages = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(outages) == 2, [r.getMessage() for r in outages]



def test_a_standby_whose_first_look_meets_an_outage_warms_up_all_the_same(store, database_url):
    """Its one look before warming up (whether it could ever take over) raised: the standby exited
    TRANSIENT.  The wait makes the same judgement at each poll, once the database answers."""
    standby = _standby(store, database_url, "s-first-look")
    standby.store.latest_run = _down_for(1, {"down": False}, standby.store.latest_run)
    assert standby.refusal() is None
    assert StandbyLog(store).get("s-first-look").status == StandbyStatus.WARMING


def _after_the_first_poll(then, polls: int = 25):
    """A wait's ``stop_signalled`` that runs ``then`` after the wait's first poll (before its next
    heartbeat, 2 s later) and signals after ``polls`` polls."""
    left = iter(range(polls))

    def stop_signalled() -> bool:
        poll = next(left, None)
        if poll == 1:
            then()
        return poll is None
    return stop_signalled


def test_a_standby_ended_between_its_heartbeats_takes_nothing_over(store, database_url):
    """A stop ends the job's standbys (``end_standbys``) and finds the run already DEAD: nothing to stop.  A
    standby learns of its end at its next heartbeat, but decides on takeovers at each poll in between: it
    took the epoch anyway, the job ran on after the stop and its ENDED row turned TOOK_OVER.  So did a
    successor whose upgrade was aborted right after it released it."""
    from airflow_stream_provider.takeover import Verdict

    log = StandbyLog(store)
    run = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(run.run_id)
    standby = _standby(store, database_url, "s-ended")

    def stopped_finding_the_run_dead():
        assert log.end_all("orders", "the job is being stopped") == ["s-ended"]
        store.mark_dead(run.run_id, "its driver process is gone")

    verdict = standby.wait(_after_the_first_poll(stopped_finding_the_run_dead))
    assert isinstance(verdict, Verdict) and "asked to end (the job is being stopped)" in verdict.why, verdict
    assert store.current_epoch("orders") == run.epoch and store.get_run("s-ended") is None
    assert log.get("s-ended").status == StandbyStatus.ENDED

    successor = _successor(store, database_url, "succ-aborted")
    _upgrade_holding(store, "succ-aborted")

    def released_then_aborted():
        assert log.release("succ-aborted", 1, None, run.epoch)
        assert log.end("succ-aborted", StandbyStatus.ENDED, "the upgrade was aborted")

    verdict = successor.wait(_after_the_first_poll(released_then_aborted))
    assert isinstance(verdict, Verdict) and "asked to end (the upgrade was aborted)" in verdict.why, verdict
    assert store.current_epoch("orders") == run.epoch and log.get("succ-aborted").status == StandbyStatus.ENDED


def test_a_standby_whose_launch_was_cancelled_takes_nothing_over(store, database_url):
    """A recover task that waited on a standby's takeover and gave it up (killed, or its wait over) cancels it
    as a launch (``killed.end_unregistered``): the fence, then the standby's row ended.  A standby whose
    takeover comes between the two is refused by the fence and ends, recorded, instead of failing on the
    error; one that polls after both reads its end."""
    import logging

    from airflow_stream_provider.lifecycle.killed import end_unregistered
    from airflow_stream_provider.takeover import Verdict

    log = StandbyLog(store)
    run = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(run.run_id)
    standby = _standby(store, database_url, "s-cancelled")

    def fenced_then_found_dead():
        assert store.cancel_launch("orders", "s-cancelled", "its recover task was killed")
        store.mark_dead(run.run_id, "its driver process is gone")

    verdict = standby.wait(_after_the_first_poll(fenced_then_found_dead))
    assert isinstance(verdict, Verdict) and "was cancelled before it registered" in verdict.why, verdict
    assert store.current_epoch("orders") == run.epoch and store.get_run("s-cancelled") is None
    assert log.get("s-cancelled").status == StandbyStatus.ENDED

    standby = _standby(store, database_url, "s-cancelled-2")
    assert end_unregistered(store, {"job_id": "orders", "run_id": "s-cancelled-2"}, "its recover task was killed",
                            logging.getLogger(__name__), kill_submission=lambda *_: pytest.fail("no cluster handle"))
    verdict = standby.wait(_after_the_first_poll(lambda: None))
    assert isinstance(verdict, Verdict) and "its launch was cancelled: its recover task was killed" in verdict.why
    assert store.get_run("s-cancelled-2") is None


def test_a_standby_ended_while_it_warms_up_stays_ended(store, database_url):
    """A stop ends the job's standbys while one warms up, after its warm-up's last heartbeat.  Its warm-up
    done, it recorded itself WAITING over its end: live again, it waited on, and could take the job over
    after the stop."""
    from airflow_stream_provider.takeover import Verdict

    log = StandbyLog(store)
    standby = _standby(store, database_url, "s-warming")

    def warm_up_query(checkpoint: str):  # the job's code runs for a while; the stop comes meanwhile
        time.sleep(0.5)
        assert log.end_all("orders", "the job is being stopped") == ["s-warming"]

    verdict = standby.warm_up(warm_up_query)
    assert isinstance(verdict, Verdict) and "asked to end (the job is being stopped)" in verdict.why, verdict
    assert log.get("s-warming").status == StandbyStatus.ENDED


def test_a_standby_still_warming_up_takes_over_a_run_that_died_without_waiting_out_its_warm_up(store, database_url):
    """It looked at the active run only once warm: with the job's code slow to warm up (up to two and a half
    minutes), a run that died meanwhile waited that long, while a recovery waits a minute for a live standby
    before it kills it and starts cold: the job was down longer than with no standby at all."""
    import threading

    from airflow_stream_provider.runtime.standby import Takeover

    run = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(run.run_id)
    store.mark_dead(run.run_id, "its driver process is gone")
    standby = _standby(store, database_url, "s-needed")
    slow = threading.Event()  # the job's code warming up: returns only when the test ends
    try:
        began = time.monotonic()
        assert isinstance(standby.warm_up(lambda checkpoint: slow.wait()), float)
        assert time.monotonic() - began < 5, "it went on while its warm-up still ran"
        took = standby.wait(_polls(25))
        assert isinstance(took, Takeover) and took.ticket.epoch > run.epoch, took
    finally:
        slow.set()


def test_a_standby_asked_to_end_during_an_outage_records_its_end_once_the_database_answers(
        store, database_url, monkeypatch):
    """SIGTERM while the state database does not answer: recording the end raised, the driver failed on it
    and left its row WAITING, found dead later.  The end is now tried again while the outage lasts a short
    while, and given up, with the driver still ending cleanly, when it does not."""
    from airflow_stream_provider.runtime import standby as standby_module

    run = store.begin_run("orders", 1, "1.0")
    store.mark_query_started(run.run_id)
    short = _standby(store, database_url, "s-end-short")
    assert isinstance(short.warm_up(lambda checkpoint: None), float)
    short.log.end = _down_for(5, {"down": False}, short.log.end)  # 1 s of polls
    assert short.wait(lambda: True).why == "SIGTERM"
    assert StandbyLog(store).get("s-end-short").status == StandbyStatus.ENDED

    monkeypatch.setattr(standby_module, "END_RECORD_S", 0.5)
    long = _standby(store, database_url, "s-end-long")
    assert isinstance(long.warm_up(lambda checkpoint: None), float)
    long.log.end = _down_for(1000, {"down": False}, long.log.end)
    assert long.wait(lambda: True).why == "SIGTERM", "the standby ends, unrecorded"
    assert StandbyLog(store).get("s-end-long").status == StandbyStatus.WAITING
