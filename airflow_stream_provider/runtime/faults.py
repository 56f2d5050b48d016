"""Deterministic crash points for fault-injection tests.

``STREAM_FAULT=<point>:<batch_id>`` (batch ``*`` for any) makes the driver die at that point exactly as
if it had been SIGKILLed: no cleanup, no termination record.  Unset in production: one env lookup.
The launcher starts every driver in its own process group, so killing the group takes down the JVM,
the Python driver and its workers together, and nothing else.
"""

from __future__ import annotations

import os
import signal

ENV = "STREAM_FAULT"
POINTS = ("batch_start", "before_db_commit", "after_db_commit", "during_stop")


def maybe_crash(point: str, batch_id: int | None = None) -> None:
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, batch = wanted.partition(":")
    if name == point and (batch in ("", "*") or batch == str(batch_id)):
        os.killpg(os.getpgrp(), signal.SIGKILL)
