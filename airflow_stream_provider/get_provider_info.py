"""Provider registration: Airflow finds this through the ``apache_airflow_provider`` entry point.

The connection forms are declared here (``hook-name``, ``ui-field-behaviour``, ``conn-fields``): Airflow
3.2+ reads them without importing the hooks and without the FAB provider.  The hooks'
``get_ui_field_behaviour()`` (what Airflow 3.1 reads, and only with FAB installed) hands back these same
declarations, so a form is written once.
"""

from __future__ import annotations

from typing import Any

from airflow_stream_provider import __version__

_PKG = "airflow_stream_provider"

#: One entry per connection type.  ``conn-fields`` are keys of the connection's extra JSON; the hooks read
#: them with ``extra_dejson.get(...)``, so a field left empty in the form changes nothing.
_CONNECTION_TYPES: list[dict[str, Any]] = [
    {
        "connection-type": "stream_state",
        "hook-class-name": f"{_PKG}.hooks.state.StreamStateHook",
        "hook-name": "Stream state database",
        "ui-field-behaviour": {
            "hidden-fields": [],
            "relabeling": {"schema": "Database"},
            "placeholders": {
                "url": "sqlite:////var/lib/stream/state.db",
                "host": "PostgreSQL host (when no URL is given)",
                "port": "5432",
                "schema": "postgres",
            },
        },
        "conn-fields": {
            "url": {
                "label": "Database URL",
                "description": "Any SQLAlchemy URL, e.g. sqlite:////var/lib/stream/state.db or "
                "postgresql+psycopg://user@host:5432/db; leave empty to use the host, port, database "
                "and login fields of a PostgreSQL server. Keep the password in the Password field: it "
                "reaches the Spark driver through its environment only.",
                "schema": {"type": ["string", "null"]},
            },
        },
    },
    {
        "connection-type": "stream_kafka",
        "hook-class-name": f"{_PKG}.hooks.kafka.KafkaOffsetsHook",
        "hook-name": "Stream Kafka offsets",
        "ui-field-behaviour": {
            "hidden-fields": ["schema", "login", "password"],
            "relabeling": {"host": "Broker host"},
            "placeholders": {
                "bootstrap_servers": "k1:9092,k2:9092",
                "port": "9092",
                "extra": '{"security_protocol": "SSL"}',
            },
        },
        "conn-fields": {
            "bootstrap_servers": {
                "label": "Bootstrap servers",
                "description": "Comma-separated host:port list of brokers; when set, it is used instead of "
                "host and port. Other kafka-python client settings (security_protocol, sasl_*) go in "
                "Extra.",
                "schema": {"type": ["string", "null"]},
            },
        },
    },
    {
        "connection-type": "stream_checkpoint",
        "hook-class-name": f"{_PKG}.hooks.checkpoint.CheckpointHook",
        "hook-name": "Stream checkpoints",
        "ui-field-behaviour": {
            "hidden-fields": ["schema", "password"],
            "relabeling": {"host": "WebHDFS host", "port": "WebHDFS port", "login": "HDFS user"},
            "placeholders": {"port": "9870"},
        },
        "conn-fields": {
            "use_ssl": {
                "label": "Use HTTPS",
                "description": "Reach WebHDFS over https instead of http.",
                "schema": {"type": ["boolean", "null"], "default": False},
            },
            "timeout": {
                "label": "Request timeout (seconds)",
                "description": "How long a WebHDFS request may wait for an answer (default 120).",
                "schema": {"type": ["number", "null"], "default": 120},
            },
        },
    },
]


def ui_field_behaviour(conn_type: str) -> dict[str, Any]:
    """The form of one connection type as ``BaseHook.get_ui_field_behaviour()`` returns it (snake_case
    keys).  The lists and dicts inside are the very objects provider info hands Airflow, not copies."""
    for entry in _CONNECTION_TYPES:
        if entry["connection-type"] == conn_type:
            behaviour = entry["ui-field-behaviour"]
            return {
                "hidden_fields": behaviour["hidden-fields"],
                "relabeling": behaviour["relabeling"],
                "placeholders": behaviour["placeholders"],
            }
    raise KeyError(f"no connection type {conn_type!r} in provider info")


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-stream-provider",
        "name": "Stream Provider",
        "description": "Keep PySpark Structured Streaming jobs on Kafka alive and exactly-once: submit, "
        "watch, recover, stop gracefully, reset across incompatible checkpoints.",
        "versions": [__version__],
        "connection-types": _CONNECTION_TYPES,
        "hooks": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.hooks.state", f"{_PKG}.hooks.kafka", f"{_PKG}.hooks.checkpoint", f"{_PKG}.hooks.driver"]}],
        "operators": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.operators.submit", f"{_PKG}.operators.stop", f"{_PKG}.operators.restart",
            f"{_PKG}.operators.reset", f"{_PKG}.operators.recover", f"{_PKG}.operators.upgrade"]}],
        "sensors": [{"integration-name": "Stream", "python-modules": [f"{_PKG}.sensors.health"]}],
        "triggers": [{"integration-name": "Stream", "python-modules": [
            f"{_PKG}.triggers.health", f"{_PKG}.triggers.watch", f"{_PKG}.triggers.run"]}],
        "extra-links": [f"{_PKG}.links.StreamDriverLogLink", f"{_PKG}.links.SparkUILink"],
        "asset-uris": [{"schemes": ["stream"], "handler": f"{_PKG}.assets.stream.sanitize_uri"}],
        "integrations": [{"integration-name": "Stream", "external-doc-url":
                          "https://spark.apache.org/docs/latest/structured-streaming-programming-guide.html",
                          "tags": ["apache"]}],
    }
