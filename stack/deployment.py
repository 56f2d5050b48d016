"""The example job deployed on a real Airflow: the four DAGs of ``dags/`` under a real scheduler,
triggerer, dag-processor and api-server, driven only as a person would (REST API), and observed only
from outside (the state database, the broker, the REST API).

Shared by the demo, the end-to-end tier and the ``mttr_real_airflow`` benchmark, so all three prove the
same thing the same way.  Imports no Airflow module: this process is a client, not a component.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.store import ACTIVE_STATUSES, StateStore
from stack.jobs import EVENTS_JOB, REPO, TEST_SPARK_CONF, spark_env, wait_until
from stack.real_airflow import RealAirflow

DAG_IDS = ("stream_deploy", "stream_health", "stream_stop", "stream_upgrade")


def kill_driver(pid: int) -> None:
    """SIGKILL to the driver's whole process group (the JVM and the Python driver): a machine dying."""
    from airflow_stream_provider import local_driver

    try:
        local_driver.signal_group(os.getpgid(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass


class StreamDeployment:
    """One stream job (SQLite state and results) on its own real Airflow."""

    def __init__(self, workdir: Path, broker, job_id: str, topic: str, *, dags_folder: Path = REPO / "dags",
                 dag_ids: tuple[str, ...] = DAG_IDS, spec: dict | None = None, watch: dict | None = None,
                 variables: dict | None = None, spark_conf: dict | None = None,
                 airflow_env: dict[str, str] | None = None, driver_env: dict[str, str] | None = None):
        self.workdir = workdir
        self.dag_ids = dag_ids
        self.broker = broker
        self.job_id = job_id
        self.database_url = f"sqlite:///{workdir / 'stream.db'}"
        driver = spark_env()
        self.spec = {"job_id": job_id, "version": "1.0", "checkpoint_root": str(workdir / "checkpoints"),
                     "trigger_interval": "1 second", "heartbeat_seconds": 1.0,
                     "kafka": {"topics": [topic], "source": "python", "max_offsets_per_trigger": 2000},
                     **(spec or {})}
        self.variables = {
            "stream_job_spec": self.spec,
            "stream_job_application": EVENTS_JOB,
            "stream_spark_conf": spark_conf if spark_conf is not None else TEST_SPARK_CONF,
            "stream_driver_env": {**{k: driver[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON",
                                                            "SPARK_LOCAL_IP")}, **(driver_env or {})},
            "stream_driver_log_dir": str(workdir / "driver-logs"),
            "stream_reset_policy": "after_preflight",
            "stream_watch": {"heartbeat_timeout": 15, "stuck_after": 300, **(watch or {})},
            # the watcher alone: an hourly sweep landing in a scenario would repair a kill before the
            # watcher's event, and the scenarios show the watcher's repairs
            "stream_health_sweep": "off",
            **(variables or {}),
        }
        connections = {
            "stream_state_default": {"conn_type": "stream_state", "extra": {"url": self.database_url}},
            "stream_kafka_default": {"conn_type": "stream_kafka", "host": "127.0.0.1", "port": broker.port},
            "spark_default": {"conn_type": "spark", "host": "local[2]",
                              "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}},
        }
        env = {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(fields) for conn_id, fields in connections.items()}
        env["PATH"] = driver["PATH"]  # spark-submit of the driver environment
        env.update(airflow_env or {})
        self.airflow = RealAirflow(workdir / "airflow", dags_folder, env=env)
        self.store = StateStore.from_url(self.database_url)
        self.store.ensure_schema()

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> StreamDeployment:
        self.airflow.start(self.variables)
        for dag_id in self.dag_ids:
            self.airflow.wait_dag(dag_id)
        return self

    def stop(self, *, graceful: bool = True) -> None:
        """Every driver of the job, then every Airflow component (whole process groups); shut down
        cleanly, or without ``graceful`` killed at once (a test's teardown)."""
        for run in self.runs():
            if run.pid and run.status in ACTIVE_STATUSES:
                kill_driver(run.pid)
        if graceful:
            self.airflow.stop()
        else:
            self.airflow.stop(timeout=0)
        self.store.dispose()

    # -- driving it as a person would ----------------------------------------------------------------
    def trigger(self, dag_id: str, timeout: float = 600, **conf) -> dict[str, Any]:
        """Trigger ``dag_id`` through the REST API and wait for it; return {task_id: (state, XCom)}."""
        run_id = self.airflow.trigger_dag(dag_id, conf or None)
        run = self.airflow.wait_dag_run(dag_id, run_id, timeout)
        return self.tasks(dag_id, run_id) | {"_run": (run["state"], run_id)}

    def deploy(self, produced) -> dict[str, Any]:
        """``stream_deploy``, which must succeed, then wait until the job has applied ``produced``; its tasks."""
        tasks = self.trigger("stream_deploy")
        state, run_id = tasks["_run"]
        if state != "success":
            raise AssertionError(f"stream_deploy ended {state}:\n{self.explain('stream_deploy', run_id)}")
        self.wait_caught_up(produced)
        return tasks

    def tasks(self, dag_id: str, run_id: str) -> dict[str, Any]:
        found = {}
        for ti in self.airflow.task_instances(dag_id, run_id):
            value = self.airflow.xcom(dag_id, run_id, ti["task_id"]) if ti["state"] == "success" else None
            found[ti["task_id"]] = (ti["state"], value)
        return found

    def explain(self, dag_id: str, run_id: str) -> str:
        """The failed tasks' logs, for an assertion message."""
        parts = []
        for ti in self.airflow.task_instances(dag_id, run_id):
            if ti["state"] not in ("success", "skipped"):
                log = self.airflow.task_log(dag_id, run_id, ti["task_id"], max(1, ti["try_number"]))
                parts.append(f"--- {ti['task_id']} ({ti['state']})\n{log[-3000:]}")
        return "\n".join(parts)

    # -- observing it -----------------------------------------------------------------------------------
    def runs(self) -> list[RunRecord]:
        return self.store.runs(self.job_id, include_dry_runs=False)

    def latest_run(self) -> RunRecord | None:
        return self.store.latest_run(self.job_id)

    def first_commit(self, run_id: str, after: float = 0.0) -> float | None:
        """When ``run_id`` first committed a batch after ``after``: the moment it is processing."""
        return self.store.first_commit(self.job_id, run_id, after)

    def processing(self, timeout: float = 300, other_than: str | None = None, after: float = 0.0) -> dict[str, Any]:
        """The live run once it has committed a batch (a run other than ``other_than``); with the moment of
        its first commit after ``after`` in ``committed_at``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.latest_run()
            if run and run.run_id != other_than and run.status == "RUNNING" and run.pid:
                committed = self.first_commit(run.run_id, after)
                if committed:
                    return {**run.to_dict(), "committed_at": committed}
            time.sleep(0.2)
        raise TimeoutError(f"job {self.job_id}: no run other than {other_than} processed within {timeout:.0f}s; "
                           f"runs: {[(r.run_id[:8], r.status, r.failure_kind) for r in self.runs()]}")

    def wait_caught_up(self, produced, timeout: float = 300, progress=None) -> None:
        end = {(produced.topic, p): o for p, o in produced.end_offsets.items()}
        deadline = time.monotonic() + timeout
        last = -1
        while time.monotonic() < deadline:
            stored = self.store.stored_offsets(self.job_id)
            done = sum(stored.get(tp, 0) for tp in end)
            if progress and done != last:
                progress(f"  applied through offset sum {done} of {sum(end.values())}")
                last = done
            if all(stored.get(tp, 0) >= offset for tp, offset in end.items()):
                return
            time.sleep(0.5)
        raise TimeoutError(f"job {self.job_id} did not catch up within {timeout:.0f}s: stored "
                           f"{self.store.stored_offsets(self.job_id)} vs {end}")

    def health_runs(self, since: float = 0.0) -> list[dict]:
        """``stream_health`` runs that started after ``since``, oldest first."""
        runs = [r for r in self.airflow.dag_runs("stream_health")
                if r.get("start_date") and epoch(r["start_date"]) >= since]
        return sorted(runs, key=lambda r: r["start_date"])

    def failed_health_runs(self, task_id: str) -> list[dict]:
        """The failed ``stream_health`` runs whose ``task_id`` failed."""
        return [r for r in self.health_runs() if r["state"] == "failed"
                and self.tasks("stream_health", r["dag_run_id"]).get(task_id, (None,))[0] == "failed"]

    def ended_recovers(self, count: int) -> list[tuple[str, str]] | None:
        """(DAG run, state) of the ended ``recover`` tasks of ``stream_health``, oldest first, once ``count``
        have ended (for ``wait_until``)."""
        ended = []
        for run in self.health_runs():
            state = self.tasks("stream_health", run["dag_run_id"]).get("recover", (None,))[0]
            if state in ("success", "failed"):
                ended.append((run["dag_run_id"], state))
        return ended if len(ended) >= count else None

    def lost_then_finished(self) -> tuple[dict, dict]:
        """The diagnoses (``diagnose``'s XCom) of the two ``stream_health`` runs of a recovery lost once: the
        first, whose ``recover`` was killed, and the second, whose ``recover`` finished what it began."""
        lost, finished = wait_until(lambda: self.ended_recovers(2), 60, "both stream_health runs' recover tasks ended")
        assert lost[1] == "failed", (
            "the first recover task was killed before it launched anything; the ended ones: "
            + "; ".join(f"{run} {state}: {self._diagnosis_line(run)}" for run, state in self.ended_recovers(0)))
        assert finished[1] == "success", self.explain("stream_health", finished[0])
        return tuple(self.airflow.xcom("stream_health", run, "diagnose", key="diagnosis") for run, _ in (lost, finished))

    def _diagnosis_line(self, dag_run_id: str) -> str:
        found = self.airflow.xcom("stream_health", dag_run_id, "diagnose", key="diagnosis") or {}
        return f"{found.get('health')} of run {found.get('run_id')} ({'; '.join(found.get('evidence') or [])})"

    def repairs(self, run_id: str, since: float = 0.0, timeout: float = 60.0) -> list[dict]:
        """The ``stream_health`` runs since ``since`` whose ``recover`` launched ``run_id``, oldest first.  A
        ``recover`` names its run when it ends, after the run's first batch: waits up to ``timeout`` for one."""
        deadline = time.monotonic() + timeout
        while True:
            found = [r for r in self.health_runs(since)
                     if (self.tasks("stream_health", r["dag_run_id"]).get("recover", (None, None))[1] or {})
                     .get("run_id") == run_id]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(1)


def epoch(iso: str) -> float:
    """Unix seconds of a timestamp the REST API returned."""
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def task_lost_once(tmp_path, point: str) -> dict[str, str]:
    """The ``airflow_env`` that kills the first Airflow task process reaching the task fault ``point``
    (``faults.TASK_POINTS``), as a lost worker or an OOM kill would, and no later one."""
    return {"STREAM_FAULT": point, "STREAM_FAULT_ONCE": str(tmp_path / f"{point}-fired")}


def dags_with(tmp_path: Path, examples: tuple[str, ...] | None = None, **extra: str) -> Path:
    """A DAGs folder of the example DAG files (linked; ``examples`` names some of them, e.g. only
    ``stream_job.py``, the module the others import) and the test's own DAG files, ``extra`` as
    {module name: source}."""
    dags = tmp_path / "dags"
    dags.mkdir()
    for source in (REPO / "dags").glob("*.py"):
        if examples is None or source.name in examples:
            (dags / source.name).symlink_to(source)
    for name, text in extra.items():
        (dags / f"{name}.py").write_text(text)
    return dags
