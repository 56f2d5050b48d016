"""``runtime.source_lookup``'s failure path: a JVM that lacks what it reflects on costs the overlap only.

The path that works needs a real JVM (``tests/e2e/test_planner_release.py``); here a stand-in for py4j's
view of a JVM whose every lookup fails, as a Spark without the class or method would, shows the thread
ends without raising and says why in the log."""

from __future__ import annotations

import logging

from airflow_stream_provider.runtime import source_lookup


class _NoSuchClass:
    def __getattr__(self, name):
        raise RuntimeError(f"{name} does not exist in the JVM")


def test_a_spark_without_the_lookup_costs_nothing_but_the_overlap(caplog):
    with caplog.at_level(logging.INFO, logger=source_lookup.__name__):
        thread = source_lookup.start(_NoSuchClass())
        thread.join(5)
    assert not thread.is_alive()
    assert "no lookup of Python data sources beside the session's start" in caplog.text
    assert "does not exist in the JVM" in caplog.text
