"""How the driver hook puts the class archive, the JIT's startup settings and the heap's on a driver's command line,
through a real Airflow Spark connection and the real spark-submit and java of the driver environment.  The archive run itself, with
real drivers, is ``tests/e2e/test_jvm_archive.py``."""

from __future__ import annotations

import pytest

from airflow_stream_provider import jvm_archive, jvm_heap, jvm_jit
from airflow_stream_provider.hooks.driver import StreamDriverHook
from stack.jobs import make_spec, spark_env
from tests.dagtest import airflow as airflow_stack


@pytest.fixture
def hook(monkeypatch, tmp_path):
    monkeypatch.setenv(*airflow_stack.connection_env("spark_local", conn_type="spark", host="local[2]",
                                                     extra={"deploy-mode": "client", "spark-binary": "spark-submit"}))
    return StreamDriverHook("spark_local", conf={"spark.driver.memory": "768m"}, log_dir=str(tmp_path / "logs"),
                            archive_dir=str(tmp_path / "archives"))


def _command(hook, tmp_path) -> str:
    spec = make_spec("orders", "127.0.0.1:9092", "orders", "sqlite:////tmp/x.db", tmp_path / "ckpt")
    return " ".join(hook.submit_command("job.py", spec, "r1", str(tmp_path / "r1.log"), env=spark_env()))


def _archive(hook) -> jvm_archive.ClassArchive:
    return jvm_archive.ClassArchive.of(spark_env(), "spark-submit", hook.conf, hook.archive_dir)


def test_an_archive_that_exists_is_mapped_into_the_driver(hook, tmp_path):
    archive = _archive(hook)
    archive.path.parent.mkdir(parents=True)
    archive.path.write_bytes(b"classes")
    jit, small_heap = " ".join(jvm_jit.OPTIONS), " ".join(jvm_heap.SMALL_HEAP)
    assert (f"spark.driver.extraJavaOptions={jit} {small_heap} -XX:SharedArchiveFile={archive.path}"
            in _command(hook, tmp_path))


def test_while_another_run_writes_it_the_driver_starts_without_one(hook, tmp_path):
    archive = _archive(hook)
    assert archive.claim() is not None  # the other run
    assert "SharedArchiveFile" not in _command(hook, tmp_path)
    assert not (tmp_path / "logs").exists(), "no second archive run"


def test_a_deployments_own_choice_and_cluster_mode_are_left_alone(hook, tmp_path, monkeypatch):
    archive = _archive(hook)
    archive.path.parent.mkdir(parents=True)
    archive.path.write_bytes(b"classes")
    hook.conf["spark.driver.extraJavaOptions"] = "-Xshare:off"
    assert (f"spark.driver.extraJavaOptions=-Xshare:off {' '.join(jvm_jit.OPTIONS)} {' '.join(jvm_heap.SMALL_HEAP)}"
            in _command(hook, tmp_path))
    assert "SharedArchiveFile" not in _command(hook, tmp_path)
    hook.conf.pop("spark.driver.extraJavaOptions")
    monkeypatch.setenv(*airflow_stack.connection_env("spark_local", conn_type="spark", host="yarn",
                                                     extra={"deploy-mode": "cluster"}))
    assert "SharedArchiveFile" not in _command(hook, tmp_path)


def test_an_unwritable_archive_directory_does_not_keep_a_driver_from_starting(hook, tmp_path):
    (tmp_path / "a-file").write_text("")
    hook.archive_dir = str(tmp_path / "a-file" / "archives")  # its parent is a file: no directory here
    assert "SharedArchiveFile" not in _command(hook, tmp_path)


def test_c2_waits_for_hot_code_unless_the_deployment_shapes_the_jit(hook, tmp_path, monkeypatch):
    """The JIT's startup settings come with every driver, in cluster mode too (nothing about them is
    local); Java options that set the JIT's behaviour themselves keep it."""
    assert all(flag in _command(hook, tmp_path) for flag in jvm_jit.OPTIONS)
    hook.conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    command = _command(hook, tmp_path)
    assert "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC" in command
    assert "Tier4" not in command and "HugeMethods" not in command
    hook.conf.pop("spark.driver.extraJavaOptions")
    monkeypatch.setenv(*airflow_stack.connection_env("spark_local", conn_type="spark", host="yarn",
                                                     extra={"deploy-mode": "cluster"}))
    assert all(flag in _command(hook, tmp_path) for flag in jvm_jit.OPTIONS)


def test_small_drivers_get_the_serial_collector_unless_the_deployment_chose(hook, tmp_path):
    """The heap settings come with drivers of at most 2 GB (768m here); a bigger driver, or Java options that
    choose the collector or the starting heap, keep the JVM's own."""
    assert all(flag in _command(hook, tmp_path) for flag in jvm_heap.SMALL_HEAP)
    hook.conf["spark.driver.memory"] = "4g"
    assert "UseSerialGC" not in _command(hook, tmp_path)
    hook.conf["spark.driver.memory"] = "1g"
    hook.conf["spark.driver.extraJavaOptions"] = "-XX:+UseG1GC"
    command = _command(hook, tmp_path)
    assert "UseSerialGC" not in command and "-Xms32m" not in command
