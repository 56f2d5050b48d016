"""A launch whose wait fails (the trigger's "error" event: the state database away past the deadline,
Kafka away while the first batch settles, a fault in the trigger) is judged on one look when the task
resumes, not taken for a failed launch.  Before, the task cleared the launch from its task state and took
its failure path, or failed: its retry, or the failure path itself, then started a second driver beside
one that may have been starting still.

The trigger's event is handed to the operator as Airflow hands it over; the run is a registered row, as a
driver on another host leaves it (the flow under test reads the row only, never the process)."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

from airflow_stream_provider.lifecycle.controller import StreamJobError
from airflow_stream_provider.operators.base import LAUNCH_KEY
from airflow_stream_provider.operators.stop import StopStreamingJobOperator
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from tests.integration.launches import launch_on_another_host, submit_operator
from tests.integration.task_state import TaskStateStore

ERROR = "waiting on run {}: OperationalError('the database is gone')"


def _submitted(store, tmp_path, topic) -> tuple[SubmitStreamingJobOperator, dict, dict, list]:
    """A submit operator whose driver was submitted and registered its run on another host; the task
    context holding the pending launch; what its failure path was handed."""
    operator = submit_operator(tmp_path, topic)
    launch = launch_on_another_host(store, operator)
    refused: list = []
    operator._refused = lambda context, error: refused.append(error) or "failure path"
    pending = {"launch": launch, "after": "_submitted", "carry": {}, "on_fail": "_refused"}
    context = {"task_state_store": TaskStateStore({LAUNCH_KEY: pending})}
    return operator, context, pending, refused


def _wait_failed(operator, context, pending):
    event = {"outcome": "error", "run_id": pending["launch"]["run_id"],
             "message": ERROR.format(pending["launch"]["run_id"]),
             "resume": {"method": "_launch_waited", "state": pending}}
    return operator.execute_complete(context, event)


def _try(try_number: int, max_tries: int, ended: bool = False) -> SimpleNamespace:
    """The task instance of a deploy's submit, on try ``try_number`` of ``max_tries``; ``ended``: Airflow
    says it has ended (failed), as the next task asks it."""
    state = "failed" if ended else "up_for_retry"
    return SimpleNamespace(dag_id="stream_deploy", run_id="manual__1", task_id="submit", map_index=-1,
                           try_number=try_number, max_tries=max_tries,
                           get_task_states=lambda **query: {"manual__1": {"submit": state}})


def test_a_launch_still_starting_is_kept_for_the_retry_which_waits_on_it(state_store, tmp_path, topic):
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, refused = _submitted(state_store, tmp_path, topic)
    operator.retry_delay = timedelta(seconds=600)
    context["ti"] = _try(1, 1)
    run_id = pending["launch"]["run_id"]

    with pytest.raises(StreamJobError, match="a retry of this task picks it up"):
        _wait_failed(operator, context, pending)

    assert refused == [], "the failure path ran for a launch nobody saw fail"
    assert context["task_state_store"].get(LAUNCH_KEY)["launch"]["run_id"] == run_id
    assert state_store.get_run(run_id).active
    # Before, the task let go of the lease as it failed: a recover or a person's submit could start a second
    # driver beside the one starting.  It keeps it, naming the launch, until its retry is due.
    held = LeaseLog(state_store).get("job")
    assert held.owner == "stream_deploy/manual__1/submit/-1" and held.launch["run_id"] == run_id
    assert held.until > time.time() + 600
    other = submit_operator(tmp_path, topic)
    with pytest.raises(AirflowFailException, match="stream_deploy/manual__1/submit/-1 .* acts on the job now"):
        other.execute({"task_state_store": TaskStateStore({}),
                       "ti": SimpleNamespace(dag_id="stream_deploy", run_id="manual__2", task_id="submit")})
    context["ti"] = _try(2, 1)

    retry = SubmitStreamingJobOperator(task_id="submit", spec=operator.spec, application="/jobs/v1.py")
    with pytest.raises(TaskDeferred) as deferred:
        retry.execute(context)
    assert deferred.value.trigger.wait.run_id == run_id, "the retry launched another driver"
    # killed while it waits, the retry ends the run it picked up, as the first try would have
    assert deferred.value.trigger.killed.launch["run_id"] == run_id
    assert [run.run_id for run in state_store.recent_runs("job", 10)] == [run_id]


def test_a_launch_still_starting_when_no_retry_is_left_is_ended_by_the_next_task(state_store, tmp_path, topic):
    """The last try fails with its launch undecided and ends holding the lease, which names the launch.  The
    next task to want the lease finds its holder ended in Airflow and ends the launch, whose query has not
    started (asked through its row: it runs on another host), before it acts itself."""
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    context["ti"] = _try(2, 1)
    run_id = pending["launch"]["run_id"]

    with pytest.raises(StreamJobError, match="a retry of this task picks it up"):
        _wait_failed(operator, context, pending)

    held = LeaseLog(state_store).get("job")
    assert held.owner == "stream_deploy/manual__1/submit/-1" and held.launch["run_id"] == run_id
    assert held.until < time.time() + 300, "no retry comes: the lease is kept no longer than its grace"

    ended = _try(2, 1, ended=True)
    stop = StopStreamingJobOperator(task_id="stop", spec=operator.spec)
    stop_ti = SimpleNamespace(dag_id="stream_stop", run_id="manual__1", task_id="stop", map_index=-1,
                              get_task_states=ended.get_task_states)
    with pytest.raises(TaskDeferred):  # the stop waits on the run it found live
        stop.execute({"task_state_store": TaskStateStore({}), "ti": stop_ti})

    assert state_store.get_run(run_id).stop_requested_at is not None, "the launch was left starting"
    assert LeaseLog(state_store).get("job").owner == "stream_stop/manual__1/stop/-1"


def test_a_launch_whose_query_runs_by_then_goes_on(state_store, tmp_path, topic):
    operator, context, pending, refused = _submitted(state_store, tmp_path, topic)
    run_id = pending["launch"]["run_id"]
    state_store.mark_query_started(run_id)

    result = _wait_failed(operator, context, pending)

    assert result["run_id"] == run_id and result["action"] == "submitted"
    assert refused == [] and context["task_state_store"].get(LAUNCH_KEY) is None


def test_a_launch_that_failed_by_then_takes_the_failure_path(state_store, tmp_path, topic):
    operator, context, pending, refused = _submitted(state_store, tmp_path, topic)
    run_id = pending["launch"]["run_id"]
    state_store.finish_run(run_id, status="FAILED", exit_code=1, failure_kind="TRANSIENT",
                           message="the brokers did not answer")

    assert _wait_failed(operator, context, pending) == "failure path"

    assert len(refused) == 1 and run_id in str(refused[0])
    assert context["task_state_store"].get(LAUNCH_KEY) is None


@pytest.mark.parametrize("query_runs", [False, True])
def test_a_task_that_lost_its_lease_while_it_waited_on_its_launch_ends_the_launch(state_store, tmp_path, topic,
                                                                                  query_runs):
    """The submit's lease ran out while it waited on its driver's start (a triggerer late by minutes), and a
    person's stop took it, acted and let go.  Resumed, the submit stops, and the driver it launched must not
    come up behind the stop: one still starting is asked to stop (through its row: it runs on another host).
    One whose query runs by then is the job's run, and is left to whoever acts on it."""
    from airflow_stream_provider.operators.base import LeaseLost
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    run_id = pending["launch"]["run_id"]
    if query_runs:
        state_store.mark_query_started(run_id)
    leases = LeaseLog(state_store)
    leases.take("job", "stream_stop/manual__1/stop/-1", "stop", time.time() + 300)
    leases.release("job", "stream_stop/manual__1/stop/-1")
    event = {"outcome": "ready", "run_id": run_id,
             "resume": {"method": "_launch_waited", "state": pending, "held_since": time.time() - 600}}

    with pytest.raises(LeaseLost, match="another task took it and let go of it since"):
        operator.execute_complete(context, event)

    assert (state_store.get_run(run_id).stop_requested_at is None) is query_runs
    assert leases.get("job") is None


