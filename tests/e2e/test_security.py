"""The state database's password, and a Kafka client secret given in the spec, travel only in the driver's
environment: never in process arguments (``ps``), task logs, driver logs, XCom or the recorded spec.

``dag.test()`` writes the task logs to this process's standard output, where ``capfd`` reads them; the
test first checks that it really has the deploy and stop tasks' log lines, then that the password is in
none of them.

A real PostgreSQL database, a real Airflow connection holding a password, a real driver started
through the deploy DAG.  The local server trusts loopback connections, so the password is not what
lets the driver in; it travels the same way it does in production, and what is checked is where it
shows up.
"""

from __future__ import annotations

import json
import uuid

import psutil
from sqlalchemy import select

from airflow_stream_provider.state import schema
from stack.events import EventProducer
from tests.dags import provider_scenarios as dags
from tests.dagtest import airflow as airflow_stack
from tests.dagtest.dagruns import caught_up, run_dag


def test_database_password_never_leaks(postgres_url, stream, broker, monkeypatch, capfd, caplog):
    secret = f"S3cret-{uuid.uuid4().hex}"
    database = postgres_url.rsplit("/", 1)[1]
    monkeypatch.setenv(*airflow_stack.connection_env(
        "stream_state_default", conn_type="stream_state", host="127.0.0.1", port=5432, schema=database,
        login="postgres", password=secret))
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    # A key password: kafka-python uses it only with SSL, so on this plaintext broker it travels and is unused.
    kafka_secret = f"K3y-{uuid.uuid4().hex}"
    params["spec"]["kafka"] = {**params["spec"].get("kafka", {}), "client_options": {"ssl.password": kafka_secret}}
    state.__dict__.pop("credentials", None)
    state.__dict__.pop("store", None)
    producer = EventProducer(broker, stream["topic"])
    producer.send(500)

    status, tasks = run_dag(dags.deploy, params)
    assert status == "success", tasks
    caught_up(state, job_id, producer)
    arguments = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    driver = [a for a in arguments if job_id in a and "--spec" in a]
    assert driver, "the driver's command line should be visible to ps"
    assert not [a for a in arguments if secret in a], "the password is in a process's arguments"
    assert not [a for a in arguments if kafka_secret in a], "the Kafka secret is in a process's arguments"
    driver_env = psutil.Process(state.latest_run(job_id).pid).environ()  # where the driver reads it
    assert json.loads(driver_env["STREAM_KAFKA_SECRETS"]) == {"ssl.password": kafka_secret}
    status, stopped = run_dag(dags.stop, params)
    assert status == "success", stopped

    assert secret not in json.dumps([tasks, stopped], default=str), "the password is in an XCom"
    assert kafka_secret not in json.dumps([tasks, stopped], default=str), "the Kafka secret is in an XCom"
    captured = capfd.readouterr()
    task_logs = caplog.text + captured.out + captured.err
    submitted = tasks["submit"][1]
    assert f"run {submitted['run_id']} is running" in task_logs, "the deploy task's log was not captured"
    assert f"Job {job_id} run {submitted['run_id']} stopped" in task_logs, "the stop task's log was not captured"
    assert secret not in task_logs and kafka_secret not in task_logs, "a secret is in a task log"
    for path in (stream["tmp"] / "driver-logs").rglob("*.log"):
        assert secret not in path.read_text(errors="replace"), f"the password is in {path}"
        assert kafka_secret not in path.read_text(errors="replace"), f"the Kafka secret is in {path}"
    with state.store.engine.connect() as conn:
        recorded = conn.execute(select(schema.runs.c.spec, schema.runs.c.termination_message)).all()
    assert recorded and all(secret not in (row.spec or "") + (row.termination_message or "") for row in recorded)
    assert all(kafka_secret not in (row.spec or "") for row in recorded)
