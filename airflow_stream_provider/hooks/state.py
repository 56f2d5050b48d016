"""The state database seen from Airflow: runs, epochs, heartbeats, stored offsets, restart history."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from airflow_stream_provider.diagnosis import Diagnosis, Health
from airflow_stream_provider.kafka_offsets import Offsets
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.store import ACTIVE_STATUSES, StateStore


class StreamStateHook(BaseHook):
    """Connection: either ``extra.url`` (any SQLAlchemy URL, e.g. ``sqlite:////data/stream.db``) or the
    usual host/port/schema/login/password fields of a PostgreSQL server.  The password is kept apart
    from the URL so it can travel to the driver in its environment only."""

    conn_name_attr = "state_conn_id"
    default_conn_name = "stream_state_default"
    conn_type = "stream_state"
    hook_name = "Stream state database"

    def __init__(self, state_conn_id: str = default_conn_name, **kwargs):
        super().__init__(**kwargs)
        self.state_conn_id = state_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The form declared in provider info (Airflow 3.2+ reads it from there, without FAB)."""
        from airflow_stream_provider.get_provider_info import ui_field_behaviour

        return ui_field_behaviour(cls.conn_type)

    def test_connection(self, timeout_s: int = 10) -> tuple[bool, str]:
        """Airflow's "Test" button: open the state database and run ``SELECT 1``.

        Returns ``(ok, message)``.  The message names the database by its URL without password or query
        (which may carry credentials), and masks the password should a driver's error quote it."""
        from airflow_stream_provider.state.dialect import with_connect_timeout

        try:
            url, password = self.credentials
        except Exception as err:
            return False, f"State connection {self.state_conn_id!r} is incomplete: {err}"
        parsed = make_url(url)
        where = parsed.set(query={}).render_as_string(hide_password=True)
        parsed = with_connect_timeout(parsed, timeout_s)  # PostgreSQL's default waits minutes
        store = None
        try:
            store = StateStore.from_url(parsed.render_as_string(hide_password=False), password)
            store.ping()
        except Exception as err:
            reason = getattr(err, "orig", None) or err  # the driver's own error, without SQLAlchemy's links
            message = f"Cannot open the state database {where}: {type(reason).__name__}: {reason}"
            message = " ".join(message.split())
            if password:
                message = message.replace(password, "***")
            return False, message
        finally:
            if store is not None:
                store.dispose()
        return True, f"Connected to the state database {where}"

    @cached_property
    def credentials(self) -> tuple[str, str | None]:
        """(URL without password, password)."""
        conn = self.get_connection(self.state_conn_id)
        extra = conn.extra_dejson
        if extra.get("url"):
            try:
                url = make_url(extra["url"])
            except ArgumentError:  # SQLAlchemy's message quotes the URL, which may hold a password
                raise ValueError(
                    f"connection {self.state_conn_id!r}: extra.url is not a database URL; give one such as "
                    "postgresql+psycopg://user@host:5432/db or sqlite:////absolute/path/state.db") from None
            password = url.password or conn.password or None
            # URL.set(password=None) keeps the password; _replace clears it.
            return url._replace(password=None).render_as_string(hide_password=False), password
        if not conn.host:
            raise ValueError(f"connection {self.state_conn_id!r} names no database: set extra.url or the host, "
                             f"port, database and login of a PostgreSQL server")
        url = make_url(f"postgresql+psycopg://{conn.host}:{conn.port or 5432}/{conn.schema or 'postgres'}")
        if conn.login:
            url = url.set(username=conn.login)
        return url.render_as_string(hide_password=False), conn.password or None

    @property
    def database_url(self) -> str:
        return self.credentials[0]

    @property
    def password(self) -> str | None:
        return self.credentials[1]

    @cached_property
    def store(self) -> StateStore:
        store = StateStore.from_url(*self.credentials)
        store.ensure_schema()
        return store

    def close(self) -> None:
        """Dispose of the engine, if one was built (it is built lazily, on first use)."""
        if "store" in self.__dict__:
            self.store.dispose()

    # -- reads used by sensors and operators -------------------------------------------------------
    def latest_run(self, job_id: str) -> RunRecord | None:
        return self.store.latest_run(job_id)

    def stored_offsets(self, job_id: str) -> Offsets:
        return self.store.stored_offsets(job_id)

    def unapplied_from(self, job_id: str) -> Offsets:
        """Where each partition's records still to be applied begin (``StateStore.unapplied_from``): the
        base of the Kafka lag."""
        return self.store.unapplied_from(job_id)

    def record_death(self, run: RunRecord | None, found: Diagnosis) -> bool:
        """A driver killed -9 records nothing itself: once diagnosed DEAD, its run says so in the history
        (status DEAD, with the evidence) instead of staying RUNNING whatever happens next."""
        if found.health != Health.DEAD or run is None or run.status not in ACTIVE_STATUSES:
            return False
        return self.store.mark_dead(run.run_id, "found dead: " + "; ".join(found.evidence))

    def current_generation(self, job_id: str) -> int:
        """The newest generation not archived; 1 for a job that never ran."""
        return self.store.current_generation(job_id)

    def mark_archived(self, job_id: str, generation: int, archive_path: str, reason: str) -> None:
        self.store.mark_archived(job_id, generation, archive_path, reason)

    # -- restart history (the restart budget is counted from it) ---------------------------------------
    def record_restart(self, job_id: str, action: str, reason: str, failed_run_id: str | None,
                       new_run_id: str | None, task: str | None = None) -> None:
        self.store.record_restart(job_id, action, reason, failed_run_id, new_run_id, task)

    def cancel_begun_restarts(self, job_id: str) -> int:
        return self.store.cancel_begun_restarts(job_id)

    def restarts_since(self, job_id: str, since: float) -> list[dict[str, Any]]:
        """Restarts of the job, each with ``new_run_committed``: whether the run it started committed a
        batch (a restart that got somewhere is no part of a crash loop)."""
        return self.store.restarts_since(job_id, since)
