"""An upgrade whose task a person kills (marked failed while it waits in the triggerer, or on its worker):
its record ends, so that recoveries act on the job again at once instead of half an hour later, and a job
the upgrade had already stopped is restarted with the code that ran before, by the next recovery.

The trigger's ``undo`` is called as the triggerer calls it; the state is that of a real upgrade in each
phase, on both databases."""

from __future__ import annotations

import logging
import re
import time

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_stream_provider import recovery
from airflow_stream_provider.budget import RestartBudget
from airflow_stream_provider.diagnosis import diagnose
from airflow_stream_provider.lifecycle import health
from airflow_stream_provider.lifecycle.killed import KilledTask, undo
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from airflow_stream_provider.recovery import RecoveryAction, with_interrupted_restart
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.store import LaunchCancelled
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from tests.integration.task_state import TaskStateStore

OWNER = "stream_upgrade/manual__1/upgrade/-1"
log = logging.getLogger(__name__)


def _upgrade(store, phase: UpgradePhase, *, old_stopped: bool, leased: bool = True) -> tuple[str, str]:
    old = store.begin_run("job", 1, "1.0").run_id
    store.mark_query_started(old)
    if old_stopped:
        store.request_stop(old)
        store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    upgrades = UpgradeLog(store)
    detail = {"task": OWNER, "live_run_id": old, "generation": 1}
    upgrade_id = upgrades.begin("job", "1.0", "2.0", detail)
    upgrades.move(upgrade_id, phase, detail)
    if leased:
        LeaseLog(store).take("job", OWNER, "upgrade", time.time() + 300)
    return upgrade_id, old


def _decision(store):
    found = diagnose("job", store.latest_run("job"), driver_alive=None, lag=None)
    found = with_interrupted_restart(found, store.latest_restart("job"))
    return recovery.decide_recovery(found, on_incompatible="reset", budget=RestartBudget(),
                                    history=store.restarts_since("job", 0), now=time.time(),
                                    upgrade=UpgradeLog(store).latest("job"))


@pytest.mark.parametrize("phase", [UpgradePhase.STOPPING, UpgradePhase.STARTING, UpgradePhase.ROLLING_BACK])
def test_an_upgrade_killed_after_it_stopped_the_job_ends_and_the_old_code_is_restarted(state_store, phase):
    upgrade_id, old = _upgrade(state_store, phase, old_stopped=True)
    assert _decision(state_store).action == RecoveryAction.NONE  # the job is STOPPED and the upgrade acts

    undo(state_store, KilledTask("job", lease_owner=OWNER, upgrade=True), "marked failed while deferred", log)

    record = UpgradeLog(state_store).get(upgrade_id)
    assert (record.phase, record.result) == (UpgradePhase.DONE, "killed"), record
    assert record.detail["killed"] == "marked failed while deferred"
    assert LeaseLog(state_store).get("job") is None
    decision = _decision(state_store)
    assert decision.action == RecoveryAction.RESTART, decision
    assert f"killed in phase {phase.value}" in decision.reason and "back to version 1.0" in decision.reason
    [restart] = state_store.restarts_since("job", 0)
    assert (restart["failed_run_id"], restart["new_run_id"]) == (old, None)


def test_an_upgrade_killed_while_the_old_run_finishes_its_stop_leaves_it_owed_a_restart(state_store):
    """Killed while it waited for the old run's graceful stop: the run then honoured the upgrade's marker
    and ended STOPPED, stop requested, which a recovery leaves alone as a stop someone wanted.  Nothing
    restarted the job, and nothing said so."""
    upgrade_id, old = _upgrade(state_store, UpgradePhase.STOPPING, old_stopped=False)
    state_store.request_stop(old)  # the upgrade's stop marker; the run finishes its batch

    undo(state_store, KilledTask("job", lease_owner=OWNER, upgrade=True), "marked failed while deferred", log)
    assert _decision(state_store).action == RecoveryAction.NONE, "the old run still runs: nothing to do yet"
    state_store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")

    assert UpgradeLog(state_store).get(upgrade_id).result == "killed"
    decision = _decision(state_store)
    assert (decision.action, decision.restart_run_id) == (RecoveryAction.RESTART, old), decision


