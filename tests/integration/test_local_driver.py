"""The local process check the sensors, triggers and operators rely on: a dead driver, a zombie, and a
pid the system handed to a newer process are all "not alive"."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from airflow_stream_provider.local_driver import process_alive, process_started


def test_a_pid_reused_by_a_newer_process_is_not_the_driver():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = process_started(psutil.Process(process.pid))
        assert process_alive(process.pid)
        assert process_alive(process.pid, registered_at=created + 1)  # registered once it ran: the driver
        # The run registered a minute before this process existed: its driver had this pid, and is gone.
        assert not process_alive(process.pid, registered_at=created - 60)
    finally:
        process.kill()
        process.wait()
    assert not process_alive(process.pid)


def test_a_zombie_is_not_alive():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped yet
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    try:
        assert not process_alive(process.pid, registered_at=time.time())
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
