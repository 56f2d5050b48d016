"""Diagnose a stream job and take the action its health calls for, inside a restart budget."""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.budget import RestartBudget, crash_loop_restarts
from airflow_stream_provider.diagnosis import Diagnosis, Health
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.operators.base import StreamJobOperator

ON_INCOMPATIBLE = ("reset", "fail")


class RecoverStreamingJobOperator(StreamJobOperator):
    """What on-call would do, written down:

    ========================  =========================================================================
    health / failure kind     action
    ========================  =========================================================================
    STARTING, HEALTHY         nothing
    STOPPED                   nothing: a clean stop was asked for by someone
    DEAD, TRANSIENT,          restart from the checkpoint (Spark replays the unfinished batch, the sink
    RESOURCE, UNKNOWN,        skips what was committed), within the restart budget
    USER_CODE, CONCURRENT
    STUCK                     stop (escalating to a kill), then restart from the checkpoint
    CHECKPOINT_INCOMPATIBLE   reset to a new generation from the stored offsets (``on_incompatible``)
    DATA_LOSS, POISON         fail with the evidence: no automatic action can be right
    ========================  =========================================================================

    Out of budget (``max_restarts`` within ``restart_window``), the task fails and says so.  Restarts
    whose run then committed a batch do not count: the job was healthy in between.
    """

    template_fields = (*StreamJobOperator.template_fields, "on_incompatible", "max_restarts", "restart_window",
                       "backoff_base")

    def __init__(self, *, max_restarts: int = 3, restart_window: float = 1800.0, backoff_base: float = 5.0,
                 backoff_max: float = 300.0, healthy_reset: float = 600.0, on_incompatible: str = "reset",
                 **kwargs):
        super().__init__(**kwargs)
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.healthy_reset = healthy_reset
        self.on_incompatible = on_incompatible

    @property
    def budget(self) -> RestartBudget:
        return RestartBudget(int(self.max_restarts), float(self.restart_window), float(self.backoff_base),
                             float(self.backoff_max), float(self.healthy_reset))

    def execute(self, context) -> dict[str, Any]:
        if self.on_incompatible not in ON_INCOMPATIBLE:
            raise AirflowFailException(f"on_incompatible={self.on_incompatible!r} is not one of "
                                       f"{', '.join(ON_INCOMPATIBLE)}")
        found = self.diagnose()
        self.log.info("Diagnosis: %s", found.summary())
        outcome = {"diagnosis": found.to_dict()}
        if found.health in (Health.STARTING, Health.HEALTHY, Health.STOPPED):
            return {**outcome, "action": "none"}
        kind = found.failure_kind
        if kind in (FailureKind.DATA_LOSS, FailureKind.POISON):
            raise AirflowFailException(f"{found.summary()}. {found.advice} No automatic recovery for "
                                       f"{kind.value}: it needs a decision.")
        if kind == FailureKind.CHECKPOINT_INCOMPATIBLE:
            if self.on_incompatible == "fail":
                raise AirflowFailException(f"{found.summary()}. on_incompatible='fail': reset the job to a new "
                                           f"generation from its stored offsets when ready.")
            outcome["backoff_s"] = self._check_budget(found)
            return {**outcome, **self.reset_and_resume(f"checkpoint incompatible: {found.error_class}")}
        outcome["backoff_s"] = self._check_budget(found)
        return {**outcome, **self.restart_from_checkpoint(found.summary(), self.state.latest_run(self.job.job_id))}

    def _check_budget(self, found: Diagnosis) -> float:
        """Fail when the restart budget is spent; else sleep the crash-loop backoff and return it."""
        now = time.time()
        history = self.state.restarts_since(self.job.job_id, now - max(self.budget.window_s,
                                                                        self.budget.healthy_reset_s * 10))
        times = crash_loop_restarts(history)
        if self.budget.exhausted(times, now):
            used = self.budget.used(times, now)
            raise AirflowFailException(
                f"job {self.job.job_id} is out of its restart budget: {len(used)} restarts in the last "
                f"{self.budget.window_s / 60:.0f} min whose run never committed a batch (max "
                f"{self.budget.max_restarts}); the job keeps failing: "
                f"{found.summary()}. Fix the cause ({found.advice or 'see the driver log'}), then restart it "
                f"by hand.")
        delay = self.budget.backoff(times, now)
        if delay:
            self.log.info("Backing off %.0fs before restarting (consecutive restarts)", delay)
            time.sleep(delay)
        return delay