@pytest.mark.parametrize("phase", [UpgradePhase.PREFLIGHT, UpgradePhase.VERIFYING])
def test_an_upgrade_killed_while_a_version_runs_ends_and_leaves_it_running(state_store, phase):
    """In its preflight the old version runs on; while it verifies, the new one runs: nothing to restart."""
    upgrade_id, _ = _upgrade(state_store, phase, old_stopped=False)

    undo(state_store, KilledTask("job", lease_owner=OWNER, upgrade=True), "marked failed while deferred", log)

    assert UpgradeLog(state_store).get(upgrade_id).result == "killed"
    assert state_store.restarts_since("job", 0) == []
    assert _decision(state_store).action == RecoveryAction.NONE


def test_a_finished_upgrade_is_left_as_it_ended(state_store):
    upgrade_id, _ = _upgrade(state_store, UpgradePhase.STARTING, old_stopped=True)
    UpgradeLog(state_store).move(upgrade_id, UpgradePhase.DONE, {}, result="upgraded")

    undo(state_store, KilledTask("job", lease_owner=OWNER, upgrade=True), "killed after it ended", log)

    assert UpgradeLog(state_store).get(upgrade_id).result == "upgraded"
    assert state_store.restarts_since("job", 0) == []


def test_the_retry_of_an_upgrade_killed_while_rolling_back_keeps_the_error_that_failed_it(state_store, tmp_path):
    """The retry rolls back again; the error it ends with is what failed the new version, not the kill
    (before, the record and the task's error said only "interrupted in phase ROLLING_BACK")."""
    from airflow_stream_provider.operators.upgrade import UPGRADE_KEY

    upgrade_id, _ = _upgrade(state_store, UpgradePhase.ROLLING_BACK, old_stopped=True)
    failed = "job job run r2 did not start: FAILED (USER_CODE): ZeroDivisionError in the new version's parse"
    ctx = {"live_run_id": None, "generation": 1, "outcome": {}, "previous": None, "phase": "ROLLING_BACK",
           "upgrade_id": upgrade_id, "error": failed}
    UpgradeLog(state_store).move(upgrade_id, UpgradePhase.ROLLING_BACK, ctx)
    LeaseLog(state_store).release("job", OWNER)
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    retry = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py")

    with pytest.raises(AirflowFailException, match="ZeroDivisionError in the new version's parse"):
        retry.execute({"task_state_store": TaskStateStore({UPGRADE_KEY: upgrade_id})})
    ended = UpgradeLog(state_store).get(upgrade_id)
    assert ended.phase == UpgradePhase.DONE and "ZeroDivisionError" in ended.detail["error"]


def test_an_upgrade_whose_task_failed_past_its_stop_is_ended_by_a_recovery_that_restarts_the_old_run(
        state_store, tmp_path, monkeypatch):
    """The upgrade's task failed on its last try after it stopped the job and launched the new version,
    which failed at its start (the task's own error: an outage past what it rides out, its lease lost).
    It let go of the lease, so no takeover undoes it, and its record stays in STARTING.  Once Airflow says
    that task has ended, the diagnosis owes the job a restart; the recovery ends the upgrade (``killed``)
    and restarts the run the upgrade stopped, not the new version's failed one.  Airflow's answer about the
    task stands in (``health.task_ended``): this tier runs no Airflow.  The recovery's crash-loop backoff
    defers it before its launch, which is where this test looks."""
    upgrade_id, old = _upgrade(state_store, UpgradePhase.STARTING, old_stopped=True, leased=False)
    new = state_store.begin_run("job", 1, "2.0").run_id
    state_store.finish_run(new, status="FAILED", exit_code=1, failure_kind="USER_CODE",
                           message="ValueError: the new version's start failed")
    asked = []
    monkeypatch.setattr(health, "task_ended", lambda owner, log: asked.append(owner) or True)
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}

    with pytest.raises(TaskDeferred) as deferred:
        RecoverStreamingJobOperator(task_id="recover", spec=spec).execute({})

    assert asked == [OWNER]
    record = UpgradeLog(state_store).get(upgrade_id)
    assert (record.phase, record.result) == (UpgradePhase.DONE, "killed"), record
    assert record.detail["killed"] == f"its task {OWNER} ended in Airflow in phase STARTING without finishing it"
    resume = deferred.value.trigger.resume
    assert (resume["method"], resume["state"]["action"], resume["state"]["run_id"]) == ("_act", "restart", old)
    [restart] = state_store.restarts_since("job", 0)
    assert (restart["failed_run_id"], restart["new_run_id"]) == (old, None)


