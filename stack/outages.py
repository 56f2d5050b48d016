"""Dependencies a test can take away and give back: a Kafka-protocol proxy in front of the session broker,
and a PostgreSQL server of the test's own.

Both are real: the proxy is Tansu's own ``proxy`` command (the job's clients speak Kafka to it, it forwards
to the broker, and killing it cuts every connection while the broker keeps every record), the database
is a PostgreSQL cluster made with ``initdb`` and stopped with ``pg_ctl stop -m immediate`` (a crash: open
transactions are lost, exactly as when the server or its host dies).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import closing
from pathlib import Path

import psycopg

from stack.broker import free_port, tansu_binary


def _wait_listening(port: int, timeout: float, process: subprocess.Popen | None, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with closing(socket.create_connection(("127.0.0.1", port), timeout=0.5)):
                return
        except OSError:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}") from None
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


class KafkaProxy:
    """``tansu proxy`` on its own port, forwarding to ``origin``.  It advertises itself in metadata, so a
    client bootstrapped through it sends everything through it.  Restarted on the same port."""

    def __init__(self, origin: str, log_path: Path):
        self.origin = origin
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> KafkaProxy:
        url = f"tcp://127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [tansu_binary(), "proxy", "--listener-url", url, "--advertised-listener-url", url,
                 "--origin-url", f"tcp://{self.origin}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_listening(self.port, 30, self.process, f"the Kafka proxy (log {self.log_path})")
        return self

    def stop(self) -> None:
        """Kill it: every open connection of the job's clients drops at once."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _postgres_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found and shutil.which("initdb"):
        found = [shutil.which("initdb")]
    if not found:
        raise RuntimeError("initdb not found (/usr/lib/postgresql/*/bin): install the PostgreSQL server package")
    return Path(found[-1]).parent


class PostgresServer:
    """A PostgreSQL cluster of the test's own on a free port, trust auth on loopback, user ``postgres``.

    PostgreSQL refuses to run as root, so when the tests run as root the cluster belongs to the
    ``postgres`` system user and its commands run through ``runuser``; its directory is made with
    ``mkdtemp`` (pytest's tmp_path lies under a root-only directory the ``postgres`` user cannot enter).
    """

    def __init__(self):
        self.bin = _postgres_bin()
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.root = Path(tempfile.mkdtemp(prefix="stream-pg-"))
        self.data = self.root / "data"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str, timeout: float = 120, check: bool = True) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.root)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def init(self) -> PostgresServer:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        return self.start()

    def start(self) -> PostgresServer:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "server.log"), "-w",
                  "-o", options, "start")
        return self

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: the server quits without a checkpoint or a goodbye; open
        transactions are rolled back by crash recovery at the next start."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def running(self) -> bool:
        try:
            with psycopg.connect(self.dsn, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def destroy(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
