"""The example DAGs on a real Airflow: scheduler, triggerer, dag-processor and api-server as separate
processes (LocalExecutor, SQLite metadata), driven through the REST API as a person would, and repaired
by Airflow alone: the always-on watcher reports each death, ``stream_health`` runs on the asset event.

The test only kills and observes.  Each case ends with exact counts against Kafka and the result tables.
"""

from __future__ import annotations

import json
import random
import time

from sqlalchemy import text

from airflow_stream_provider.local_driver import process_alive
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from stack.deployment import StreamDeployment, epoch, kill_driver
from stack.events import EventProducer, Trickle
from stack.jobs import REPO, check_exactly_once, wait_until
from tests.dagtest.dagruns import FIXTURE_JOBS

#: Seconds within which a watched job must process again after a SIGKILL: the watcher's poll (1 s), the
#: scheduler, a task's start, the recover task and a driver's cold start on 2 shared cores.  Generous:
#: the figures are reported, the benchmark ``mttr_real_airflow`` measures them.
RECOVERY_TIMEOUT = 240


def _kill_and_wait(deployment: StreamDeployment, delay: float) -> dict:
    """SIGKILL the live driver ``delay`` seconds after it first processed; the new run once it processes,
    with the moment of the kill."""
    victim = deployment.processing()
    time.sleep(delay)
    killed_at = time.time()
    kill_driver(victim["pid"])
    recovered = deployment.processing(RECOVERY_TIMEOUT, other_than=victim["run_id"], after=killed_at)
    return {**recovered, "killed_at": killed_at}


def _recover_resumed_after_the_first_batch(deployment: StreamDeployment, recovered: dict) -> None:
    """``recover`` waits in the triggerer until the new run's first batch is over: resumed on a worker during
    it, its task process would take CPU from the driver's start."""
    (repair,) = deployment.repairs(recovered["run_id"], since=recovered["killed_at"])
    (recover,) = [ti for ti in deployment.airflow.task_instances("stream_health", repair["dag_run_id"])
                  if ti["task_id"] == "recover"]
    assert epoch(recover["end_date"]) > recovered["committed_at"], (recover, recovered)


def _upgrading(deployment: StreamDeployment, producer: EventProducer, job_file: str,
               **conf) -> tuple[RunRecord, str]:
    """Deploy the job, then trigger ``stream_upgrade`` to the fixture ``job_file`` as version 1.1: the run
    live before the upgrade, and the upgrade's DAG run."""
    producer.send(600)
    deployment.deploy(producer.produced)
    live = deployment.latest_run()
    run_id = deployment.airflow.trigger_dag("stream_upgrade", {
        "application": str(FIXTURE_JOBS / job_file), "version": "1.1", **conf})
    return live, run_id


def test_every_kill_is_repaired_by_airflow_alone_exactly_once(deployment, broker, topic, figures):
    producer = EventProducer(broker, topic, seed=5)
    producer.send(1500)
    deployment.deploy(producer.produced)
    rng = random.Random(8)
    with Trickle(producer, chunk=10, pause_s=0.5):
        # at random moments, and once right after a recovery (its first batch)
        recoveries = [_kill_and_wait(deployment, delay) for delay in (rng.uniform(0, 10), 0.0, rng.uniform(0, 10))]

        # The triggerer dies; the driver dies while nobody watches; the triggerer returns and reports it.
        victim = deployment.processing()
        deployment.airflow.kill_component("triggerer")
        killed_at = time.time()
        kill_driver(victim["pid"])
        time.sleep(8)
        restarted_at = time.time()
        deployment.airflow.start_component("triggerer")
        recovered = deployment.processing(RECOVERY_TIMEOUT, other_than=victim["run_id"], after=killed_at)
        triggerer_gap_s = recovered["committed_at"] - killed_at
        (repair,) = deployment.repairs(recovered["run_id"], since=killed_at)
        assert repair["run_type"] == "asset_triggered", repair
        assert epoch(repair["start_date"]) > restarted_at, "reported by the restarted triggerer, not before"

    producer.send(300)
    deployment.wait_caught_up(producer.produced)
    tasks = deployment.trigger("stream_stop")
    assert tasks["stop"][0] == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(deployment.store, deployment.job_id, producer.produced)
    for recovered in recoveries:
        _recover_resumed_after_the_first_batch(deployment, recovered)

    # Each death was one asset event and one stream_health run that restarted the job: no run for a
    # condition that merely persisted, none from the hourly sweep.
    repaired = [r for r in deployment.health_runs() if r["run_type"] == "asset_triggered"
                and deployment.tasks("stream_health", r["dag_run_id"]).get("recover", (None,))[0] == "success"]
    assert len(repaired) == 4, [(r["dag_run_id"], r["state"]) for r in deployment.health_runs()]
    restarts = [r for r in deployment.runs() if r.status == "DEAD"]
    assert len(restarts) == 4, [(r.run_id[:8], r.status) for r in deployment.runs()]
    seconds = [round(r["committed_at"] - r["killed_at"], 1) for r in recoveries]
    figures.record("real airflow kill -9 -> processing again", seconds=seconds,
                   triggerer_down_seconds=round(triggerer_gap_s, 1), **counts)


