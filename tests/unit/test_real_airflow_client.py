"""The end-to-end tier's REST client: which API answers it retries, and that a retry cannot act twice.

A real api-server answers 500 "Database error" only while its SQLite lock is held past the busy timeout,
which no test can arrange on purpose; these answers come from httpx's mock transport instead.
"""

from __future__ import annotations

import json

import httpx
import pytest

from stack import real_airflow
from stack.real_airflow import RealAirflow

DATABASE_ERROR = {"detail": {"reason": "Database error", "statement": "hidden", "orig_error": "hidden"}}


@pytest.fixture
def client(tmp_path, monkeypatch):
    """A RealAirflow whose API answers come from ``client.answers`` in turn; requests land in ``client.seen``."""
    monkeypatch.setattr(real_airflow.time, "sleep", lambda _s: None)
    airflow = RealAirflow(tmp_path / "home", tmp_path / "dags")
    airflow.answers, airflow.seen = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        airflow.seen.append((request.method, request.url.path, json.loads(request.content or b"null")))
        status, body = airflow.answers.pop(0)
        return httpx.Response(status, json=body)

    airflow._http = httpx.Client(base_url=airflow.url, transport=httpx.MockTransport(handler))
    airflow._token = "token"
    return airflow


def test_a_database_error_is_tried_again_until_it_passes(client):
    client.answers = [(409, {}), (500, DATABASE_ERROR), (500, DATABASE_ERROR), (200, {})]
    client.set_variable("stream_job_application", "/jobs/new.py")
    assert [method for method, _path, _body in client.seen] == ["POST", "PATCH", "PATCH", "PATCH"]


def test_a_database_error_that_lasts_fails_with_the_answer(client):
    client.answers = [(500, DATABASE_ERROR)] * 4
    with pytest.raises(RuntimeError, match=r"PATCH /api/v2/dags/stream_health -> 500: .*Database error"):
        client._request("PATCH", "/dags/stream_health", json={"is_paused": False})
    assert len(client.seen) == 4


def test_any_other_server_error_fails_at_once(client):
    client.answers = [(500, {"detail": "Internal Server Error"})]
    with pytest.raises(RuntimeError, match="500"):
        client._request("PATCH", "/dags/stream_health", json={"is_paused": False})
    assert len(client.seen) == 1


def test_a_retried_trigger_asks_for_the_same_run_and_accepts_that_it_exists(client):
    """The first attempt may have created the run before its answer failed: the retry names the same run id,
    and 409 means it is there."""
    client.answers = [(500, DATABASE_ERROR), (409, {"detail": "exists"})]
    run_id = client.trigger_dag("stream_stop", {"reason": "maintenance"})
    bodies = [body for _method, _path, body in client.seen]
    assert [body["dag_run_id"] for body in bodies] == [run_id, run_id]
    assert bodies[0]["conf"] == {"reason": "maintenance"}


def test_an_expired_token_is_renewed_once(client, monkeypatch):
    monkeypatch.setattr(client, "login", lambda: ("admin", "pw"))
    client.answers = [(401, {}), (201, {"access_token": "renewed"}), (200, {"ok": True})]
    assert client._get("/monitor/health") == {"ok": True}
    assert client._token == "renewed"
    assert client.answers == []
