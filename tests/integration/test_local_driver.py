"""The local process check the sensors, triggers and operators rely on: a dead driver, a zombie, and a
pid the system handed to a newer process are all "not alive", and none of them is signalled; a pid recorded
in another process namespace under this host's name is not this host's to check or signal."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from airflow_stream_provider import local_driver
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.local_driver import process_alive, process_started
from airflow_stream_provider.state.records import RunRecord


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


def _run(pid: int, started_at: float) -> RunRecord:
    return RunRecord(run_id="r1", job_id="job", epoch=1, generation=1, status="RUNNING", pid=pid,
                     host=socket.gethostname(), started_at=started_at, heartbeat_at=started_at)


def test_a_stop_or_kill_never_signals_a_process_that_took_a_gone_drivers_pid():
    """A run left active by a lost task, on a host whose pids went round (or that restarted): its pid now
    belongs to an unrelated process, in a group of its own.  The kill reports the driver gone and signals
    nothing, instead of killing that process's whole group."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        created = process_started(psutil.Process(other.pid))
        hook = StreamDriverHook()
        stale = _run(other.pid, started_at=created - 600)  # registered ten minutes before that process began
        assert hook.terminate(stale) is False
        killed = hook.kill(stale)
        assert killed.done and "is gone, or is another process's now" in killed.message, killed
        time.sleep(0.2)
        assert other.poll() is None, "the unrelated process was signalled"
        # the same pid, registered by the process that holds it: the driver, killed with its group
        assert hook.kill(_run(other.pid, started_at=created + 1)).message.startswith("killed process group")
        assert other.wait(10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


def _in_a_process_namespace_of_its_own(code: str) -> str:
    """What ``code`` prints, run as pid 1 of a new pid namespace (as in a container that shares this host's
    name through host networking): as root, or else in a user namespace of its own."""
    refused = ""
    for unshare in (["unshare", "--pid", "--fork", "--mount-proc"],
                    ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        try:
            done = subprocess.run([*unshare, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            pytest.skip("no unshare(1) here to start a process in a pid namespace of its own")
        if done.returncode == 0:
            return done.stdout
        refused = done.stderr.strip()
    pytest.skip(f"this machine refuses a pid namespace of its own: {refused}")


def test_a_pid_recorded_in_another_process_namespace_under_this_hosts_name_is_not_checked_or_signalled():
    """A driver started in a container that shares this host's name numbers its processes apart: its pid 1
    here is another process.  It records another identity, so its run is judged by its heartbeat alone and
    no signal is sent from here."""
    pid, host = _in_a_process_namespace_of_its_own(
        "import os; from airflow_stream_provider.local_driver import this_host; print(os.getpid()); "
        "print(this_host())").splitlines()[:2]
    assert host.startswith(f"{socket.gethostname()} (") and host != local_driver.this_host(), host
    run = replace(_run(int(pid), started_at=time.time()), host=host)
    assert not local_driver.is_this_host(host)
    assert local_driver.run_alive(run) is None  # another host's, as far as pids go: its heartbeat decides
    hook = StreamDriverHook()
    assert hook.terminate(run) is False
    killed = hook.kill(run)
    assert not killed.done and f"it runs on {host}" in killed.message, killed
    # By its name alone, as earlier releases recorded a host, this namespace's own pid 1 (older than any
    # run) would pass for that driver, and a kill would signal its group.
    assert local_driver.run_alive(replace(run, host=socket.gethostname())) is True
