"""The package registers itself with Airflow, and everything it lists imports."""

from __future__ import annotations

import importlib

from airflow_stream_provider.get_provider_info import get_provider_info


def test_airflow_discovers_the_provider():
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-stream-provider" in manager.providers
    hooks = manager.hooks
    for conn_type in ("stream_state", "stream_kafka", "stream_checkpoint"):
        assert conn_type in hooks, f"connection type {conn_type} is not registered"


def test_every_listed_module_imports():
    info = get_provider_info()
    for section in ("hooks", "operators", "sensors", "triggers"):
        for entry in info[section]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    for conn in info["connection-types"]:
        module, _, name = conn["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook.conn_type == conn["connection-type"]
