"""The "Test" button of the state and Kafka connections, against real servers and unreachable ones.

A failed test must name what it tried to reach, never show the password, and leave nothing running.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy.engine import make_url

from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from stack.broker import free_port
from tests.dagtest import airflow as airflow_stack

PASSWORD = "s3cret-Pw-7731"


def _set_connection(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv(*airflow_stack.connection_env(conn_id, **fields))


# -- state database ------------------------------------------------------------------------------------
def test_state_on_a_sqlite_file(tmp_path, monkeypatch):
    path = tmp_path / "state.db"
    _set_connection(monkeypatch, "state_ok", conn_type="stream_state", extra={"url": f"sqlite:///{path}"})
    ok, message = StreamStateHook("state_ok").test_connection()
    assert ok, message
    assert str(path) in message


def test_state_on_a_sqlite_file_that_cannot_be_opened(tmp_path, monkeypatch):
    path = tmp_path / "no-such-dir" / "state.db"
    _set_connection(monkeypatch, "state_bad", conn_type="stream_state", extra={"url": f"sqlite:///{path}"})
    ok, message = StreamStateHook("state_bad").test_connection()
    assert not ok
    assert str(path) in message and "unable to open database file" in message


def test_state_without_a_database(monkeypatch):
    _set_connection(monkeypatch, "state_empty", conn_type="stream_state")
    ok, message = StreamStateHook("state_empty").test_connection()
    assert not ok
    assert "state_empty" in message and "names no database" in message


@pytest.mark.postgres
def test_state_on_postgresql(postgres_url, monkeypatch):
    """Host, port, database, login and password fields (the server trusts local users, so the password
    is sent and ignored): the message names the database and not the password."""
    url = make_url(postgres_url)
    _set_connection(monkeypatch, "state_pg", conn_type="stream_state", host=url.host, port=url.port,
                    schema=url.database, login=url.username, password=PASSWORD)
    ok, message = StreamStateHook("state_pg").test_connection()
    assert ok, message
    assert url.database in message and f"{url.host}:{url.port}" in message
    assert PASSWORD not in message


@pytest.mark.postgres
def test_state_on_a_postgresql_url_with_its_password(postgres_url, monkeypatch):
    url = make_url(postgres_url).set(password=PASSWORD)
    _set_connection(monkeypatch, "state_pg_url", conn_type="stream_state",
                    extra={"url": url.render_as_string(hide_password=False)})
    ok, message = StreamStateHook("state_pg_url").test_connection()
    assert ok, message
    assert url.database in message and PASSWORD not in message


@pytest.mark.postgres
def test_state_on_an_unreachable_postgresql(postgres_server, monkeypatch):
    port = free_port()
    _set_connection(monkeypatch, "state_pg_down", conn_type="stream_state", host="127.0.0.1", port=port,
                    schema="stream", login="postgres", password=PASSWORD)
    started = time.monotonic()
    ok, message = StreamStateHook("state_pg_down").test_connection()
    assert not ok
    assert time.monotonic() - started < 15
    assert f"127.0.0.1:{port}" in message and "stream" in message
    assert PASSWORD not in message


@pytest.mark.postgres
def test_state_on_a_missing_postgresql_database(postgres_url, monkeypatch):
    url = make_url(postgres_url).set(database="no_such_stream_db")
    _set_connection(monkeypatch, "state_pg_nodb", conn_type="stream_state", host=url.host, port=url.port,
                    schema=url.database, login=url.username, password=PASSWORD)
    ok, message = StreamStateHook("state_pg_nodb").test_connection()
    assert not ok
    assert 'database "no_such_stream_db" does not exist' in message
    assert PASSWORD not in message


def test_state_through_airflows_connection_test(tmp_path, monkeypatch):
    """What the UI's button calls: ``Connection.test_connection()`` finds the hook by connection type."""
    from airflow.models.connection import Connection

    path = tmp_path / "state.db"
    _set_connection(monkeypatch, "state_ui", conn_type="stream_state", extra={"url": f"sqlite:///{path}"})
    conn = Connection(conn_id="state_ui", conn_type="stream_state", extra={"url": f"sqlite:///{path}"})
    assert conn.test_connection() == (True, f"Connected to the state database sqlite:///{path}")


