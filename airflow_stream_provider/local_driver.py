"""Start, find and end a detached Spark driver on this machine (local and client deploy mode).

The driver must outlive whoever started it (an Airflow task, a test), so it runs in a new session
(its own process group) with output going to a log file.  Killing the group takes down spark-submit's
JVM, the Python driver and its workers together: that is what "the driver died" means here.
Pure (no airflow, no pyspark): the Airflow driver hook and the test-suite share it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from airflow_stream_provider.spec import DATABASE_PASSWORD_ENV
from airflow_stream_provider.state.records import RunRecord


@dataclass(frozen=True)
class DriverProcess:
    pid: int  # also the process-group id: the driver leads its own session
    log_path: str
    run_id: str
    #: set only in the process that started the driver: it alone can collect the exit code
    popen: subprocess.Popen | None = field(default=None, compare=False, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return process_alive(self.pid)

    def exit_code(self) -> int | None:
        """The exit code once the driver ended, if this process started it; else None."""
        return self.popen.poll() if self.popen is not None else None

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"driver pid {self.pid} still running after {timeout:.0f}s (log: {self.log_path})"
                )
            time.sleep(0.1)
        return self.exit_code()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        signal_group(self.pid, sig)
        if sig == signal.SIGKILL and self.popen is not None:
            self.popen.wait(30)


def start_detached(
    cmd: Sequence[str],
    log_path: str,
    *,
    env: Mapping[str, str] | None = None,
    password: str | None = None,
    cwd: str | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` in a new session writing to ``log_path``; its pid is also its process-group id.

    The database password goes into the child's environment only, never into its arguments.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    if password:
        child_env[DATABASE_PASSWORD_ENV] = password
    with open(log_path, "ab") as log_file:
        # The spec never holds a password (validated), so the command line is safe to log.
        log_file.write(f"$ {shlex.join(cmd)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(
            list(cmd),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    return proc


#: Clock slack between a process's creation time and the moment its run was registered
PID_REUSE_SLACK_S = 2.0


def process_started(process: psutil.Process) -> float:
    """When ``process`` started, in ``time.time()``'s terms, to the clock tick.  Linux gives a process's
    start in ticks since boot; psutil's ``create_time`` adds the boot time that /proc/stat gives in whole
    seconds, which puts every start up to a second early, by an amount that differs from boot to boot (it
    was 0.95 s on one machine)."""
    try:
        with open(f"/proc/{process.pid}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux (or gone): psutil's, to the second
        return process.create_time()


def process_alive(pid: int, registered_at: float | None = None) -> bool:
    """True while the process exists and is not a zombie.  With ``registered_at`` (when the driver
    registered its run, after it started), a process created later is not the driver: the system
    reused the pid of a driver that is gone."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return registered_at is None or process_started(process) <= registered_at + PID_REUSE_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # it exists, owned by someone else: its start time is still readable
        return True


@functools.cache
def this_host() -> str:
    """This host as recorded beside a driver's pid: its name and, on Linux, a digest of its boot and of the
    process namespace its pids belong to.  Containers that share a hostname (host networking) number their
    processes apart, and so do two machines of one name: a pid recorded under another identity is never
    checked or signalled here, where the same number may be another process."""
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            where = f"{boot.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: the name alone, as it was
        return name
    return f"{name} ({hashlib.sha256(where.encode()).hexdigest()[:8]})"


def is_this_host(host: str | None) -> bool:
    """Whether a recorded host is this one.  A bare name, as earlier releases recorded, counts by its name."""
    return host is not None and host in (this_host(), socket.gethostname())


def on_this_host(pid: int | None, host: str | None, submission_id: str | None = None) -> bool:
    """Whether a recorded driver's process is one of this host's (not a cluster's, not another host's)."""
    return bool(pid) and is_this_host(host) and not submission_id


def alive_on_this_host(pid: int | None, host: str | None, started_at: float | None,
                       submission_id: str | None = None) -> bool | None:
    """The process check of a recorded driver (a run, a standby): True/False where it runs on this host,
    None elsewhere or on a cluster (only heartbeats can tell there)."""
    return process_alive(pid, started_at) if on_this_host(pid, host, submission_id) else None


def launch_alive(pid: int | None, host: str | None, started_at: float | None) -> bool | None:
    """The process check of a driver this provider started (before its run registers, or while a stop waits
    for it): True/False on the host that started it, None on any other (a triggerer or a worker elsewhere has
    only the run's row and the deadline).  A launch recorded without its host, by an earlier version, counts
    as this host's, as it did then."""
    return alive_on_this_host(pid, host or this_host(), started_at)


def run_alive(run: RunRecord | None) -> bool | None:
    """The process check of a recorded run's driver (see :func:`alive_on_this_host`); None without a run."""
    return alive_on_this_host(run.pid, run.host, run.started_at, run.submission_id) if run else None


def kill_unregistered(launch: Mapping[str, object], why: str, log) -> None:
    """Kill the driver of a launch whose run has not registered yet and is cancelled (a task that no longer
    wants it, ``StateStore.cancel_launch``): only its own host can, by the pid it started."""
    run_id, pid, host = launch["run_id"], launch.get("pid"), launch.get("host")
    if launch_alive(pid, host, launch.get("submitted_at")):
        log.warning("Killing the driver of run %s (pid %s) before it registered: %s", run_id, pid, why)
        signal_group(pid, signal.SIGKILL)
    elif pid:
        log.warning("Run %s (pid %s on %s) is not registered and cannot be killed from %s (%s): its launch is "
                    "cancelled, so it exits as it registers", run_id, pid, host, this_host(), why)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
