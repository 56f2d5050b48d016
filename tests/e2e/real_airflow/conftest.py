"""The example job deployed on its own real Airflow, per test."""

from __future__ import annotations

import pytest

from stack.deployment import StreamDeployment


@pytest.fixture
def deployment_options() -> dict:
    """Keyword arguments of the test's ``StreamDeployment``; a test module overrides this fixture."""
    return {}


@pytest.fixture
def deployment(broker, topic, job_id, tmp_path, deployment_options):
    instance = StreamDeployment(tmp_path, broker, job_id, topic, **deployment_options)
    try:
        yield instance.start()
    finally:
        instance.stop(graceful=False)  # the test is over: its deployment needs no clean shutdown
