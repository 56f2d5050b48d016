"""Which lease owner Airflow says has ended (``lifecycle.holders.task_ended``, asked through the task's
instance by ``operators.base._task_ended``).  The real path, a task killed on a real Airflow whose lease the
next task takes over, is ``real_airflow/test_interrupted_restart.py``; here a stand-in task instance answers
as Airflow's ``get_task_states`` does, to cover the owner forms (a run id holding a slash, a mapped task) and
what must never break a lease."""

from __future__ import annotations

import logging

import pytest

from airflow_stream_provider.operators.base import _task_ended

LOG = logging.getLogger(__name__)


class _TaskInstance:
    def __init__(self, states: dict, fail: bool = False):
        self.states, self.fail, self.asked = states, fail, []

    def get_task_states(self, **query):
        self.asked.append(query)
        if self.fail:
            raise ConnectionError("the API server is away")
        return self.states


@pytest.mark.parametrize(("state", "ended"), [("failed", True), ("success", True), ("removed", True),
                                              ("running", False), ("deferred", False), ("up_for_retry", False),
                                              (None, False)])
def test_a_lease_is_stale_only_once_its_owner_has_ended(state, ended):
    ti = _TaskInstance({"manual__a/b": {"recover": state}})
    assert _task_ended({"ti": ti}, "stream_health/manual__a/b/recover/-1", LOG) is ended
    assert ti.asked == [{"dag_id": "stream_health", "task_ids": ["recover"], "run_ids": ["manual__a/b"],
                         "map_index": None}]


def test_a_mapped_owner_is_looked_up_by_its_index():
    ti = _TaskInstance({"r1": {"recover_3": "failed", "recover": "running"}})
    assert _task_ended({"ti": ti}, "d/r1/recover/3", LOG) is True
    assert ti.asked[0]["map_index"] == 3


@pytest.mark.parametrize(("context", "owner"), [
    ({}, "d/r1/recover/-1"),  # outside a task run
    ({"ti": _TaskInstance({}, fail=True)}, "d/r1/recover/-1"),  # Airflow cannot say
    ({"ti": _TaskInstance({"r1": {"recover": "failed"}})}, "recover@7f3a"),  # an owner that is no task instance
])
def test_when_it_cannot_be_known_the_lease_stands(context, owner):
    assert _task_ended(context, owner, LOG) is False


def _task(**kwargs):
    from airflow.sdk import BaseOperator

    return BaseOperator(task_id="submit", **kwargs)


@pytest.mark.parametrize(("kwargs", "try_number", "max_tries", "due"), [
    ({"retries": 1, "retry_delay": 60}, 1, 1, 60.0),
    ({"retries": 1, "retry_delay": 60}, 2, 1, None),  # the last try: no retry comes
    ({"retries": 0}, 1, 0, None),
    # Airflow's backoff: between retry_delay * multiplier ** (try - 1) and twice that, under max_retry_delay
    ({"retries": 5, "retry_delay": 60, "retry_exponential_backoff": 2.0}, 3, 5, 480.0),
    ({"retries": 5, "retry_delay": 60, "retry_exponential_backoff": 2.0, "max_retry_delay": 300}, 3, 5, 300.0),
    ({"retries": 9, "retry_delay": 3600, "retry_exponential_backoff": 10.0}, 9, 9, 24 * 3600.0),
])
def test_a_holder_keeps_its_lease_until_its_retry_is_due(kwargs, try_number, max_tries, due):
    """How long a task failing with its launch undecided keeps the job's lease for its retry
    (``operators.base._hold_for_retry``)."""
    from types import SimpleNamespace

    from airflow_stream_provider.lifecycle.holders import retry_due_within

    ti = SimpleNamespace(try_number=try_number, max_tries=max_tries)
    assert retry_due_within(_task(**kwargs), ti) == due


def test_a_task_instance_that_does_not_say_its_tries_is_judged_by_the_task_retries():
    from airflow_stream_provider.lifecycle.holders import retry_due_within

    assert retry_due_within(_task(retries=2, retry_delay=30), None) == 30.0
    assert retry_due_within(_task(retries=0), None) is None