def test_an_incompatible_upgrade_through_the_api_resets_exactly_once(deployment, broker, topic, figures):
    producer = EventProducer(broker, topic, seed=6)
    producer.send(1500)
    deployment.deploy(producer.produced)
    with Trickle(producer, chunk=10, pause_s=1.0):
        run_id = deployment.airflow.trigger_dag(
            "stream_upgrade", {"application": str(REPO / "spark_jobs" / "events_job_v2.py"), "version": "2.0"})
        _a_stop_beside_the_upgrade_is_refused(deployment)
        state = deployment.airflow.wait_dag_run("stream_upgrade", run_id, 900)["state"]
    tasks = deployment.tasks("stream_upgrade", run_id)
    assert state == "success", deployment.explain("stream_upgrade", run_id)
    upgraded = tasks["upgrade"][1]
    assert upgraded["preflight"]["verdict"] == "incompatible", upgraded
    assert upgraded["generation"] == 2 and upgraded["archived_generation"] == 1, upgraded
    producer.send(500)
    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    counts = check_exactly_once(deployment.store, deployment.job_id, producer.produced)
    assert not [r for r in deployment.health_runs() if r["run_type"] == "asset_triggered"
                and r["state"] == "success"
                and deployment.tasks("stream_health", r["dag_run_id"]).get("recover", (None,))[0] == "success"], \
        "an upgrade is not a failure: the watcher must not have restarted anything"
    figures.record("real airflow incompatible upgrade", error_class=upgraded["preflight"]["error_class"], **counts)


def _a_stop_beside_the_upgrade_is_refused(deployment: StreamDeployment) -> None:
    """A person triggers ``stream_stop`` while the upgrade runs its preflight: the upgrade holds the job's
    lease, so the stop fails at once, names the upgrade, and stops nothing."""
    leases = LeaseLog(deployment.store)
    wait_until(lambda: (lease := leases.get(deployment.job_id)) is not None and lease.action == "upgrade"
               and any(r.dry_run for r in deployment.store.runs(deployment.job_id)), 300,
               "the upgrade to hold the job's lease and start its preflight")
    stop = deployment.trigger("stream_stop")
    assert stop["stop"][0] == "failed", stop
    log = deployment.airflow.task_log("stream_stop", stop["_run"][1], "stop")
    assert "(upgrade, for" in log and "Nothing was done" in log, log[-3000:]


