"""Provider registration: Airflow finds this through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from airflow_stream_provider import __version__

_PKG = "airflow_stream_provider"


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-stream-provider",
        "name": "Stream Provider",
        "description": "Keep PySpark Structured Streaming jobs on Kafka alive and exactly-once: submit, "
        "watch, recover, stop gracefully, reset across incompatible checkpoints.",
        "versions": [__version__],
        "connection-types": [
            {"connection-type": "stream_state", "hook-class-name": f"{_PKG}.hooks.state.StreamStateHook"},
            {"connection-type": "stream_kafka", "hook-class-name": f"{_PKG}.hooks.kafka.KafkaOffsetsHook"},
            {"connection-type": "stream_checkpoint",
             "hook-class-name": f"{_PKG}.hooks.checkpoint.CheckpointHook"},
        ],
        "hooks": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.hooks.state", f"{_PKG}.hooks.kafka", f"{_PKG}.hooks.checkpoint", f"{_PKG}.hooks.driver"]}],
        "operators": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.operators.submit", f"{_PKG}.operators.stop", f"{_PKG}.operators.restart",
            f"{_PKG}.operators.reset", f"{_PKG}.operators.recover"]}],
        "sensors": [{"integration-name": "Stream", "python-modules": [f"{_PKG}.sensors.health"]}],
        "triggers": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.triggers.health", f"{_PKG}.triggers.watch"]}],
        "asset-uris": [{"schemes": ["stream"], "handler": f"{_PKG}.assets.stream.sanitize_uri"}],
        "integrations": [{"integration-name": "Stream", "external-doc-url":
                          "https://spark.apache.org/docs/latest/structured-streaming-programming-guide.html",
                          "tags": ["apache"]}],
    }
