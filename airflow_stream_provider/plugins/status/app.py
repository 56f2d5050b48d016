"""The status page's FastAPI app, mounted by Airflow's api-server under ``/stream-status``.

Every route needs a signed-in Airflow user allowed to see plugins (the UI's own cookie, or a bearer
token): the page is read-only, but runs and dead letters are the business's data.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse, PlainTextResponse

from airflow_stream_provider.plugins.status import report
from airflow_stream_provider.state.store import StateStore

STATIC = Path(__file__).parent / "static"
#: How much of a driver log one request returns: its end, where a failure is.
LOG_BYTES = 1_000_000


def _requires_access():
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import requires_access_view

    return requires_access_view(AccessView.PLUGINS)


def _settings() -> tuple[str, str]:
    """The state and Kafka connections the page reads (``[stream_status]`` in Airflow's configuration)."""
    from airflow.configuration import conf

    return (conf.get("stream_status", "state_conn_id", fallback="stream_state_default"),
            conf.get("stream_status", "kafka_conn_id", fallback="stream_kafka_default"))


@lru_cache(maxsize=1)
def _state(conn_id: str) -> tuple[StateStore, str | None]:
    """The state database, opened once: read only (unlike the hook's store, it never creates the schema)."""
    from airflow_stream_provider.hooks.state import StreamStateHook

    url, password = StreamStateHook(conn_id).credentials
    return StateStore.from_url(url, password), password


@lru_cache(maxsize=1)
def _end_offsets(kafka_conn_id: str):
    """Kafka's end offsets, through one hook (its connection looked up once, like the state database's)."""
    from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook

    hook = KafkaOffsetsHook(kafka_conn_id)
    return lambda topics: hook.watermarks(topics)[1]


def create_app() -> FastAPI:
    app = FastAPI(title="Stream status", dependencies=[Depends(_requires_access())],
                  description="Read-only status of the stream jobs in the provider's state database.")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> str:
        return (STATIC / "index.html").read_text()

    @app.get("/api/jobs")
    def jobs() -> dict[str, Any]:
        from airflow_stream_provider.state import overview

        state_conn_id, _ = _settings()
        try:
            store, _ = _state(state_conn_id)
            return {"jobs": overview.job_ids(store) if store.has_schema() else []}
        except Exception as err:
            raise HTTPException(503, _unreachable(state_conn_id, err)) from err

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str) -> dict[str, Any]:
        from airflow_stream_provider.hooks.driver import StreamDriverHook
        from airflow_stream_provider.state import overview

        state_conn_id, kafka_conn_id = _settings()
        try:
            store, password = _state(state_conn_id)
            if not store.has_schema() or job_id not in overview.job_ids(store):
                raise HTTPException(404, f"no job {job_id!r} in the state database")
            return report.job_report(store, job_id, end_offsets=_end_offsets(kafka_conn_id),
                                     driver_alive=StreamDriverHook.is_alive, secrets=[password])
        except HTTPException:
            raise
        except Exception as err:
            raise HTTPException(503, _unreachable(state_conn_id, err)) from err

    @app.get("/api/runs/{run_id}/log", response_class=PlainTextResponse)
    def run_log(run_id: str) -> str:
        """A run's driver log (its end), masked; what the operators' "Driver log" link opens."""
        from airflow_stream_provider.lifecycle import driver_log

        state_conn_id, _ = _settings()
        try:
            store, password = _state(state_conn_id)
            run = store.get_run(run_id) if store.has_schema() else None
        except Exception as err:
            raise HTTPException(503, _unreachable(state_conn_id, err)) from err
        if run is None:
            raise HTTPException(404, f"no run {run_id!r} in the state database")
        if not run.log_path:
            raise HTTPException(404, f"run {run_id} recorded no log file: its driver ran on a cluster "
                                     f"({run.submission_id or 'no handle'}); its log is in the cluster's UI")
        text = driver_log.read_end(run.log_path, LOG_BYTES)
        if text is None:
            raise HTTPException(404, f"the driver log of run {run_id} is {run.log_path} on {run.host}, which "
                                     "this api-server cannot read: open it on that host")
        return report.masked(text, [password])

    return app


def _unreachable(conn_id: str, err: Exception) -> str:
    return report.masked(f"the state database of connection {conn_id!r} cannot be read: "
                         f"{type(err).__name__}: {err}")