def test_an_upgrade_marked_failed_while_deferred_leaves_nothing_behind(deployment, broker, topic):
    """A person marks the upgrade's task failed while it waits in the triggerer on its preflight (a new
    version whose batch hangs).  No worker runs the operator's ``on_kill``; the triggerer calls the trigger's:
    the dry run is killed, the prewarmed successor ends, and the job's lease is let go at once instead of
    minutes later, so the stop that follows is not refused.  The old version runs on throughout."""
    producer = EventProducer(broker, topic, seed=9)
    live, run_id = _upgrading(deployment, producer, "stuck_on_batch.py", prewarm=True)
    leases, standbys = LeaseLog(deployment.store), StandbyLog(deployment.store)

    def upgrade_task() -> dict:
        return next(ti for ti in deployment.airflow.task_instances("stream_upgrade", run_id)
                    if ti["task_id"] == "upgrade")

    def dry_runs() -> list:
        return [r for r in deployment.store.runs(deployment.job_id) if r.dry_run]

    wait_until(lambda: upgrade_task()["state"] == "deferred" and any(r.active for r in dry_runs())
               and standbys.live(deployment.job_id, SUCCESSOR), 300,
               "the upgrade to wait in the triggerer on its preflight, its successor warming")
    (successor,) = standbys.live(deployment.job_id, SUCCESSOR)
    assert leases.get(deployment.job_id).action == "upgrade"
    deployment.airflow.set_task_state("stream_upgrade", run_id, "upgrade", "failed")

    wait_until(lambda: leases.get(deployment.job_id) is None, 60, "the killed upgrade's lease to be let go")
    wait_until(lambda: not any(r.active for r in dry_runs()), 60, "the preflight's dry run to end")
    (dry,) = dry_runs()
    assert dry.status == "DEAD" and "killed while deferred" in dry.termination_message, dry
    ended = standbys.get(successor.standby_id)
    assert ended.status == StandbyStatus.ENDED and "killed while deferred" in ended.message, ended
    # ended while it warms up on the new code (whose batch hangs there too): its driver exits all the same
    wait_until(lambda: not process_alive(successor.pid), 60, "the ended successor's driver to exit")
    assert deployment.store.get_run(live.run_id).status == "RUNNING"

    producer.send(300)
    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)


def test_an_upgrade_killed_after_it_stopped_the_job_leaves_the_old_code_restarted(deployment, broker, topic):
    """A person marks the upgrade failed while it waits in the triggerer for the new version's query to start
    (a start that hangs once registered), after it stopped the old run.  The trigger's ``on_kill`` kills the
    new driver (its run recorded DEAD) and ends the upgrade's record as ``killed``; the watcher reports the
    dead run, and ``stream_health`` restarts the job with the code that ran before.  Before, the record
    stayed in STARTING for half an hour, every recovery stood aside, and the job stayed down."""
    producer = EventProducer(broker, topic, seed=13)
    old, run_id = _upgrading(deployment, producer, "hangs_on_start.py")
    upgrades = UpgradeLog(deployment.store)

    def new_version_hanging() -> RunRecord | None:
        found = upgrades.latest(deployment.job_id)
        task = next(ti for ti in deployment.airflow.task_instances("stream_upgrade", run_id)
                    if ti["task_id"] == "upgrade")
        new = next((r for r in deployment.runs() if r.version == "1.1"), None)
        # deferred, and its trigger taken up by the triggerer: a task marked failed before that has no trigger
        # to undo what it left (see the README's known limits)
        waiting = (found is not None and found.phase == UpgradePhase.STARTING and task["state"] == "deferred"
                   and (task.get("trigger") or {}).get("triggerer_id") is not None)
        return new if waiting and new is not None and new.status == "STARTING" else None

    new = wait_until(new_version_hanging, 300, "the upgrade to wait in the triggerer on the new version's start",
                     interval=1)
    assert deployment.store.get_run(old.run_id).status == "STOPPED"
    killed_at = time.time()
    deployment.airflow.set_task_state("stream_upgrade", run_id, "upgrade", "failed")

    wait_until(lambda: upgrades.latest(deployment.job_id).phase == UpgradePhase.DONE, 60,
               "the killed upgrade's record to end")
    assert upgrades.latest(deployment.job_id).result == "killed"
    wait_until(lambda: not process_alive(new.pid), 60, "the new version's driver to be killed")
    killed = deployment.store.get_run(new.run_id)
    assert killed.status == "DEAD" and "killed while deferred" in killed.termination_message, killed
    producer.send(300)  # for the restarted run to commit
    restarted = deployment.processing(RECOVERY_TIMEOUT, other_than=old.run_id, after=killed_at)
    # its stream_health run may have begun before the kill (a recover waiting for the upgrade's lease)
    (repair,) = deployment.repairs(restarted["run_id"])
    restarted = deployment.store.get_run(restarted["run_id"])  # its launch is recorded once recover ends
    assert (restarted.version, restarted.application) == (old.version, old.application), restarted
    found = deployment.tasks("stream_health", repair["dag_run_id"])["recover"][1]["diagnosis"]
    assert (found["run_id"], found["health"]) == (new.run_id, "DEAD"), found
    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)


