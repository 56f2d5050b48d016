"""A job's lease holder in Airflow's terms: the task instance a lease owner names, and whether Airflow says
it has ended.  A task that ends without letting go of the lease (its worker lost, killed while deferred
where no trigger undid it) leaves the job to whoever sees that first: the next task that wants the lease,
or the watcher, which reports a job such a task left down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

#: Task instance states in which a task acts no more: its lease on a job is stale.
ENDED_TASK_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")

#: ``RuntimeTaskInstance.get_task_states``'s signature: Airflow's answer, in a worker or in the triggerer
TaskStates = Callable[..., dict[str, Any]]


def lease_owner(ti: Any) -> str:
    """The task instance, whatever its try or resume: a retry and a resumed deferral hold the same lease."""
    return f"{ti.dag_id}/{ti.run_id}/{ti.task_id}/{getattr(ti, 'map_index', -1)}"


def airflow_task_states(**query: Any) -> dict[str, Any]:
    """Airflow's task states, asked through the process's supervisor: a worker's or the triggerer's."""
    from airflow.sdk.execution_time import task_runner

    if not hasattr(task_runner, "SUPERVISOR_COMMS"):  # a command line, a test: no supervisor to ask through
        raise RuntimeError("not inside an Airflow task or triggerer, which alone can ask Airflow")
    return task_runner.RuntimeTaskInstance.get_task_states(**query)


def task_ended(owner: str, log: logging.Logger, get_task_states: TaskStates | None = airflow_task_states) -> bool:
    """Whether Airflow says the task instance ``owner`` (``lease_owner``) has ended.  False whenever that
    cannot be known: outside a task run or a triggerer, or an owner that is no task instance."""
    parts = owner.split("/")
    if len(parts) < 4 or get_task_states is None:
        return False
    dag_id, *run, task_id, map_index = parts
    try:
        run_id, index = "/".join(run), int(map_index)
        states = get_task_states(dag_id=dag_id, task_ids=[task_id], run_ids=[run_id],
                                 map_index=index if index >= 0 else None)
    except Exception as err:  # the lease then stands until it runs out
        log.warning("Could not ask Airflow for the state of task %s: %r", owner, err)
        return False
    state = (states.get(run_id) or {}).get(task_id if index < 0 else f"{task_id}_{index}")
    return state in ENDED_TASK_STATES
