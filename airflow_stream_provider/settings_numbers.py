"""Numbers given as settings: one rule for what counts as a number of anything, shared by the budget, the
health thresholds and the operators' timeouts.

A bool is no number here (``True`` would read as 1), nor are nan and infinity: a wait of nan seconds never
ends and compares false with every limit.

Pure (no airflow, no pyspark).
"""

from __future__ import annotations

import math
from typing import Any


def finite_number(value: Any) -> bool:
    """An int or float, not a bool, neither nan nor infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def whole_number(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def rendered_seconds(value: Any) -> float | None:
    """A rendered setting as a finite number of seconds: a number, or text that reads as one (a templated
    field is text once rendered); None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) else None