def test_a_task_whose_lease_was_taken_during_its_launch_ends_the_driver_it_launched(state_store, tmp_path, topic):
    """A step ran past its lease (a submit slower than five minutes) and another task took the lease.  The
    task learns it when it extends the lease over its launch's wait: it stops without a retry, and the
    driver it launched is asked to stop before it comes up behind the other task."""
    from airflow_stream_provider.operators.base import LeaseLost
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    launch, leases = pending["launch"], LeaseLog(state_store)

    def launched_then_waits():
        leases.take("job", operator._lease_owner, "submit", time.time() - 1)  # ran out during the step
        assert leases.take("job", "stream_stop/manual__1/stop/-1", "stop", time.time() + 300) is None
        operator._in_flight = launch
        return operator.wait_then(context, operator._launch_wait(launch), "_launch_waited", **pending)

    with pytest.raises(LeaseLost, match="stream_stop/manual__1/stop/-1 .* took it; that task acts on the job now"):
        operator._leased(context, launched_then_waits)

    assert state_store.get_run(launch["run_id"]).stop_requested_at is not None
    assert leases.get("job").owner == "stream_stop/manual__1/stop/-1", "the other task's lease is left alone"


def test_a_recoverys_launch_is_kept_for_its_retry_with_the_restart_it_records(state_store, tmp_path, topic,
                                                                              monkeypatch):
    """The restart a recovery's launch records travels with the launch in the task state, which takes JSON
    values only.  It was a tuple, which Airflow's store refuses: the launch was not kept, and a retry could not
    pick it up.  The submit stands in for a driver's (what is under test is what the task keeps)."""
    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    context["task_state_store"].clear()
    monkeypatch.setattr(type(operator.controller), "submit", lambda self, *args, **kwargs: pending["launch"])

    with pytest.raises(TaskDeferred):
        operator.launch_then(context, "_submitted", {}, restart=("restart", "a test", "the-failed-run"))

    kept = context["task_state_store"].get(LAUNCH_KEY)
    assert kept["launch"] == pending["launch"] and kept["restart"] == ["restart", "a test", "the-failed-run"]
    (recorded,) = state_store.restarts_since("job", 0)
    assert (recorded["failed_run_id"], recorded["new_run_id"]) == ("the-failed-run", pending["launch"]["run_id"])


