"""Process start times (``local_driver.process_started``, read by the startup line and the pid-reuse check):
the Linux kernel's, to the clock tick, in time.time()'s terms; and the startup line's phases.  A real child
process; nothing mocked."""

import subprocess
import sys
import time

import psutil

from airflow_stream_provider.local_driver import process_started
from airflow_stream_provider.runtime import startup


def test_a_process_start_is_read_to_the_clock_tick_not_to_the_boot_times_second():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        began = process_started(psutil.Process(child.pid))
        # psutil's create_time adds /proc/stat's boot time, whole seconds: up to a second early
        assert before - 0.05 <= began <= after + 0.05
    finally:
        child.kill()
        child.wait()


def test_the_clock_reports_this_process_and_no_jvm_under_plain_python():
    clock = startup.StartupClock()
    assert clock.jvm_started is None
    assert clock.python_started is not None and clock.python_started <= time.time()


def test_a_commit_before_the_query_started_does_not_end_the_start(caplog):
    """A killed run's write-behind batch, applied again before the query starts, commits first: the start
    goes on until the started query's first batch, and only then are the phases logged, in order."""
    caplog.set_level("INFO", logger="airflow_stream_provider.harness")
    clock = startup.StartupClock()
    for phase in ("state_database", "spark_session", "source"):
        clock.done(phase)
    clock.committed()  # the catch-up's commit
    assert "first_batch" not in clock.phases() and not clock.reported
    assert "startup" not in caplog.text
    clock.done("query_start")
    clock.committed()
    assert list(clock.phases()) == ["python", "state_database", "spark_session", "source", "query_start",
                                    "first_batch", "total"]
    assert clock.reported and caplog.text.count("startup {") == 1
    clock.committed()  # later batches change nothing
    assert caplog.text.count("startup {") == 1