def test_a_person_s_stop_supersedes_an_upgrade_left_after_its_stop_and_its_retry_does_nothing(state_store, tmp_path):
    """An upgrade's task failed after it stopped the job and lets go of the lease (a retry to come, or none);
    then a person stops the job.  The stop ends the upgrade (``stopped``): no restart is owed, so nothing
    undoes the stop, and the task's retry fails saying why instead of rolling back to the old code, which
    would start the job again."""
    from airflow_stream_provider.operators.stop import StopStreamingJobOperator
    from airflow_stream_provider.operators.upgrade import UPGRADE_KEY

    upgrade_id, old = _upgrade(state_store, UpgradePhase.STOPPING, old_stopped=True, leased=False)
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}

    stopped = StopStreamingJobOperator(task_id="stop", spec=spec).execute({})

    assert stopped["outcome"] == "not running"
    record = UpgradeLog(state_store).get(upgrade_id)
    assert (record.phase, record.result, record.detail["stopped_in"]) == (UpgradePhase.DONE, "stopped", "STOPPING")
    assert UpgradeLog(state_store).leaving_down() == {} and state_store.restarts_since("job", 0) == []
    assert _decision(state_store).action == RecoveryAction.NONE, "the job stays stopped"

    retry = UpgradeStreamingJobOperator(task_id="upgrade", spec={**spec, "version": "2.0"}, application="/jobs/v2.py")
    task_state = TaskStateStore({UPGRADE_KEY: upgrade_id})
    with pytest.raises(AirflowFailException, match=r"was ended in phase STOPPING: the job was stopped by task "):
        retry.execute({"task_state_store": task_state})
    assert state_store.latest_run("job").run_id == old, "the retry launched nothing"
    assert task_state.get(UPGRADE_KEY) is None


