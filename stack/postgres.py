"""A fresh database on the machine's PostgreSQL server for each test session or benchmark run."""

from __future__ import annotations

import os
import subprocess
import uuid

import psycopg

ADMIN_DSN = os.environ.get("STREAM_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def server_up() -> bool:
    try:
        with psycopg.connect(ADMIN_DSN, connect_timeout=3):
            return True
    except psycopg.OperationalError:
        return False


def ensure_server() -> None:
    """Start the local cluster if it is installed but stopped (see ENVIRONMENT notes)."""
    if server_up():
        return
    versions = os.listdir("/etc/postgresql") if os.path.isdir("/etc/postgresql") else []
    if versions:
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", versions[0], "main", "start"],
            check=False,
            capture_output=True,
            timeout=60,
        )
    if not server_up():
        raise RuntimeError(
            f"PostgreSQL is not reachable at {ADMIN_DSN}; start it or set STREAM_TEST_PG_ADMIN"
        )


def create_database() -> tuple[str, str]:
    """Create an empty database; return (name, SQLAlchemy URL)."""
    name = f"stream_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return name, f"{base}/{name}"


def drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
