"""A real Apache Airflow 3 deployment on loopback, for the end-to-end tier, the demo and benchmarks.

Unlike ``tests.dagtest.airflow`` (``dag.test()`` in this process), this runs scheduler, triggerer,
dag-processor and api-server as four separate ``airflow`` processes, each in its own process group,
with LocalExecutor on a private SQLite database under ``home``: DAGs are parsed, scheduled, deferred
and resumed exactly as in production, and driven only through the public REST API (``/api/v2``).

Everything stays inside ``home`` (config, database, logs, auth passwords) and on 127.0.0.1.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psutil

from stack.broker import free_port

VENV_BIN = Path(sys.executable).parent  # the Airflow-side venv; components spawn ``airflow`` by name
COMPONENTS = ("scheduler", "triggerer", "dag-processor", "api-server")
# The key of each component in /api/v2/monitor/health (the api-server is healthy when it answers).
HEALTH_KEYS = {"scheduler": "scheduler", "triggerer": "triggerer", "dag-processor": "dag_processor"}
TERMINAL_RUN_STATES = ("success", "failed")
USERNAME = "admin"
# Keys of each structured task-log line that task_log() leaves out: the same on every line.
_LOG_CONTEXT = {"timestamp", "level", "event", "logger", "dag_id", "run_id", "task_id", "try_number", "ti_id",
                "map_index", "filename", "lineno"}
# Inherited Airflow configuration is dropped: a pytest process configured for dag.test() (its own
# AIRFLOW_HOME, connections) must not leak into the deployment. Pass what it needs through ``env``.
_DROPPED_PREFIXES = ("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_", "_AIRFLOW")
_DROPPED = ("AIRFLOW_HOME", "AIRFLOW_CONFIG")
#: A freshly migrated, empty metadata database, made by this process's first deployment on SQLite: each
#: later one copies it instead of running ``airflow db migrate`` again (seconds of CPU each on 2 cores).
_migrated: Path | None = None


class RealAirflow:
    """One Airflow deployment. ``env`` reaches every component and overrides the defaults below
    (e.g. ``AIRFLOW_CONN_*`` as JSON, ``PATH`` additions, ``PYSPARK_*``, any ``AIRFLOW__S__K``)."""

    def __init__(self, home: Path, dags_folder: Path, *, env: dict[str, str] | None = None,
                 parallelism: int = 4, reparse_interval: int = 30):
        self.home, self.dags_folder = Path(home).resolve(), Path(dags_folder).resolve()
        self.log_dir = self.home / "logs"
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self._token: str | None = None
        self._http = httpx.Client(base_url=self.url, timeout=30, trust_env=False)  # no proxies on loopback
        self.env = self._environment(env or {}, parallelism, reparse_interval)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _environment(self, extra: dict[str, str], parallelism: int, interval: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED and not k.startswith(_DROPPED_PREFIXES)}
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            # SQLite has one write lock; sqlite3 waits 5 s for it by default, which a busy scheduler beside
            # running drivers outlasts ("database is locked", a 500 "Database error" from the API).
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _sqlite_url(self._database),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__PARALLELISM": str(parallelism),
            # Shared secrets: the scheduler signs task tokens that the api-server's execution API checks.
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USERNAME}:admin",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            # Without it task supervisors call the default port 8080: "Connection refused".
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            # Each DAG file is parsed again every ``reparse_interval`` seconds: Airflow's default, 30 s, unless
            # a test changes files.  A parse costs a fork and the provider's imports; every 5 s the
            # dag-processor alone used a tenth of a core, beside the drivers that the recovery figures time.
            # Variables read at parse time are set before the first parse (``start``).
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": str(interval),
            # Serialized DAGs may be rewritten (and caches revalidated) every second, not every 30 s.
            "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
            "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "1",
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_STORAGE_PATH": str(self.home / "dag_bundles"),  # not /tmp
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            # A restarted triggerer adopts the triggers of a killed one once that one's heartbeat is
            # older than the threshold: 15 s instead of 30 s.
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "15",
            # The task supervisor notices its task's exit only at its next heartbeat wait (default up to
            # 5 s): slower runs, and a trigger firing within that window makes the scheduler fail the
            # resumed task on the late defer-exit "success" (apache/airflow#66374, #72716).
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "AIRFLOW__LOGGING__COLORED_CONSOLE_LOG": "False",
            "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ in the DAGs folder
        })
        env.update(extra)
        path = env.get("PATH", "")
        if not path.startswith(f"{VENV_BIN}{os.pathsep}"):
            env["PATH"] = f"{VENV_BIN}{os.pathsep}{path}"
        return env

    # -- processes --------------------------------------------------------------------------------

    def _cli(self, *args: str, timeout: float = 600) -> None:
        result = subprocess.run([str(VENV_BIN / "airflow"), *args], env=self.env, capture_output=True,
                                text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RuntimeError(f"airflow {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")

    def start(self, variables: dict[str, str | dict] | None = None, timeout: float = 180) -> RealAirflow:
        """Migrate the database, set ``variables`` (seen by the DAG files at their first parse), start
        the four components and wait until all of them report healthy."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._migrate()
        if variables:
            self._set_variables(variables)
        since = datetime.now(UTC)
        for name in COMPONENTS:
            self._spawn(name)
        try:
            self._wait_healthy(COMPONENTS, since, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def _database(self) -> Path:
        return self.home / "airflow.db"

    @property
    def _own_sqlite(self) -> bool:
        """The deployment runs on its default SQLite database, not on one its caller configured."""
        return self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == _sqlite_url(self._database)

    def _migrate(self) -> None:
        """``airflow db migrate``; on the default SQLite database, once per process, whose result later
        deployments copy: the same empty schema, from the same Airflow."""
        global _migrated
        if not self._own_sqlite:  # a database of the caller's: migrated in place
            self._cli("db", "migrate")
            return
        if _migrated is None:
            self._cli("db", "migrate")
            kept = Path(tempfile.mkdtemp(prefix="airflow-migrated-"))
            atexit.register(shutil.rmtree, kept, True)
            _migrated = Path(shutil.copyfile(self._database, kept / "airflow.db"))
        else:
            shutil.copyfile(_migrated, self._database)

    def _set_variables(self, variables: dict[str, str | dict]) -> None:
        """The variables the DAG files read at their first parse, before any component starts.  In the
        default SQLite database, fresh from ``_migrate``, they are written as rows, unencrypted and dicts as
        JSON, which Airflow reads back as it reads what ``variables import`` writes: an ``airflow`` CLI run
        for it costs a deployment 2-4 s and 3 CPU s of imports.  In a database of the caller's, that CLI run."""
        if self._own_sqlite:
            rows = [(key, value if isinstance(value, str) else json.dumps(value)) for key, value in variables.items()]
            with closing(sqlite3.connect(self._database)) as db, db:
                db.executemany("INSERT INTO variable (key, val, is_encrypted) VALUES (?, ?, 0) "
                               "ON CONFLICT (key) DO UPDATE SET val = excluded.val, is_encrypted = 0", rows)
            return
        # One CLI run for all; each value is wrapped so that a dict holding "value" stays a dict.
        path = self.home / "variables.json"
        path.write_text(json.dumps({key: {"value": value} for key, value in variables.items()}))
        self._cli("variables", "import", "--action-on-existing-key", "overwrite", str(path))

    def __enter__(self) -> RealAirflow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str) -> None:
        if name not in COMPONENTS:
            raise ValueError(f"unknown component {name!r}; one of {COMPONENTS}")
        if name in self.processes and self.processes[name].poll() is None:
            raise RuntimeError(f"the {name} is already running")
        args = {"scheduler": ["scheduler", "--skip-serve-logs"],  # the log servers bind 0.0.0.0:879x
                "triggerer": ["triggerer", "--skip-serve-logs"],
                "dag-processor": ["dag-processor"],
                "api-server": ["api-server", "--host", "127.0.0.1", "--port", str(self.port)]}[name]
        with open(self.log_path(name), "ab") as log:  # the child keeps its own descriptor
            self.processes[name] = subprocess.Popen(
                [str(VENV_BIN / "airflow"), *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env, cwd=self.home, start_new_session=True)
        # Components rewrite their process title (and with it what /proc shows of their environment): a
        # deployment left running on purpose is found again through this file (``stop_left_running``).
        (self.home / "process-groups").write_text(
            "\n".join(str(p.pid) for p in self.processes.values() if p.poll() is None) + "\n")

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return "(no log)"

    def health(self) -> dict | None:
        """/api/v2/monitor/health (no authentication), or None while the api-server does not answer."""
        try:
            response = self._http.get("/api/v2/monitor/health", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def _wait_healthy(self, names: tuple[str, ...], since: datetime, timeout: float) -> None:
        """Until each component answers (api-server) or has heartbeated since ``since``: a killed
        component's last heartbeat keeps it "healthy" in the endpoint for the health-check threshold."""
        deadline = time.monotonic() + timeout
        waiting = list(names)
        while True:
            for name in names:
                process = self.processes[name]
                if process.poll() is not None:
                    raise RuntimeError(f"the {name} exited with {process.returncode}; "
                                       f"{self.log_path(name)}:\n{self.log_tail(name)}")
            health = self.health()
            if health is not None:
                waiting = [n for n in names if n != "api-server" and not _fresh(health, n, since)]
                if not waiting:
                    return
            if time.monotonic() > deadline:
                name = waiting[0]
                state = json.dumps(health) if health else "the api-server does not answer"
                raise RuntimeError(f"the {name} was not healthy within {timeout:.0f}s ({state}); "
                                   f"{self.log_path(name)}:\n{self.log_tail(name)}")
            time.sleep(0.5)

    def _groups(self, name: str) -> set[int]:
        """The component's process group plus those of its descendants: task processes get a group of
        their own (the task supervisor calls setpgid), so killing the component's group misses them."""
        process = self.processes[name]
        groups = {process.pid}
        try:
            for child in psutil.Process(process.pid).children(recursive=True):
                try:
                    groups.add(os.getpgid(child.pid))
                except ProcessLookupError:
                    pass
        except psutil.NoSuchProcess:
            pass
        return groups

    @staticmethod
    def _signal(groups: set[int], sig: signal.Signals) -> None:
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _alive(groups: set[int]) -> bool:
        for group in groups:
            try:
                os.killpg(group, 0)
                return True
            except ProcessLookupError:
                pass
        return False

    def kill_component(self, name: str) -> None:
        """SIGKILL one component with all its descendants, as a crash would; no clean shutdown."""
        if name not in self.processes:
            return
        self._signal(self._groups(name), signal.SIGKILL)
        self.processes.pop(name).wait(30)

    def start_component(self, name: str, wait: bool = True, timeout: float = 120) -> None:
        """Start one component again (same environment, appending to its log); with ``wait``, until it
        has heartbeated (or, for the api-server, answers)."""
        since = datetime.now(UTC)
        self._spawn(name)
        if wait:
            self._wait_healthy((name,), since, timeout)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM the components' process groups (descendants' too), SIGKILL whatever is left after
        ``timeout``; the api-server goes last, so that tasks stopping meanwhile can still report through
        the execution API instead of retrying against a closed port.  With ``timeout`` 0, SIGKILL at once:
        for a deployment whose test is over (a clean shutdown takes 10-15 s and shows nothing).  Idempotent."""
        rest = [n for n in self.processes if n != "api-server"]
        for names, limit in (rest, timeout), (["api-server"], min(5, timeout)):
            groups = set().union(*(self._groups(n) for n in names if n in self.processes))
            if limit > 0:
                self._signal(groups, signal.SIGTERM)
            deadline = time.monotonic() + limit
            while self._alive(groups) and time.monotonic() < deadline:
                for process in self.processes.values():
                    process.poll()  # reap, or an exited component's zombie keeps its group "alive"
                time.sleep(0.2)
            self._signal(groups, signal.SIGKILL)
            for name in names:
                if name in self.processes:
                    self.processes.pop(name).wait(30)
        self._token = None

    # -- REST API -----------------------------------------------------------------------------------

    def login(self) -> tuple[str, str]:
        """The admin's credentials, for the UI too: the api-server writes a generated password into
        ``home/simple_auth_manager_passwords.json.generated`` at its first start."""
        passwords = json.loads((self.home / "simple_auth_manager_passwords.json.generated").read_text())
        return USERNAME, passwords[USERNAME]

    def token(self) -> str:
        """The admin's JWT: the REST API's bearer token, and what the UI keeps in its ``_token`` cookie."""
        if self._token is None:
            username, password = self.login()
            response = self._http.post("/auth/token", json={"username": username, "password": password})
            if response.status_code != 201:
                raise RuntimeError(f"POST /auth/token -> {response.status_code}: {response.text[:500]}")
            self._token = response.json()["access_token"]
        return self._token

    def _request(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kwargs: Any) -> httpx.Response:
        """One API call. Every write the stack makes is idempotent (a DAG run's id is chosen by the caller),
        so a 500 "Database error" - SQLite's one lock held past the busy timeout - is tried again, and so is
        a request the api-server did not answer within the client's timeout (the same lock, on a busy host)."""
        headers = kwargs.pop("headers", {})
        relogged, retries = False, 0
        while True:
            try:
                response = self._http.request(method, f"/api/v2{path}", **kwargs,
                                              headers={"Authorization": f"Bearer {self.token()}", **headers})
            except httpx.TimeoutException:
                if retries >= 3:
                    raise
                retries += 1
                continue
            if response.status_code in (401, 403) and not relogged:
                self._token = None  # expired or invalid ("403 Invalid JWT token"): log in again once
                relogged = True
                continue
            if response.status_code == 500 and "Database error" in response.text and retries < 3:
                retries += 1
                time.sleep(retries)
                continue
            if response.status_code not in ok:
                raise RuntimeError(f"{method} /api/v2{path} -> {response.status_code}: {response.text[:1000]}")
            return response

    def _get(self, path: str, **params: Any) -> Any:
        return self._request("GET", path, params=params).json()

    def wait_dag(self, dag_id: str, timeout: float = 120) -> dict:
        """Until the DAG is parsed and visible; unpause it if it is paused. Import errors are in the message
        on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            response = self._request("GET", f"/dags/{_q(dag_id)}", ok=(200, 404))
            if response.status_code == 200:
                dag = response.json()
                if not dag["is_paused"]:
                    return dag
                self._request("PATCH", f"/dags/{_q(dag_id)}", json={"is_paused": False})
                continue
            if time.monotonic() > deadline:
                errors = self._get("/importErrors")["import_errors"]
                raise RuntimeError(f"DAG {dag_id} not visible within {timeout:.0f}s; import errors: "
                                   f"{json.dumps(errors)[:3000]}")
            time.sleep(0.5)

    def trigger_dag(self, dag_id: str, conf: dict | None = None) -> str:
        """A manual run (no logical date, like the UI's trigger button); returns its dag_run_id.

        The run id is chosen here, so a retried request cannot start the run twice: 409 means an earlier
        attempt created it after all."""
        run_id = f"manual__{datetime.now(UTC).isoformat()}_{secrets.token_hex(3)}"
        body = {"dag_run_id": run_id, "logical_date": None, "conf": conf or {}}
        self._request("POST", f"/dags/{_q(dag_id)}/dagRuns", ok=(200, 409), json=body)
        return run_id

    def dag_runs(self, dag_id: str) -> list[dict]:
        """Newest first (at most 100): dag_run_id, state, run_type, run_after, start_date, end_date, conf..."""
        return self._get(f"/dags/{_q(dag_id)}/dagRuns", order_by="-id", limit=100)["dag_runs"]

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self._get(f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}")

    def wait_dag_run(self, dag_id: str, run_id: str, timeout: float = 120) -> dict:
        """Until the run is success or failed; returns it. On timeout, the error lists its task states."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.dag_run(dag_id, run_id)
            if run["state"] in TERMINAL_RUN_STATES:
                return run
            if time.monotonic() > deadline:
                tasks = {ti["task_id"]: ti["state"] for ti in self.task_instances(dag_id, run_id)}
                raise RuntimeError(f"{dag_id} {run_id} still {run['state']} after {timeout:.0f}s; tasks: {tasks}")
            time.sleep(0.5)

    def set_task_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> None:
        """Mark a task instance ``state`` as a person does in the UI (mark failed / success)."""
        self._request("PATCH", f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}",
                      json={"new_state": state})

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self._get(f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances",
                         limit=100)["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        """The stored (JSON) value of an XCom, as the task returned it for JSON-able values; None when the
        task pushed none (a branch, an empty operator)."""
        response = self._request("GET", f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}"
                                 f"/xcomEntries/{_q(key)}", ok=(200, 404))
        return response.json()["value"] if response.status_code == 200 else None

    def links(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str | None]:
        """A task's extra links, name -> URL, as the UI shows them."""
        return self._get(f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}/links")["extra_links"]

    def set_variable(self, key: str, value: Any) -> None:
        """Create or overwrite an Airflow Variable; non-strings are stored as JSON."""
        text = value if isinstance(value, str) else json.dumps(value)
        response = self._request("POST", "/variables", ok=(201, 409), json={"key": key, "value": text})
        if response.status_code == 409:
            self._request("PATCH", f"/variables/{_q(key)}", json={"key": key, "value": text})

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """A task's log as text, for failure messages."""
        response = self._request("GET", f"/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}"
                                 f"/logs/{try_number}", ok=(200, 404), params={"full_content": "true"},
                                 headers={"Accept": "application/json"})
        if response.status_code == 404:
            return f"(no log: {response.text[:300]})"
        lines = []
        for entry in response.json()["content"]:
            if isinstance(entry, str):
                lines.append(entry)
                continue
            extra = {k: v for k, v in entry.items() if k not in _LOG_CONTEXT}
            lines.append(" ".join(str(part) for part in (entry.get("timestamp") or "", entry.get("level") or "",
                                                         entry.get("event") or "", extra or "") if part))
        return "\n".join(lines)


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}?timeout=30"


def stop_left_running(home: Path) -> int:
    """SIGKILL the process groups of a deployment that a finished process left running on purpose (a
    demo's ``--keep``), and of the task processes they started; return how many groups were signalled."""
    path = Path(home) / "process-groups"
    if not path.exists():
        return 0
    groups: set[int] = set()
    for line in path.read_text().split():
        try:
            component = psutil.Process(int(line))
            groups |= {os.getpgid(p.pid) for p in [component, *component.children(recursive=True)]}
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    RealAirflow._signal(groups, signal.SIGKILL)
    path.unlink()
    return len(groups)


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _fresh(health: dict, name: str, since: datetime) -> bool:
    info = health.get(HEALTH_KEYS[name]) or {}
    beat = info.get(f"latest_{HEALTH_KEYS[name]}_heartbeat")
    if info.get("status") != "healthy" or not beat:
        return False
    beat_time = datetime.fromisoformat(beat)
    return (beat_time if beat_time.tzinfo else beat_time.replace(tzinfo=UTC)) >= since
