"""A driver's JVM ends with its Python driver, whatever threads are left in it: a driver that ended must not
hold its cores and memory (the fence watch ends a held-up driver's Python with the run's own exit code,
0 after a clean stop).  Real spark-submit and java, with the command the driver hook builds."""

from __future__ import annotations

import subprocess

import pytest

from airflow_stream_provider import jvm_archive, local_driver
from airflow_stream_provider.hooks.driver import EXIT_ON_MAIN_EXIT, StreamDriverHook
from stack.jobs import REPO, make_spec, spark_env, wait_until
from tests.dagtest import airflow as airflow_stack

APP = REPO / "tests" / "fixtures" / "jobs" / "leaves_a_jvm_thread.py"


@pytest.fixture
def hook(monkeypatch, tmp_path):
    monkeypatch.setenv(*airflow_stack.connection_env("spark_local", conn_type="spark", host="local[1]",
                                                     extra={"deploy-mode": "client", "spark-binary": "spark-submit"}))
    hook = StreamDriverHook("spark_local", log_dir=str(tmp_path / "logs"), archive_dir=str(tmp_path / "archives"))
    # The JVM's own class sharing, as a deployment may choose: no warm-up-only run to write the provider's
    # archive, whose JVM this fixture's job would keep alive until the warm-up's 10-minute timeout.
    hook.conf[jvm_archive.JAVA_OPTIONS] = "-Xshare:auto"
    return hook


def _run(hook, tmp_path) -> int | None:
    """The exit code of spark-submit 8 s after its Python driver exited (it takes about 1 s); None while it
    still runs."""
    spec = make_spec("orders", "127.0.0.1:9092", "orders", "sqlite:////tmp/x.db", tmp_path / "ckpt")
    log_path = tmp_path / "driver.log"
    cmd = hook.submit_command(str(APP), spec, "r1", str(log_path), env=spark_env())
    popen = local_driver.start_detached(cmd, str(log_path), env=spark_env(), cwd=str(REPO))
    try:
        wait_until(lambda: "exiting 0" in log_path.read_text(errors="replace"), 120, "the Python driver to exit",
                   on_timeout=lambda: log_path.read_text(errors="replace")[-3000:])
        return popen.wait(8)
    except subprocess.TimeoutExpired:
        return None
    finally:
        local_driver.DriverProcess(popen.pid, str(log_path), "r1", popen).kill()


def test_the_jvm_ends_when_the_python_driver_exits_0(hook, tmp_path):
    assert _run(hook, tmp_path) == 0, (tmp_path / "driver.log").read_text()[-3000:]


def test_a_deployment_may_keep_spark_submits_own_default(hook, tmp_path):
    """Spark's default, set back by the deployment's conf: the JVM outlives its driver (what the default
    above prevents; this also shows that the fixture leaves a thread that keeps the JVM alive)."""
    hook.conf[EXIT_ON_MAIN_EXIT] = "false"
    assert _run(hook, tmp_path) is None, "spark-submit ended by itself"
