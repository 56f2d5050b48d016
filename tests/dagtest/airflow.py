"""Real Airflow for tests: its own AIRFLOW_HOME and metadata database, DAGs run with ``dag.test()``.

``dag.test()`` runs every task in this process, deferrable ones included: the trigger runs inline,
so a sensor really defers and resumes from its trigger's event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOME = tempfile.mkdtemp(prefix="stream-airflow-home-")


def configure_environment() -> None:
    """Must run before anything imports airflow: its configuration is read at import time."""
    os.environ["AIRFLOW_HOME"] = HOME
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(Path(__file__).resolve().parents[1] / "dags")
    os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "INFO")


def migrate() -> None:
    airflow = Path(sys.executable).parent / "airflow"
    result = subprocess.run([str(airflow), "db", "migrate"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def connection_env(conn_id: str, **fields) -> tuple[str, str]:
    """An ``AIRFLOW_CONN_<ID>`` variable holding the connection as JSON."""
    return f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(fields)
