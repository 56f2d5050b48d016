"""The example job deployed on its own real Airflow, per test."""

from __future__ import annotations

import pytest

from stack.deployment import StreamDeployment


@pytest.fixture
def deployment(broker, topic, job_id, tmp_path):
    instance = StreamDeployment(tmp_path, broker, job_id, topic)
    try:
        yield instance.start()
    finally:
        instance.stop()