def _operator(tmp_path, version: str = "3.0") -> UpgradeStreamingJobOperator:
    spec = {"job_id": "job", "version": version, "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    return UpgradeStreamingJobOperator(task_id="upgrade_b", spec=spec, application=f"/jobs/v{version}.py")


def test_a_new_upgrade_is_refused_while_another_is_between_its_tries(state_store, tmp_path):
    """Upgrade A stopped the job and failed its try, its retry to come: it holds no lease then.  An upgrade B
    went on past the stop, and A's retry, finding B's version running, rolled it back."""
    first, _ = _upgrade(state_store, UpgradePhase.STARTING, old_stopped=True, leased=False)

    with pytest.raises(AirflowFailException, match=f"upgrade {first} to version 2.0 is in phase STARTING"):
        _operator(tmp_path).execute({"task_state_store": TaskStateStore()})
    assert UpgradeLog(state_store).latest("job").upgrade_id == first, "nothing begun"


class _AskedTaskInstance:
    """This task's instance as an operator asks it about another task: Airflow's answer stands in (this tier
    runs no Airflow)."""

    dag_id, run_id, task_id, map_index = "stream_upgrade", "manual__2", "upgrade_b", -1

    def __init__(self, state: str):
        self.state = state

    def get_task_states(self, *, dag_id, task_ids, run_ids, map_index):
        return {run_id: {task_id: self.state for task_id in task_ids} for run_id in run_ids}


def test_an_upgrade_whose_task_ended_for_good_is_ended_by_the_next_upgrade(state_store, tmp_path):
    """Its task failed past the stop on its last try, through an error that escaped its flow: refused "until
    the upgrade's task has ended", every new upgrade waited half an hour for the record to go stale."""
    first, old = _upgrade(state_store, UpgradePhase.STARTING, old_stopped=True, leased=False)
    with pytest.raises(AirflowFailException, match="is in phase STARTING"):  # its retry may come: refused
        _operator(tmp_path).execute({"task_state_store": TaskStateStore(), "ti": _AskedTaskInstance("up_for_retry")})

    with pytest.raises(Exception) as raised:  # past the refusal, on to its preflight and this tier's broker
        _operator(tmp_path).execute({"task_state_store": TaskStateStore(), "ti": _AskedTaskInstance("failed")})
    assert "is in phase STARTING" not in str(raised.value), raised.value
    ended = UpgradeLog(state_store).get(first)
    assert (ended.phase, ended.result) == (UpgradePhase.DONE, "killed"), ended
    assert [r["failed_run_id"] for r in state_store.restarts_since("job", 0)] == [old], "owed the restart"


def test_the_retry_of_an_upgrade_another_one_superseded_does_nothing(state_store, tmp_path):
    """Left stale (its record older than ``UPGRADE_STALE_S``), upgrade A no longer kept others away; B began."""
    from airflow_stream_provider.operators.upgrade import UPGRADE_KEY

    first, _ = _upgrade(state_store, UpgradePhase.STARTING, old_stopped=True, leased=False)
    second = UpgradeLog(state_store).begin("job", "1.0", "3.0", {"task": "stream_upgrade/manual__2/upgrade/-1"})

    with pytest.raises(AirflowFailException, match=f"was superseded by upgrade {second} to version 3.0"):
        _operator(tmp_path, "2.0").execute({"task_state_store": TaskStateStore({UPGRADE_KEY: first})})
    assert UpgradeLog(state_store).get(first).result == "superseded"
    assert UpgradeLog(state_store).get(second).phase == UpgradePhase.PREFLIGHT, "left alone"


def test_the_retry_of_an_upgrade_to_the_same_version_does_not_verify_the_old_run(state_store, tmp_path):
    """The job file changed, the version label did not.  The try failed while the old run finished its stop;
    the retry took the old run, alive and of the same version, for the new one, verified it on its last
    batch and reported the job upgraded: the new code never ran, and the job went down once the stop ended."""
    from airflow_stream_provider.operators.upgrade import UPGRADE_KEY

    old = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(old)
    state_store.record_progress(old, 7, None, committed=True)
    state_store.request_stop(old)
    upgrades = UpgradeLog(state_store)
    ctx = {"task": OWNER, "live_run_id": old, "generation": 1, "previous": None, "outcome": {"job_id": "job"},
           "phase": "STOPPING"}
    upgrade_id = ctx["upgrade_id"] = upgrades.begin("job", "1.0", "1.0", ctx)
    upgrades.move(upgrade_id, UpgradePhase.STOPPING, ctx)

    with pytest.raises(AirflowFailException, match="No rollback"):
        _operator(tmp_path, "1.0").execute({"task_state_store": TaskStateStore({UPGRADE_KEY: upgrade_id})})
    ended = UpgradeLog(state_store).get(upgrade_id)
    assert ended.result != "upgraded" and "interrupted in phase STOPPING" in ended.detail["error"], ended


def test_the_upgrades_allow_data_loss_is_a_templated_flag(state_store, tmp_path):
    """As the reset's: a DAG passing "{{ params.allow_data_loss }}" rendered "False", a non-empty string the
    upgrade took for yes, accepting lost offsets nobody chose to (invariant 5)."""
    operator = _operator(tmp_path)
    assert "allow_data_loss" in operator.template_fields
    operator.allow_data_loss = "False"
    assert operator.accepts_data_loss is False
    operator.allow_data_loss = "sure"
    with pytest.raises(AirflowFailException, match="allow_data_loss='sure': expected true or false"):
        operator.execute({"task_state_store": TaskStateStore()})
    assert UpgradeLog(state_store).latest("job") is None, "nothing begun"


def test_an_upgrades_timeouts_are_checked_before_it_begins(state_store, tmp_path):
    """A verify timeout that is no number failed the task after the old run's stop, its record left in
    VERIFYING, keeping every recovery away for half an hour."""
    for name, value in [("verify_timeout", "soon"), ("preflight_timeout", 0), ("ready_timeout", "5m"),
                        ("stop_timeout", -5), ("kill_grace", float("nan"))]:
        operator = _operator(tmp_path)
        setattr(operator, name, value)
        with pytest.raises(AirflowFailException, match=f"{name}={value!r}: give a number of seconds above 0"):
            operator.execute({"task_state_store": TaskStateStore()})
        assert UpgradeLog(state_store).latest("job") is None, "nothing begun"


def test_a_spark_conf_spark_submit_cannot_take_fails_before_anything_begins(state_store, tmp_path):
    """A nested value reached spark-submit as its Python repr, and a conf rendered to text failed inside the
    submit, after the old run's stop."""
    for conf, named in [({"spark.driver.memory": {"size": "1g"}}, "'spark.driver.memory': {'size': '1g'}"),
                        ("{'spark.driver.memory': '1g'}", "conf is a str, not a mapping"),
                        ({"": "x"}, "'': 'x'")]:
        operator = _operator(tmp_path)
        operator.conf = conf
        with pytest.raises(AirflowFailException, match=re.escape(named)):
            operator.execute({"task_state_store": TaskStateStore()})
        assert UpgradeLog(state_store).latest("job") is None, "nothing begun"


def test_an_upgrade_stops_and_owes_the_run_live_at_its_stop_not_the_one_live_at_its_start(state_store, tmp_path):
    """A standby took over while the preflight ran: the upgrade stopped the run live then, but its record still
    named the run of its start, so a kill of its task owed the restart to a run that was no longer the
    job's latest, which a recovery does not finish: the job stayed down."""
    from airflow_stream_provider.upgrade import Preflight, Verdict

    first = state_store.begin_run("job", 1, "1.0").run_id
    state_store.mark_query_started(first)
    ctx = {"task": OWNER, "live_run_id": first, "generation": 1, "policy": "after_preflight", "previous": None,
           "outcome": {"job_id": "job"}}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)
    took_over = state_store.begin_run("job", 1, "1.0").run_id  # the standby's takeover: the next epoch
    state_store.mark_query_started(took_over)
    state_store.finish_run(first, status="FAILED", exit_code=5, failure_kind="CONCURRENT", error_class=None,
                           message="fenced")

    with pytest.raises(TaskDeferred):  # the stop's wait
        _operator(tmp_path, "2.0")._decide({}, ctx, Preflight(Verdict.SKIPPED, "no checkpoint yet"))
    assert UpgradeLog(state_store).get(ctx["upgrade_id"]).detail["live_run_id"] == took_over
    assert state_store.get_run(took_over).stop_requested_at is not None


