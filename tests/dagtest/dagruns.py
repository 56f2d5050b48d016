"""One stream job wired into real Airflow: connections, the DAG params every DAG of the job shares,
and helpers to trigger a DAG with ``dag.test()`` and read what its tasks returned.

Imported by conftest before Airflow is configured, so Airflow modules are imported inside functions.
"""

from __future__ import annotations

import copy
import datetime
import signal

from airflow_stream_provider.state.records import RunRecord
from stack.jobs import EVENTS_JOB, REPO, TEST_SPARK_CONF, spark_env, wait_until
from tests.dagtest import airflow as airflow_stack

FIXTURE_JOBS = REPO / "tests" / "fixtures" / "jobs"


def stream_job(broker, topic: str, job_id: str, tmp_path, monkeypatch):
    """Connections for one job (SQLite state database), and the DAG params for it; yields a dict."""
    db_path = tmp_path / "state.db"
    for conn_id, fields in {
        "stream_state_default": {"conn_type": "stream_state", "extra": {"url": f"sqlite:///{db_path}"}},
        "stream_kafka_default": {"conn_type": "stream_kafka", "host": "127.0.0.1", "port": broker.port},
        "spark_default": {"conn_type": "spark", "host": "local[2]",
                          "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}},
    }.items():
        monkeypatch.setenv(*airflow_stack.connection_env(conn_id, **fields))
    env = spark_env()
    monkeypatch.setenv("PATH", env["PATH"])  # spark-submit of the driver environment
    from airflow_stream_provider.hooks.driver import StreamDriverHook
    from airflow_stream_provider.hooks.state import StreamStateHook
    from tests.dagtest import observed

    observed.reset()
    spec = {"job_id": job_id, "version": "1.0", "checkpoint_root": str(tmp_path / "checkpoints"),
            "trigger_interval": "2 seconds", "heartbeat_seconds": 1.0,
            "kafka": {"topics": [topic], "source": "python", "max_offsets_per_trigger": 1500}}
    params = {"spec": spec, "application": EVENTS_JOB, "conf": TEST_SPARK_CONF, "ready_timeout": 240,
              "env_vars": {k: env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP")},
              "driver_log_dir": str(tmp_path / "driver-logs"), "heartbeat_timeout": 15, "stop_timeout": 90}
    state = StreamStateHook()
    yield {"params": params, "job_id": job_id, "topic": topic, "state": state, "tmp": tmp_path}
    for run in runs(state, job_id):
        if run.pid:
            StreamDriverHook._signal(run, signal.SIGKILL)
    state.store.dispose()


def runs(state, job_id: str) -> list[RunRecord]:
    return state.store.runs(job_id)


#: Each DAG's declared params, read before its first run.  ``dag.test()`` runs the tasks in this process,
#: and resolving a run's conf writes each value into the DAG's own ``Param`` objects (a real Airflow parses
#: the DAG afresh for every task), so a value one test overrides, e.g. ``if_running="replace"``, would
#: become the default of the next test's run in the same worker.  Every run passes all of them.
_DECLARED: dict[str, dict] = {}


def run_dag(dag, params: dict, *, logical_date: str | None = None, **overrides):
    """Trigger ``dag`` with the job's params; return (state, {task_id: (state, xcom)}).  ``logical_date``
    (ISO 8601): the run's, and so its run id; a second run with the same one replaces the first, with the
    same task instances, as Airflow's retry of a killed task runs the same task instance again."""
    declared = _DECLARED.setdefault(dag.dag_id, copy.deepcopy(dag.params.dump()))
    at = datetime.datetime.fromisoformat(logical_date) if logical_date else None
    when = {"logical_date": at, "run_after": at} if at else {}  # the run id is made of run_after
    dag_run = dag.test(run_conf={**declared, **params, **overrides}, **when)
    tasks = {ti.task_id: (ti.state, ti.xcom_pull(task_ids=ti.task_id)) for ti in dag_run.get_task_instances()}
    return dag_run.state, tasks


def caught_up(state, job_id: str, producer, timeout: float = 240) -> None:
    wait_until(lambda: {p: o for (_, p), o in state.stored_offsets(job_id).items()}
               == dict(producer.produced.end_offsets), timeout, "the job to catch up",
               on_timeout=lambda: f"stored {state.stored_offsets(job_id)} vs {dict(producer.produced.end_offsets)}")


def deployed(dag, params: dict, state, job_id: str, producer) -> dict:
    """Run ``dag`` (the job's deploy DAG), which must succeed, and wait until the job has caught up with what
    ``producer`` sent; returns what its ``submit`` task returned (the run it started)."""
    status, tasks = run_dag(dag, params)
    assert status == "success", tasks
    caught_up(state, job_id, producer)
    return tasks["submit"][1]
