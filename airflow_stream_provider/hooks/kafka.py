"""Kafka as the Airflow side needs it: partitions, earliest/latest offsets, lag of the stored offsets."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook

from airflow_stream_provider import kafka_client, kafka_offsets
from airflow_stream_provider.get_provider_info import ui_field_behaviour
from airflow_stream_provider.kafka_offsets import LostRange, Offsets


class KafkaOffsetsHook(BaseHook):
    """Connection: host[:port] (or ``extra.bootstrap_servers`` for several brokers); other kafka-python
    client settings (security_protocol, sasl_*) in extra."""

    conn_name_attr = "kafka_conn_id"
    default_conn_name = "stream_kafka_default"
    conn_type = "stream_kafka"
    hook_name = "Stream Kafka offsets"

    def __init__(self, kafka_conn_id: str = default_conn_name, **kwargs):
        super().__init__(**kwargs)
        self.kafka_conn_id = kafka_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The form declared in provider info (Airflow 3.2+ reads it from there, without FAB)."""
        return ui_field_behaviour(cls.conn_type)

    @cached_property
    def _settings(self) -> tuple[str, dict[str, Any]]:
        """The brokers, and the client settings in extra as kafka-python's keywords (in Kafka's dotted names
        or kafka-python's, text converted as a job spec's ``client_options`` are), checked as those are."""
        conn = self.get_connection(self.kafka_conn_id)
        extra = dict(conn.extra_dejson)
        bootstrap = extra.pop("bootstrap_servers", None)
        if isinstance(bootstrap, list | tuple):  # kafka-python's own form
            bootstrap = ",".join(map(str, bootstrap))
        if not bootstrap and conn.host:  # a host may list brokers itself; the port is for those without one
            bootstrap = ",".join(h if _has_port(h) else f"{h}:{conn.port or 9092}"
                                 for h in (h.strip() for h in conn.host.split(",")) if h)
        if not bootstrap:
            raise ValueError(f"connection {self.kafka_conn_id!r} names no broker: set host/port or "
                             f"extra.bootstrap_servers")
        if not isinstance(bootstrap, str):
            raise ValueError(f"connection {self.kafka_conn_id!r}: extra.bootstrap_servers {bootstrap!r} is not "
                             "text: give host:port[,host:port]")
        wrong = [f"{name!r} (kafka-python has no such setting)" for name in kafka_client.unknown_options(extra)]
        wrong += [f"{name}={extra[name]!r} (not the kind of value it takes)"
                  for name in kafka_client.mistyped_options(extra)]
        if wrong:
            raise ValueError(f"connection {self.kafka_conn_id!r}: client settings in its extra cannot be used: "
                             f"{', '.join(wrong)}. Use kafka-python's settings, in its spelling or Kafka's dotted "
                             "one (request_timeout_ms or request.timeout.ms)")
        return bootstrap, kafka_client.python_options(extra)

    @property
    def bootstrap_servers(self) -> str:
        return self._settings[0]

    @property
    def client_options(self) -> dict[str, Any]:
        return self._settings[1]

    def test_connection(self, timeout_s: float = 10.0) -> tuple[bool, str]:
        """Airflow's "Test" button: reach the brokers and read the cluster's topic list within ``timeout_s``.

        Returns ``(ok, message)``; the message names the brokers, never the client settings in extra
        (they may hold SASL credentials)."""
        try:
            bootstrap, options = self._settings
        except Exception as err:
            return False, f"Kafka connection {self.kafka_conn_id!r} is incomplete: {err}"
        timeout_ms = max(1000, int(timeout_s * 1000))
        # Bounded: the client's defaults wait 30 s to bootstrap and 30 s per request.
        options = {**options, "bootstrap_timeout_ms": timeout_ms, "request_timeout_ms": timeout_ms + 1000}
        client = None
        try:
            client = kafka_client.new_consumer(bootstrap, options)
            topics = client.topics()
        except Exception as err:
            return False, _redact(f"Cannot reach Kafka at {bootstrap} within {timeout_s:g} s: "
                                  f"{type(err).__name__}: {err}", self.client_options)
        finally:
            if client is not None:
                client.close()
        return True, f"Connected to Kafka at {bootstrap}: {len(topics)} topic(s) visible"

    def watermarks(self, topics: Sequence[str]) -> tuple[Offsets, Offsets]:
        """(earliest, latest) per partition.  A fresh client per call: a long-lived triggerer must not keep
        a connection whose metadata went stale."""
        client = kafka_client.new_consumer(self.bootstrap_servers, self.client_options)
        try:
            return kafka_client.watermarks(client, topics)
        finally:
            client.close()

    def lag(self, unapplied_from: Offsets, topics: Sequence[str]) -> int:
        """Records in Kafka not yet applied to the results, from where each partition's unapplied records
        begin (``StreamStateHook.unapplied_from``; a partition not in it counts from earliest)."""
        earliest, latest = self.watermarks(topics)
        return sum(max(0, end - unapplied_from.get(tp, earliest.get(tp, 0))) for tp, end in latest.items())

    def lost_ranges(self, stored: Offsets, topics: Sequence[str]) -> list[LostRange]:
        earliest, latest = self.watermarks(topics)
        return kafka_offsets.find_lost_ranges(stored, earliest, latest)


def _redact(message: str, options: dict[str, Any]) -> str:
    """Mask any secret of the client settings (``sasl_plain_password``, ``ssl_password``...) that an error
    message may quote."""
    for key, value in options.items():
        if "password" in key.lower() and isinstance(value, str) and value:
            message = message.replace(value, "***")
    return message


def _has_port(host: str) -> bool:
    """``host:port`` or ``[v6 address]:port``; a bare ``[v6 address]`` has none."""
    return host.rsplit("]", 1)[-1].count(":") == 1 if host.startswith("[") else ":" in host