def test_a_prewarmed_upgrade_whose_reset_fails_rolls_back_and_ends_its_successor(state_store, tmp_path,
                                                                                  monkeypatch):
    """The cold path's reset hands a failure after the stop to the rollback; the prewarmed path's escaped it:
    the task failed with the old run stopped and the record left in STARTING, and the warm successor, taken
    out of the flow's state already, waited on for half an hour."""
    import socket

    from airflow_stream_provider.lifecycle.controller import StreamJobController, StreamJobError
    from airflow_stream_provider.state.standbys import SUCCESSOR, StandbyLog, StandbyStatus

    def unreachable(self, job, reason, allow_data_loss):
        raise StreamJobError("Kafka at the job's brokers is unreachable: NoBrokersAvailable")

    monkeypatch.setattr(StreamJobController, "before_reset", unreachable)
    old = state_store.begin_run("job", 1, "1.0").run_id
    state_store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    StandbyLog(state_store).register("successor-1", "job", "2.0", 1, host=socket.gethostname(), pid=4242,
                                     log_path=None, role=SUCCESSOR)
    ctx = {"task": OWNER, "live_run_id": old, "generation": 1, "previous": None, "outcome": {},
           "successor": {"standby_id": "successor-1"},
           "decision": {"action": "reset", "why": "incompatible", "reset_on_start_failure": False}}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)

    with pytest.raises(AirflowFailException, match="NoBrokersAvailable"):
        _operator(tmp_path, "2.0")._old_stopped({}, {"run_id": old, "outcome": "stopped"}, ctx)
    assert UpgradeLog(state_store).get(ctx["upgrade_id"]).phase == UpgradePhase.DONE
    assert StandbyLog(state_store).get("successor-1").status == StandbyStatus.ENDED


