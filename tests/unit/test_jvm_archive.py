"""The drivers' class-data-sharing archive: which archive, who writes it, when a deployment's own choice wins;
and the JIT's and the heap's startup settings (``jvm_jit``, ``jvm_heap``).

Real files and real processes throughout; the end-to-end test with real drivers is in
``tests/e2e/test_jvm_archive.py``.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from airflow_stream_provider import jvm_archive, jvm_heap, jvm_jit
from airflow_stream_provider.jvm_archive import ClassArchive


def _executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _env(tmp_path, spark_dir="spark-a"):
    spark = _executable(tmp_path / spark_dir / "spark-submit")
    java = _executable(tmp_path / "jdk" / "bin" / "java")
    return {"PATH": str(spark.parent), "JAVA_HOME": str(java.parent.parent)}


def test_one_archive_per_spark_and_java_installation(tmp_path):
    env = _env(tmp_path)
    first = ClassArchive.of(env, "spark-submit", {}, tmp_path / "archives")
    assert first == ClassArchive.of(env, "spark-submit", {}, tmp_path / "archives")
    assert first.path.parent == tmp_path / "archives" and first.path.suffix == ".jsa"
    other_spark = ClassArchive.of(_env(tmp_path, "spark-b"), "spark-submit", {}, tmp_path / "archives")
    other_classpath = ClassArchive.of(env, "spark-submit", {"spark.driver.extraClassPath": "/opt/x.jar"},
                                      tmp_path / "archives")
    assert len({first.path, other_spark.path, other_classpath.path}) == 3


def test_no_archive_without_spark_submit_or_java(tmp_path):
    env = _env(tmp_path)
    assert ClassArchive.of({**env, "PATH": str(tmp_path / "nowhere")}, "spark-submit", {}, tmp_path) is None
    assert ClassArchive.of({**env, "JAVA_HOME": str(tmp_path / "nojdk")}, "spark-submit", {}, tmp_path) is None


def test_a_deployments_own_class_data_sharing_is_left_alone():
    assert jvm_archive.chosen_by_user("-Xshare:off")
    assert jvm_archive.chosen_by_user("-XX:+UseG1GC -XX:SharedArchiveFile=/opt/app.jsa")
    assert not jvm_archive.chosen_by_user("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


def test_one_archive_run_at_a_time_and_no_retry_soon_after_a_failure(tmp_path):
    archive = ClassArchive(tmp_path / "archives" / "driver-x.jsa")
    written = archive.claim()
    assert written is not None and archive.lock.exists() and written.parent == archive.path.parent
    assert archive.claim() is None, "a second run while the first holds the lock"

    outcome = archive.finish_run(["sh", "-c", "exit 3"], written)
    assert "exit code 3" in outcome and str(archive.lock) in outcome
    assert not archive.ready() and archive.lock.exists()
    assert archive.claim() is None, "a failed run blocks another for an hour"

    old = time.time() - jvm_archive.RETRY_AFTER_S - 60
    os.utime(archive.lock, (old, old))
    assert archive.claim() is not None, "a stale lock does not block forever"


def test_a_finished_run_moves_its_archive_into_place(tmp_path):
    archive = ClassArchive(tmp_path / "driver-x.jsa")
    written = archive.claim()
    outcome = archive.finish_run(["sh", "-c", f"printf classes > {written}"], written)
    assert outcome == f"archive written: {archive.path}"
    assert archive.ready() and archive.path.read_text() == "classes"
    assert not written.exists() and not archive.lock.exists()
    assert archive.java_options("-XX:+UseSerialGC") == f"-XX:+UseSerialGC -XX:SharedArchiveFile={archive.path}"


def test_a_run_that_exits_0_without_an_archive_is_a_failure(tmp_path):
    archive = ClassArchive(tmp_path / "driver-x.jsa")
    written = archive.claim()
    assert "no archive" in archive.finish_run(["true"], written)
    assert not archive.ready() and archive.lock.exists()


def test_the_background_wrapper_runs_detached_and_reports(tmp_path):
    archive = ClassArchive(tmp_path / "driver-x.jsa")
    written = archive.claim()
    log = tmp_path / "warm-up.log"
    pid = archive.start_run(["sh", "-c", f"printf classes > {written}"], written, dict(os.environ), str(log))
    deadline = time.monotonic() + 30
    while not archive.ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert archive.ready(), log.read_text()
    assert os.getpgid(pid) == pid or not os.path.exists(f"/proc/{pid}")  # its own session
    deadline = time.monotonic() + 10
    while "archive written" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"archive written: {archive.path}" in log.read_text()
    assert sys.executable in log.read_text().splitlines()[0]


def test_c2_thresholds_are_raised_unless_the_options_shape_the_jit():
    assert jvm_jit.startup_options("") == " ".join(jvm_jit.OPTIONS)
    assert jvm_jit.startup_options("-Xss4m") == f"-Xss4m {' '.join(jvm_jit.OPTIONS)}"
    for own in ("-XX:TieredStopAtLevel=1", "-XX:-TieredCompilation", "-XX:Tier4InvocationThreshold=1", "-Xint",
                "-XX:CompileThreshold=100", "-XX:+UseJVMCICompiler",
                "-XX:+DontCompileHugeMethods"):
        assert jvm_jit.startup_options(f"-Xss4m {own}") == f"-Xss4m {own}"


def test_the_serial_collector_on_a_growing_heap_for_drivers_of_at_most_2_gb():
    small = " ".join(jvm_heap.SMALL_HEAP)
    assert jvm_heap.startup_options("", None) == small  # Spark's default driver memory, 1g
    for memory in ("768m", "2g", "2048", "1536M", "512mb"):
        assert jvm_heap.startup_options("-Xss4m", memory) == f"-Xss4m {small}", memory
    for memory in ("3g", "4096m", "1t", "lots"):
        assert jvm_heap.startup_options("-Xss4m", memory) == "-Xss4m", memory
    for own in ("-XX:+UseG1GC", "-XX:+UseParallelGC", "-XX:-UseSerialGC", "-XX:+UseZGC", "-Xms1g", "-Xmn64m",
                "-XX:InitialHeapSize=64m", "-XX:MaxHeapFreeRatio=20", "-XX:SurvivorRatio=8", "-XX:NewRatio=3"):
        assert jvm_heap.startup_options(f"-Xss4m {own}", "1g") == f"-Xss4m {own}", own
    assert jvm_heap.heap_mb("768m") == 768 and jvm_heap.heap_mb("2g") == 2048 and jvm_heap.heap_mb("1024") == 1024


def test_a_new_archive_removes_the_others_no_launch_has_used_for_two_weeks(tmp_path):
    """A Spark or Java upgrade (or a virtualenv built again) gets a new 170 MB archive: the one it replaced
    goes once it has gone unused, while another installation's archive still in use stays."""
    directory = tmp_path / "archives"
    stale = ClassArchive(directory / "driver-old.jsa")
    in_use = ClassArchive(directory / "driver-other.jsa")
    for other in (stale, in_use):
        directory.mkdir(exist_ok=True)
        other.path.write_text("classes")
        weeks_ago = time.time() - jvm_archive.UNUSED_FOR_S - 3600
        os.utime(other.path, (weeks_ago, weeks_ago))
    in_use.java_options("")  # a launch maps it: used today

    archive = ClassArchive(directory / "driver-new.jsa")
    written = archive.claim()
    outcome = archive.finish_run(["sh", "-c", f"printf classes > {written}"], written)
    assert outcome == f"archive written: {archive.path}; removed 1 unused for 14 days: driver-old.jsa"
    assert not stale.path.exists() and in_use.ready() and archive.ready()
