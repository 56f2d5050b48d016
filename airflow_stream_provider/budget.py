"""The restart budget: N restarts per window, with a backoff that resets after a healthy period.

A crash loop must end in a clear failure, not a storm of restarts (invariant 7).  Pure: decided from
the restart history the state database keeps.

Only restarts that got nowhere count against the budget: a restarted run that committed a batch was
healthy, whatever killed it later (a lost machine, a kill -9).  A job failing on the same record every
time commits nothing after its restarts, so a real crash loop still ends at the budget.  The backoff also
counts a run that failed by itself before it ran ``healthy_reset_s``, whatever it committed (a driver
out of memory on its second batch gets somewhere, slowly): Kubernetes backs off a container that exits
before it ran ten minutes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_stream_provider.settings_numbers import finite_number, whole_number


@dataclass(frozen=True)
class RestartBudget:
    max_restarts: int = 3
    window_s: float = 1800.0
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0
    #: restarts further apart than this are not "consecutive": the job was healthy in between
    healthy_reset_s: float = 600.0

    def __post_init__(self):
        # each wrong value named: a healthy_reset_s of 0 (or NaN) would count no restart as consecutive and end
        # the budget and the backoff without a word
        wrong = [f"{name}={value!r} ({rule})" for name, value, ok, rule in (
            ("max_restarts", self.max_restarts, whole_number(self.max_restarts) and self.max_restarts >= 1,
             "a whole number >= 1"),
            ("window_s", self.window_s, finite_number(self.window_s) and self.window_s > 0, "seconds > 0"),
            ("backoff_base_s", self.backoff_base_s, finite_number(self.backoff_base_s) and self.backoff_base_s >= 0,
             "seconds >= 0"),
            ("backoff_max_s", self.backoff_max_s, finite_number(self.backoff_max_s) and self.backoff_max_s >= 0,
             "seconds >= 0"),
            ("healthy_reset_s", self.healthy_reset_s, finite_number(self.healthy_reset_s) and self.healthy_reset_s > 0,
             "seconds > 0"),
        ) if not ok]
        if wrong:
            raise ValueError("restart budget: " + "; ".join(wrong))

    def used(self, restart_times: Sequence[float], now: float) -> list[float]:
        return sorted(t for t in restart_times if now - t <= self.window_s)

    def exhausted(self, restart_times: Sequence[float], now: float) -> bool:
        return len(self.used(restart_times, now)) >= self.max_restarts

    def backoff(self, restart_times: Sequence[float], now: float) -> float:
        """Seconds to wait before the next restart: doubles with each consecutive restart."""
        times = sorted(restart_times)
        consecutive = 0
        previous = now
        for t in reversed(times):
            if previous - t > self.healthy_reset_s:
                break
            consecutive += 1
            previous = t
        if consecutive == 0:
            return 0.0
        return min(self.backoff_base_s * 2 ** (consecutive - 1), self.backoff_max_s)


def crash_loop_restarts(history: Sequence[Mapping[str, Any]], healthy_reset_s: float | None = None) -> list[float]:
    """The times of the restarts whose new run got nowhere: what the budget and the backoff count.  A run
    got somewhere when it committed a batch, or when its query ran ``healthy_reset_s`` (a quiet topic's run
    commits nothing, however long it is healthy).  ``history`` rows carry ``at``, ``new_run_committed`` and
    ``new_run_up_s``."""
    return [row["at"] for row in history if not row.get("new_run_committed") and not _ran_healthy(row, healthy_reset_s)]


def backoff_restarts(history: Sequence[Mapping[str, Any]], healthy_reset_s: float) -> list[float]:
    """The times of the restarts the backoff counts: those of the crash loop, and those whose new run
    failed by itself (``new_run_failed``: it ended FAILED, not killed from outside) before it ran
    ``healthy_reset_s``, though it committed.  Without them a job that fails after each run's first batch
    restarts at once, again and again."""
    return [row["at"] for row in history
            if not _ran_healthy(row, healthy_reset_s) and (not row.get("new_run_committed") or row.get("new_run_failed"))]


def _ran_healthy(row: Mapping[str, Any], healthy_reset_s: float | None) -> bool:
    return healthy_reset_s is not None and (row.get("new_run_up_s") or 0.0) >= healthy_reset_s
