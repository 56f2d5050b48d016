"""A launch its task gave up on before the driver registered, where no kill reaches the driver: it runs on
another host than the task's (its wait timed out on a worker that did not start it), or its cluster manager
does not answer.  Before, the task logged that and went on (a rollback, a retry's fresh launch), and the
late driver could still register, take the job's epoch and fence the run started after it.  Now the launch
is cancelled in the state database and its run may not register: the late driver exits, 0, with the epoch
left to the newer run.

The late driver is the real one: the events job, started by spark-submit with the command the driver hook
builds, against SQLite and PostgreSQL.  "Another host" is the launch's recorded host name: a second machine
cannot run here, and only the host name decides that a kill cannot reach the driver."""

from __future__ import annotations

import logging
import time

import pytest

from airflow_stream_provider import jvm_archive, local_driver
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.controller import StreamJobController
from airflow_stream_provider.state.store import LaunchCancelled
from stack.jobs import EVENTS_JOB, REPO, make_spec, spark_env
from tests.dagtest import airflow as airflow_stack

JOB = "orders"


@pytest.fixture
def hook(monkeypatch, tmp_path):
    monkeypatch.setenv(*airflow_stack.connection_env("spark_local", conn_type="spark", host="local[1]",
                                                     extra={"deploy-mode": "client", "spark-binary": "spark-submit"}))
    hook = StreamDriverHook("spark_local", log_dir=str(tmp_path / "logs"), archive_dir=str(tmp_path / "archives"))
    hook.conf[jvm_archive.JAVA_OPTIONS] = "-Xshare:auto"  # no class archive to write for a driver that exits
    return hook


def _launch(run_id: str) -> dict:
    return {"job_id": JOB, "run_id": run_id, "pid": 4242, "host": "another-host", "submitted_at": time.time()}


def test_a_late_driver_whose_launch_was_cancelled_exits_without_the_jobs_epoch(state_store, database_url, hook,
                                                                               tmp_path, caplog):
    spec = make_spec(JOB, "127.0.0.1:9092", JOB, database_url, tmp_path / "ckpt")
    controller = StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(), driver=hook)
    with caplog.at_level(logging.WARNING):
        controller.abandon(_launch("late-run"), "its launch wait timed out")
    assert "its launch is cancelled" in caplog.text, caplog.text
    newer = state_store.begin_run(JOB, 1, "1.0").run_id  # the retry's fresh launch, registered since
    epoch = state_store.current_epoch(JOB)

    log_path = tmp_path / "late.log"
    cmd = hook.submit_command(EVENTS_JOB, spec, "late-run", str(log_path), env=spark_env())
    late = local_driver.start_detached(cmd, str(log_path), env=spark_env(), cwd=str(REPO))
    try:
        exit_code = late.wait(180)
    finally:
        local_driver.DriverProcess(late.pid, str(log_path), "late-run", late).kill()

    log = log_path.read_text(errors="replace")
    assert exit_code == 0, log[-3000:]
    assert "was cancelled before it registered (its launch wait timed out)" in log, log[-3000:]
    assert state_store.get_run("late-run") is None, "the cancelled run registered"
    assert state_store.current_epoch(JOB) == epoch and state_store.get_run(newer).epoch == epoch


def test_only_a_launch_not_registered_yet_is_cancelled_and_it_never_registers(state_store):
    registered = state_store.begin_run(JOB, 1, "1.0", host="another-host", pid=4242).run_id
    assert not state_store.cancel_launch(JOB, registered, "too late"), "a registered run cannot be cancelled"
    assert state_store.cancel_launch(JOB, "never-registered", "its task was killed")
    assert state_store.cancel_launch(JOB, "never-registered", "and again"), "cancelling twice is no error"
    with pytest.raises(LaunchCancelled, match="never-registered of job orders was cancelled before it registered "
                                              r"\(its task was killed\)"):
        state_store.begin_run(JOB, 1, "1.0", run_id="never-registered")
    assert state_store.current_epoch(JOB) == 1 and state_store.get_run("never-registered") is None
