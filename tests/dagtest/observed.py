"""Observation points for DAG tests: see that a sensor really deferred, and when its trigger fired.

Not a mock: the trigger and sensor behave exactly as the provider's; they only record two moments.
Importable by classpath, as the triggerer (inline in ``dag.test()``) loads triggers.
"""

from __future__ import annotations

import threading
import time

from airflow_stream_provider.sensors.health import StreamHealthSensor
from airflow_stream_provider.triggers.health import StreamHealthTrigger

TRIGGER_STARTED = threading.Event()
TRIGGER_FIRED_AT: list[float] = []


def reset() -> None:
    TRIGGER_STARTED.clear()
    TRIGGER_FIRED_AT.clear()


class ObservedHealthTrigger(StreamHealthTrigger):
    async def run(self):
        TRIGGER_STARTED.set()
        async for event in super().run():
            TRIGGER_FIRED_AT.append(time.time())
            yield event


class ObservedHealthSensor(StreamHealthSensor):
    trigger_class = ObservedHealthTrigger
