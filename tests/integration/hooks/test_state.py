"""StreamStateHook reads its connection as Airflow resolves it (from the environment here)."""

from __future__ import annotations

import pytest

from airflow_stream_provider.hooks.state import StreamStateHook
from tests.dagtest import airflow as airflow_stack


@pytest.mark.parametrize("fields, url, password", [
    ({"extra": {"url": "postgresql+psycopg://stream:s3cret@db:5432/results"}},
     "postgresql+psycopg://stream@db:5432/results", "s3cret"),
    ({"password": "fromfield", "extra": {"url": "postgresql+psycopg://stream@db:5432/results"}},
     "postgresql+psycopg://stream@db:5432/results", "fromfield"),
    ({"host": "db", "port": 6543, "schema": "results", "login": "stream", "password": "s3cret"},
     "postgresql+psycopg://stream@db:6543/results", "s3cret"),
    ({"extra": {"url": "sqlite:////var/lib/stream/state.db"}}, "sqlite:////var/lib/stream/state.db", None),
], ids=["password-in-url", "password-field", "fields", "sqlite"])
def test_the_database_url_never_holds_the_password(monkeypatch, fields, url, password):
    """The URL goes into the job spec, the driver's command line and the recorded run; the password
    travels only in the driver's environment."""
    monkeypatch.setenv(*airflow_stack.connection_env("stream_state_test", conn_type="stream_state", **fields))
    hook = StreamStateHook("stream_state_test")
    assert hook.credentials == (url, password)


def test_a_url_that_is_no_url_names_the_connection_not_the_password(monkeypatch):
    """SQLAlchemy's own error quotes the text, password included, and is no ValueError, which the operators
    turn into a failure that says what to fix."""
    monkeypatch.setenv(*airflow_stack.connection_env(
        "stream_state_test", conn_type="stream_state", extra={"url": "stream:s3cret at db/results"}))
    with pytest.raises(ValueError, match="'stream_state_test': extra.url is not a database URL") as caught:
        _ = StreamStateHook("stream_state_test").credentials
    assert "s3cret" not in str(caught.value)