def test_a_recovery_waits_for_the_task_holding_the_lease_then_repairs_what_it_left(deployment, broker, topic):
    """The driver dies (SIGKILL) while an upgrade waits in the triggerer on its preflight, holding the job's
    lease.  The watcher reports the death once; ``stream_health``'s ``recover`` finds another task acting
    on the job and waits for it in the triggerer, looking again every 10 s, instead of returning with
    nothing done.  A person marks the upgrade failed; its lease is let go, and the waiting ``recover``
    restarts the job from its checkpoint: no record lost or applied twice."""
    producer = EventProducer(broker, topic, seed=11)
    victim, upgrade_run = _upgrading(deployment, producer, "stuck_on_batch.py")
    leases = LeaseLog(deployment.store)

    def task(dag_id: str, run_id: str, task_id: str) -> dict | None:
        return next((ti for ti in deployment.airflow.task_instances(dag_id, run_id) if ti["task_id"] == task_id),
                    None)

    wait_until(lambda: task("stream_upgrade", upgrade_run, "upgrade")["state"] == "deferred"
               and any(r.active for r in deployment.store.runs(deployment.job_id) if r.dry_run), 300,
               "the upgrade to wait in the triggerer on its preflight", interval=1)
    assert leases.get(deployment.job_id).action == "upgrade"
    killed_at = time.time()
    kill_driver(victim.pid)

    def recover_waiting() -> dict | None:
        for run in deployment.health_runs(since=killed_at):
            recover = task("stream_health", run["dag_run_id"], "recover")
            if recover and recover["state"] == "deferred":
                return run
        return None

    waiting = wait_until(recover_waiting, 120, "stream_health's recover to wait for the upgrade's lease",
                         interval=1)
    # It looks again every 10 s: a second look, on a worker, finds the upgrade still acting and waits on.  Read
    # from its log, not slept for: the trigger's 10 s, then the scheduler and a worker, take longer when loaded.
    wait_until(lambda: deployment.airflow.task_log("stream_health", waiting["dag_run_id"], "recover")
               .count("Not recovering yet") >= 2, 120, "recover to look again and wait on", interval=1)
    assert deployment.latest_run().run_id == victim.run_id, "nothing started beside the upgrade"
    assert task("stream_health", waiting["dag_run_id"], "recover")["state"] in (
        "deferred", "scheduled", "queued", "running"), "between two looks, it may be on a worker"
    deployment.airflow.set_task_state("stream_upgrade", upgrade_run, "upgrade", "failed")

    producer.send(300)  # for the restarted run to commit
    recovered = deployment.processing(RECOVERY_TIMEOUT, other_than=victim.run_id, after=killed_at)
    (repair,) = deployment.repairs(recovered["run_id"], since=killed_at)
    assert repair["dag_run_id"] == waiting["dag_run_id"] and repair["run_type"] == "asset_triggered", repair
    log = deployment.airflow.task_log("stream_health", repair["dag_run_id"], "recover")
    assert log.count("Not recovering yet") >= 2 and "upgrade" in log, log[-3000:]  # looked again, waited on
    deployment.wait_caught_up(producer.produced)
    assert deployment.trigger("stream_stop")["stop"][0] == "success"
    check_exactly_once(deployment.store, deployment.job_id, producer.produced)