def _deferred_on_the_launch(state_store, tmp_path, topic) -> tuple[dict, dict, str]:
    """A task that deferred on its pending launch's wait (a retry picking the launch up), and its context."""
    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    # the task instance names the lease's holder: the same for the resumed task as for the deferred one
    context["ti"] = SimpleNamespace(dag_id="stream_deploy", run_id="manual__1", task_id="submit", map_index=-1)
    with pytest.raises(TaskDeferred):
        SubmitStreamingJobOperator(task_id="submit", spec=operator.spec, application="/jobs/v1.py").execute(context)
    return operator.spec, context, pending["launch"]["run_id"]


def _timed_out(spec, context):
    """Airflow resuming a deferral it timed out (a triggerer away past the wait's end and the margin): the
    task runner's call on a new operator, with no trigger event, only ``__fail__``."""
    from airflow.sdk.bases.operator import TRIGGER_FAIL_REPR, TriggerFailureReason

    resumed = SubmitStreamingJobOperator(task_id="submit", spec=spec, application="/jobs/v1.py")
    return resumed.resume_execution(TRIGGER_FAIL_REPR, {"error": TriggerFailureReason.TRIGGER_TIMEOUT.value},
                                    context)


def test_a_launch_wait_airflow_timed_out_goes_on_once_its_query_runs(state_store, tmp_path, topic):
    spec, context, run_id = _deferred_on_the_launch(state_store, tmp_path, topic)
    state_store.mark_query_started(run_id)

    result = _timed_out(spec, context)  # before, TaskDeferralTimeout: a failed deploy of a running job

    assert (result["run_id"], result["action"]) == (run_id, "submitted")
    assert context["task_state_store"].get(LAUNCH_KEY) is None


def test_a_launch_wait_airflow_timed_out_while_the_run_starts_keeps_it_for_the_retry(state_store, tmp_path, topic):
    spec, context, run_id = _deferred_on_the_launch(state_store, tmp_path, topic)

    with pytest.raises(StreamJobError, match="the triggerer did not answer .* a retry of this task picks it up"):
        _timed_out(spec, context)

    assert context["task_state_store"].get(LAUNCH_KEY)["launch"]["run_id"] == run_id
    assert [run.run_id for run in state_store.recent_runs("job", 10)] == [run_id]


def test_a_pause_airflow_timed_out_fails_as_airflow_fails_it(state_store, tmp_path, topic):
    """The step after a backoff acts on the job: a retry diagnoses afresh instead."""
    from airflow.sdk.exceptions import TaskDeferralTimeout

    spec, context, _ = _deferred_on_the_launch(state_store, tmp_path, topic)
    operator = SubmitStreamingJobOperator(task_id="submit", spec=spec, application="/jobs/v1.py")
    with pytest.raises(TaskDeferred):
        operator.pause_then(context, 30.0, "_submitted")

    with pytest.raises(TaskDeferralTimeout):
        _timed_out(spec, context)