def test_a_killed_tasks_cluster_mode_driver_not_registered_yet_is_killed_through_its_cluster_manager(
        state_store, monkeypatch, caplog):
    """A cluster-mode launch has no pid here: its kill did nothing and said nothing, and a driver queued by
    YARN registered later, with a newer epoch than the run the next task started.  The cluster manager's
    client stands in (no YARN or Kubernetes runs here): what is checked is that the handle, and the Spark
    connection the task used, reach it; ``kill_submission``'s own commands are ``test_cluster_launch.py``'s."""
    from airflow_stream_provider.hooks.driver import Kill, StreamDriverHook

    asked = []
    monkeypatch.setattr(StreamDriverHook, "kill_submission", lambda hook, job_id, handle: (
        asked.append((hook.spark_conn_id, hook.conf, hook.env_vars, job_id, handle)) or Kill(True, f"killed {handle}")))
    launch = {"run_id": "queued-run", "pid": None, "host": None, "submitted_at": time.time(),
              "submission_id": "application_1700000000000_0042", "spark_conn_id": "spark_yarn",
              "conf": {"spark.yarn.queue": "streams"}, "env_vars": {"HADOOP_CONF_DIR": "/etc/hadoop/prod"}}
    with caplog.at_level(logging.WARNING):
        undo(state_store, KilledTask("job", lease_owner=OWNER, launch=launch), "marked failed while deferred", log)
    assert asked == [("spark_yarn", {"spark.yarn.queue": "streams"}, {"HADOOP_CONF_DIR": "/etc/hadoop/prod"}, "job",
                      "application_1700000000000_0042")]
    assert "Killed run queued-run before it registered (submission application_1700000000000_0042)" in caplog.text

    monkeypatch.setattr(StreamDriverHook, "kill_submission", lambda hook, job_id, handle: Kill(False, "refused"))
    caplog.clear()
    undo(state_store, KilledTask("job", lease_owner=OWNER, launch=launch), "marked failed while deferred", log)
    assert "could not be killed before it registered" in caplog.text and "Its launch is cancelled: it exits as it " \
        "registers" in caplog.text
    with pytest.raises(LaunchCancelled):  # the queued driver, when YARN starts it, cannot take the job
        state_store.begin_run("job", 1, "1.0", run_id="queued-run")


def test_a_cluster_launch_hands_its_kill_the_tasks_conf_but_keeps_it_out_of_the_lease(state_store, tmp_path):
    """The kill of an unregistered cluster-mode driver ran without the task's conf and env_vars (a namespace,
    HADOOP_CONF_DIR), so it asked the wrong cluster.  They go with the trigger's kwargs, which Airflow
    encrypts, not into the lease's row in the state database: env_vars may hold secrets."""
    operator = _operator(tmp_path)
    operator.conf, operator.env_vars = {"spark.kubernetes.namespace": "streams"}, {"KUBECONFIG": "/etc/kube/prod"}
    operator._in_flight = {"run_id": "queued-run", "pid": None, "host": None, "submitted_at": time.time(),
                           "submission_id": "streams:stream-job-driver"}
    launch = operator.killed_task().launch
    assert launch["conf"] == {"spark.kubernetes.namespace": "streams"}
    assert launch["env_vars"] == {"KUBECONFIG": "/etc/kube/prod"}
    assert "conf" not in operator._launch_in_flight() and "env_vars" not in operator._launch_in_flight()

    operator._in_flight = {**operator._in_flight, "submission_id": None, "pid": 4242, "host": "here"}
    assert "conf" not in operator.killed_task().launch, "a local driver is killed by its pid"
