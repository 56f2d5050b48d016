"""A job's lease holder in Airflow's terms: the task instance a lease owner names, and whether Airflow says
it has ended.  A task that ends without letting go of the lease (its worker lost, killed while deferred
where no trigger undid it) leaves the job to whoever sees that first: the next task that wants the lease,
or the watcher, which reports a job such a task left down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: Task instance states in which a task acts no more: its lease on a job is stale.
ENDED_TASK_STATES = ("success", "failed", "skipped", "upstream_failed", "removed")

#: Airflow's own cap on a retry's delay (``[core] max_task_retry_delay``'s default), where the task sets none
MAX_RETRY_DELAY_S = 24 * 60 * 60.0

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


def retry_due_within(task: Any, ti: Any) -> float | None:
    """Seconds after a failure of ``ti`` (a try of ``task``) within which Airflow queues its retry, at the
    latest; None where no retry is left.  Airflow's own rule: ``retry_delay``, or with an exponential backoff
    up to twice ``retry_delay * multiplier ** (try - 1)``, capped by ``max_retry_delay``.  A ``retry_policy``
    may choose otherwise; the holder's lease then runs out first, and the next task takes it as it would
    any lease run out."""
    try_number = getattr(ti, "try_number", None) or 1
    max_tries = getattr(ti, "max_tries", None)
    if max_tries is None:  # a task instance that does not say (a test's, a command line's)
        max_tries = task.retries or 0
    if try_number > max_tries:
        return None
    delay = _seconds(task.retry_delay)
    multiplier = float(task.retry_exponential_backoff or 0)
    if multiplier <= 0 or multiplier == 1.0:  # a fixed delay: no backoff, and max_retry_delay does not apply
        return delay
    try:
        delay = 2 * max(1.0, delay * multiplier ** (try_number - 1))
    except OverflowError:
        delay = MAX_RETRY_DELAY_S
    delay = min(delay, MAX_RETRY_DELAY_S)
    if task.max_retry_delay:  # Airflow ignores a zero cap as it does an absent one
        delay = min(delay, _seconds(task.max_retry_delay))
    return delay


def _seconds(delay: timedelta | float) -> float:
    return delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