# -- Kafka ---------------------------------------------------------------------------------------------
def test_kafka_on_the_broker(broker, monkeypatch):
    broker.create_topic(f"test-connection-{uuid.uuid4().hex[:8]}", 1)
    _set_connection(monkeypatch, "kafka_ok", conn_type="stream_kafka", host="127.0.0.1", port=broker.port)
    ok, message = KafkaOffsetsHook("kafka_ok").test_connection()
    assert ok, message
    assert broker.bootstrap in message and "topic" in message


def test_kafka_on_an_unused_port(monkeypatch):
    port = free_port()
    _set_connection(monkeypatch, "kafka_down", conn_type="stream_kafka",
                    extra={"bootstrap_servers": f"127.0.0.1:{port}", "sasl_plain_password": PASSWORD})
    running = set(threading.enumerate())
    started = time.monotonic()
    ok, message = KafkaOffsetsHook("kafka_down").test_connection(timeout_s=2)
    elapsed = time.monotonic() - started
    assert not ok
    assert elapsed < 10, f"the test took {elapsed:.1f} s despite a 2 s timeout"
    assert f"127.0.0.1:{port}" in message
    assert PASSWORD not in message
    # The failed client's network thread must not go on reconnecting for the life of the API server.
    deadline = time.monotonic() + 5
    while (left := [t.name for t in set(threading.enumerate()) - running if t.is_alive()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"threads still running after the failed test: {left}"


def test_kafka_without_a_broker(monkeypatch):
    _set_connection(monkeypatch, "kafka_empty", conn_type="stream_kafka")
    ok, message = KafkaOffsetsHook("kafka_empty").test_connection()
    assert not ok
    assert "kafka_empty" in message and "names no broker" in message


def test_a_kafka_connection_is_read_as_the_spec_reads_its_settings(monkeypatch):
    """A host listing brokers had the port appended to its last one ('b2:9092:9092'); settings in extra
    reached kafka-python as written: Kafka's dotted names refused as unknown, numbers as text compared with
    numbers, both failing as if the brokers were down."""
    _set_connection(monkeypatch, "kafka_listed", conn_type="stream_kafka", host="b1:9092, b2:9093,b3",
                    extra={"security.protocol": "PLAINTEXT", "request_timeout_ms": "15000"})
    hook = KafkaOffsetsHook("kafka_listed")
    assert hook.bootstrap_servers == "b1:9092,b2:9093,b3:9092"
    assert hook.client_options == {"security_protocol": "PLAINTEXT", "request_timeout_ms": 15000}

    _set_connection(monkeypatch, "kafka_v6", conn_type="stream_kafka", host="[::1]", port=9093)
    assert KafkaOffsetsHook("kafka_v6").bootstrap_servers == "[::1]:9093"
    _set_connection(monkeypatch, "kafka_as_list", conn_type="stream_kafka",
                    extra={"bootstrap_servers": ["b1:9092", "b2:9092"]})  # kafka-python's own form
    assert KafkaOffsetsHook("kafka_as_list").bootstrap_servers == "b1:9092,b2:9092"

    _set_connection(monkeypatch, "kafka_wrong", conn_type="stream_kafka", host="b1", port=9092,
                    extra={"sasl.jaas.config": "x", "request.timeout.ms": "soon"})
    with pytest.raises(ValueError, match=r"connection 'kafka_wrong': client settings in its extra cannot be used: "
                                         r"'sasl.jaas.config' \(kafka-python has no such setting\), "
                                         r"request.timeout.ms='soon'"):
        _ = KafkaOffsetsHook("kafka_wrong").bootstrap_servers