@pytest.mark.parametrize("taken_between", [True, False], ids=["another-task-held-it", "nobody-held-it"])
def test_a_retry_picks_its_launch_up_only_under_the_hold_that_launched_it(state_store, tmp_path, topic,
                                                                          monkeypatch, taken_between):
    """The first try launched, its wait failed undecided, and it kept the lease for its retry.  The retry came
    late (a busy scheduler): the lease ran out, and a person's stop held it and let go meanwhile.  Picked up,
    the launch would come up behind that stop: the retry ends it (asked through its row: another host) and
    stops, letting go of the lease.  Where the lease ran out and nobody held it, the retry picks it up."""
    from airflow_stream_provider.operators.base import LeaseLost
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    context["task_state_store"].clear()
    operator.retry_delay = timedelta(seconds=60)
    context["ti"] = _try(1, 1)
    monkeypatch.setattr(type(operator.controller), "submit", lambda self, *args, **kwargs: pending["launch"])
    with pytest.raises(TaskDeferred):
        operator._leased(context, operator.launch_then, context, "_submitted", {})
    kept = context["task_state_store"].get(LAUNCH_KEY)
    leases, owner = LeaseLog(state_store), "stream_deploy/manual__1/submit/-1"
    assert kept["held_since"] == leases.get("job").taken_at
    with pytest.raises(StreamJobError, match="a retry of this task picks it up"):
        _wait_failed(operator, context, kept)
    assert leases.get("job").launch["run_id"] == pending["launch"]["run_id"]

    leases.take("job", owner, "submit", time.time() - 1)  # the hold ran out before the retry came
    if taken_between:
        assert leases.take("job", "stream_stop/manual__1/stop/-1", "stop", time.time() + 300) is None
        leases.release("job", "stream_stop/manual__1/stop/-1")
    context["ti"] = _try(2, 1)
    retry = SubmitStreamingJobOperator(task_id="submit", spec=operator.spec, application="/jobs/v1.py")
    run_id = pending["launch"]["run_id"]
    if not taken_between:
        with pytest.raises(TaskDeferred) as deferred:
            retry.execute(context)
        assert deferred.value.trigger.wait.run_id == run_id
        assert state_store.get_run(run_id).stop_requested_at is None
        return
    with pytest.raises(LeaseLost, match=f"run {run_id}, launched by an earlier try of this task, was still starting"):
        retry.execute(context)
    assert state_store.get_run(run_id).stop_requested_at is not None, "the launch was left to come up"
    assert context["task_state_store"].get(LAUNCH_KEY) is None
    assert leases.get("job") is None


@pytest.mark.parametrize("killed", [False, True])
def test_any_failure_while_a_launch_is_in_flight_keeps_the_lease_for_the_retry(state_store, tmp_path, topic,
                                                                              killed):
    """Not only an undecided wait: whatever fails while the task waits on its launch (a blocking wait's
    outage, a bug) leaves the launch for the retry to pick up, and the lease with it.  A task killed has
    ended its launch and let go (``on_kill``): nothing is kept."""
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    operator.retry_delay = timedelta(seconds=600)
    context["ti"] = _try(1, 1)

    def waiting_then_fails():
        operator._in_flight = pending["launch"]
        if killed:
            operator.on_kill()
        raise RuntimeError("the wait broke")

    with pytest.raises(RuntimeError, match="the wait broke"):
        operator._leased(context, waiting_then_fails)

    held = LeaseLog(state_store).get("job")
    if killed:
        assert held is None
        return
    assert held.owner == "stream_deploy/manual__1/submit/-1"
    assert held.launch["run_id"] == pending["launch"]["run_id"] and held.until > time.time() + 600


def test_a_failure_path_that_fails_after_its_launch_failed_lets_go_of_the_lease(state_store, tmp_path, topic):
    """The launch is decided (its run failed) and the flow's failure path fails in turn (a recovery's restart
    budget spent): nothing is left for a retry to pick up, so the lease goes, and the next task (a person's
    stop, the next recovery) is not kept waiting for a retry that has nothing to do."""
    from airflow_stream_provider.state.leases import LeaseLog

    operator, context, pending, _ = _submitted(state_store, tmp_path, topic)
    operator.retry_delay = timedelta(seconds=600)
    context["ti"] = _try(1, 1)
    state_store.finish_run(pending["launch"]["run_id"], status="FAILED", exit_code=1, failure_kind="TRANSIENT",
                           message="the brokers did not answer")

    def refused(context, error):
        raise AirflowFailException("the restart budget is spent")

    operator._refused = refused
    with pytest.raises(AirflowFailException, match="the restart budget is spent"):
        _wait_failed(operator, context, pending)

    assert context["task_state_store"].get(LAUNCH_KEY) is None
    assert LeaseLog(state_store).get("job") is None