def test_a_crash_loop_ends_in_the_budgets_clear_failure(deployment, broker, topic):
    producer = EventProducer(broker, topic, seed=7)
    producer.send(200)
    deployment.airflow.set_variable("stream_job_application", str(FIXTURE_JOBS / "crash_on_batch.py"))
    tasks = deployment.trigger("stream_deploy")
    assert tasks["_run"][0] == "success", tasks

    # Every restart fails again (USER_CODE); the watcher reports each new failure, stream_health restarts
    # within the budget (3 per 30 minutes) and then fails saying so.
    deadline = time.monotonic() + 600
    while not (failed := deployment.failed_health_runs("recover")) and time.monotonic() < deadline:
        time.sleep(3)
    assert failed, [(r["dag_run_id"], r["state"]) for r in deployment.health_runs()]
    log = deployment.airflow.task_log("stream_health", failed[0]["dag_run_id"], "recover")
    assert "is out of its restart budget: 3 restarts in the last 30 min whose run neither committed a batch " \
           "nor ran 600 s (max 3)" in log, log[-3000:]
    assert "FAILED/USER_CODE" in log and "FOREACH_BATCH_USER_FUNCTION_ERROR" in log, log[-3000:]

    time.sleep(10)  # the persisting failure makes no further event and no further restart
    runs = deployment.runs()
    assert [r.failure_kind for r in runs] == ["USER_CODE"] * 4, [(r.status, r.failure_kind) for r in runs]
    assert "simulated bug in the job's results function" in runs[-1].termination_message
    with deployment.store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM stream_batches")).scalar() == 0
    assert deployment.store.stored_offsets(deployment.job_id) == {}, "a failed batch applies nothing"


def test_a_poison_record_makes_stream_health_fail_with_its_position(deployment, broker, topic):
    """The job's policy is ``on_poison='fail'``: its driver stops as POISON, naming the record.  The watcher's
    event runs ``stream_health``, whose ``diagnose`` branches to ``needs_a_decision``: it fails with the
    record's position and what to do, with the diagnosis as ``diagnose``'s XCom, and nothing restarts the
    job."""
    producer = EventProducer(broker, topic, seed=9)
    producer.send(200)
    deployment.airflow.set_variable("stream_job_application", str(FIXTURE_JOBS / "poison_on_value.py"))
    deployment.airflow.set_variable("stream_driver_env", {**deployment.variables["stream_driver_env"],
                                                          "POISON_POLICY": "fail"})
    deployment.deploy(producer.produced)
    event = {"event_id": "p-1", "user_id": "u-1", "kind": "POISON-1", "amount": 1.0, "ts": "2026-11-22T10:00:00Z"}
    partition, offset = producer.send_record(json.dumps(event).encode(), b"u-1")
    position = f"{topic}/{partition}:{offset}"

    (run,) = wait_until(lambda: deployment.failed_health_runs("needs_a_decision"), RECOVERY_TIMEOUT,
                        "a stream_health run that needs a decision", interval=2.0)
    tasks = deployment.tasks("stream_health", run["dag_run_id"])
    assert {task: state for task, (state, _) in tasks.items()} == {
        "diagnose": "success", "healthy": "skipped", "recover": "skipped", "reset": "skipped",
        "needs_a_decision": "failed"}, tasks
    found = deployment.airflow.xcom("stream_health", run["dag_run_id"], "diagnose", key="diagnosis")
    assert (found["health"], found["failure_kind"]) == ("FAILED", "POISON"), found
    log = deployment.airflow.task_log("stream_health", run["dag_run_id"], "needs_a_decision", 1)
    assert "FAILED/POISON" in log and position in log and "What to do:" in log, log[-3000:]

    time.sleep(5)  # the persisting failure makes no further event and no restart
    assert [(r.status, r.failure_kind) for r in deployment.runs()] == [("FAILED", "POISON")]
    # (a run before the deploy fails in diagnose: the watcher reported the job unknown until then)
    diagnosed = [r for r in deployment.health_runs()
                 if deployment.tasks("stream_health", r["dag_run_id"])["diagnose"][0] == "success"]
    assert [r["dag_run_id"] for r in diagnosed] == [run["dag_run_id"]], diagnosed
    assert deployment.store.stored_offsets(deployment.job_id).get((topic, partition), 0) <= offset
