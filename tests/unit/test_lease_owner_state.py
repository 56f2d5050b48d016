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
