"""Session-wide real components: a Kafka-protocol broker, PostgreSQL, SQLite, Spark drivers."""

from __future__ import annotations

import uuid

import pytest

from stack import postgres
from stack.broker import Broker
from stack.jobs import JobRunner, make_spec
from tests.dagtest import airflow as airflow_stack
from tests.dagtest import dagruns

airflow_stack.configure_environment()  # before any test module imports airflow


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    instance = Broker(tmp_path_factory.mktemp("broker") / "tansu.log").start()
    yield instance
    _close_cached_consumers()
    instance.stop()


def _close_cached_consumers() -> None:
    """The Python source's consumers are cached per process, as in a Spark worker, and tests that read
    through it in this process leave theirs open.  Closed before the broker stops: their network threads
    would otherwise go on reconnecting until the worker exits, logging into streams pytest has closed."""
    from airflow_stream_provider import kafka_client

    for consumer in kafka_client._CACHE.values():
        consumer.close()
    kafka_client._CACHE.clear()


@pytest.fixture(scope="session")
def postgres_server():
    postgres.ensure_server()


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh database per test: result tables such as ``events`` are shared by every job in a database."""
    name, url = postgres.create_database()
    yield url
    postgres.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(database_url):
    """A state database with its schema, on SQLite and PostgreSQL: the runtime's side of it."""
    from airflow_stream_provider.state.store import StateStore

    instance = StateStore.from_url(database_url)
    instance.ensure_schema()
    yield instance
    instance.dispose()


@pytest.fixture
def state_store(database_url, monkeypatch, broker):
    """A state database (SQLite and PostgreSQL) that the Airflow side reaches through its default
    connections, as sensors and triggers do; the Kafka connection points at the test broker."""
    from airflow_stream_provider.state.store import StateStore

    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_default", conn_type="stream_state",
                                                     extra={"url": database_url}))
    monkeypatch.setenv(*airflow_stack.connection_env("stream_kafka_default", conn_type="stream_kafka",
                                                     host="127.0.0.1", port=broker.port))
    instance = StateStore.from_url(database_url)
    instance.ensure_schema()
    yield instance
    instance.dispose()


@pytest.fixture
def job_id(request) -> str:
    return f"{request.node.originalname.replace('test_', '')[:40]}-{uuid.uuid4().hex[:6]}".replace("_", "-")


@pytest.fixture
def topic(broker, job_id) -> str:
    broker.create_topic(job_id, 3)
    return job_id


@pytest.fixture
def runner(broker, topic, job_id, database_url, tmp_path):
    spec = make_spec(job_id, broker.bootstrap, topic, database_url, tmp_path / "checkpoints")
    instance = JobRunner(spec, tmp_path)
    yield instance
    instance.kill_all()
    instance.store.dispose()


@pytest.fixture(scope="session")
def airflow_db():
    airflow_stack.migrate()


@pytest.fixture
def stream(airflow_db, broker, topic, job_id, tmp_path, monkeypatch):
    """One job wired into real Airflow: connections, shared DAG params, its state hook."""

    yield from dagruns.stream_job(broker, topic, job_id, tmp_path, monkeypatch)


class Figures:
    """Numbers a test measured (kills, records, seconds), printed in the run's summary.

    Kept in the test report's user properties, so they reach the summary from xdist workers too."""

    def __init__(self, node):
        self.node = node

    def record(self, name: str, **values) -> None:
        self.node.user_properties.append(("figure", f"{name}: " + ", ".join(f"{k}={v}" for k, v in values.items())))


@pytest.fixture
def figures(request) -> Figures:
    return Figures(request.node)


def pytest_terminal_summary(terminalreporter):
    rows = [value for reports in terminalreporter.stats.values() for report in reports
            if getattr(report, "when", None) == "call"
            for key, value in getattr(report, "user_properties", ()) if key == "figure"]
    if rows:
        terminalreporter.section("measured figures")
        for row in rows:
            terminalreporter.write_line(row)


#: Files whose tests each run several Spark drivers: started first, so that the two workers do not end
#: the run waiting on one long scenario each.
_HEAVY = ("test_standby.py", "test_lifecycle.py", "test_warm_standby.py", "test_deferral.py", "test_upgrades.py",
          "test_runtime.py", "test_example_dags.py", "test_faults.py", "test_provider_dags.py", "test_outages.py", "test_standalone_cluster.py",
          "test_bad_input.py", "test_security.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, name in enumerate(_HEAVY) if item.fspath.basename == name),
                                     len(_HEAVY)))

