"""A submit whose launch came up.

* Retried after that (its worker lost before Airflow recorded the success, an XCom push that failed): the
  live run is the one its earlier try launched, so the retry succeeds on it instead of failing as a double
  start (``if_running='fail'``).  A run some other task launched still fails.
* Its run ended while the launch settled (its first batch failed): the launch worked, and the task says
  the run has ended instead of that it is running; the health check acts on the run.

The trigger's "ready" event is handed to the operator as Airflow hands it over; the run is a registered row,
as a driver on another host leaves it (the flow under test reads the row only, never the process)."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from tests.integration.launches import launch_on_another_host, submit_operator
from tests.integration.task_state import TaskStateStore


def _operator(spec) -> SubmitStreamingJobOperator:
    return SubmitStreamingJobOperator(task_id="submit", spec=spec, application="/jobs/v1.py")


def _launched(store, tmp_path, topic, ended_while_settling: bool = False) -> tuple[dict, dict, str]:
    """A first try whose launch came up: its task state as the try leaves it, and the run's id."""
    first = submit_operator(tmp_path, topic)
    launch = launch_on_another_host(store, first)
    run_id = launch["run_id"]
    store.mark_query_started(run_id)
    if ended_while_settling:
        store.finish_run(run_id, status="FAILED", exit_code=1, failure_kind="USER_CODE",
                         message="ZeroDivisionError in results")
    context = {"task_state_store": TaskStateStore()}
    result = first.execute_complete(context, {
        "outcome": "ready", "run_id": run_id,
        "resume": {"method": "_launch_waited",
                   "state": {"launch": launch, "after": "_submitted", "carry": {}, "on_fail": None}}})
    assert result["run_id"] == run_id and result["action"] == "submitted"
    return first.spec, context, run_id


def test_a_retry_after_its_own_launch_succeeds_on_that_run(state_store, tmp_path, topic):
    spec, context, run_id = _launched(state_store, tmp_path, topic)

    retry = _operator(spec)
    result = retry.execute(context)  # the same task instance: its task state kept across tries

    assert (result["run_id"], result["action"]) == (run_id, "submitted")
    assert result["checkpoint_path"] == retry.job.with_generation(1).checkpoint_path
    assert [run.run_id for run in state_store.recent_runs("job", 10)] == [run_id], "a second driver launched"


def test_another_tasks_submit_still_fails_on_the_live_run(state_store, tmp_path, topic):
    spec, _, run_id = _launched(state_store, tmp_path, topic)

    with pytest.raises(AirflowFailException, match=f"already runs \\(run {run_id}"):
        _operator(spec).execute({"task_state_store": TaskStateStore()})


def test_a_run_that_ended_while_its_launch_settled_is_not_said_to_run(state_store, tmp_path, topic, capfd):
    _, _, run_id = _launched(state_store, tmp_path, topic, ended_while_settling=True)

    # the operator's log, as Airflow's logging writes it
    said = [line for line in "".join(capfd.readouterr()).splitlines() if run_id in line]
    assert not any("is running" in line for line in said), said
    assert any("has ended since: FAILED, USER_CODE: ZeroDivisionError in results" in line for line in said), said
