"""A real Spark standalone cluster on loopback: one master and one worker, started from the PySpark
wheel's own ``spark-class`` (no Spark installation), each in its own process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from stack.broker import free_port
from stack.jobs import SPARK_BIN, spark_env


def spark_home() -> Path:
    found = sorted((SPARK_BIN.parent / "lib").glob("python3*/site-packages/pyspark"))
    if not found:
        raise RuntimeError(f"no pyspark package under {SPARK_BIN.parent}; run make install")
    return found[0]


class StandaloneCluster:
    def __init__(self, log_dir: Path, cores: int = 2, memory: str = "1536m"):
        self.log_dir = log_dir
        self.port, self.ui_port, self.worker_ui_port = free_port(), free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.cores, self.memory = cores, memory
        self.processes: list[subprocess.Popen] = []

    def _start(self, name: str, *args: str) -> None:
        home = spark_home()
        env = {**spark_env(), "SPARK_HOME": str(home), "SPARK_LOCAL_DIRS": str(self.log_dir / f"{name}-local"),
               "SPARK_WORKER_DIR": str(self.log_dir / f"{name}-work")}
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            self.processes.append(subprocess.Popen([str(home / "bin" / "spark-class"), *args], stdout=log,
                                                   stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def start(self) -> StandaloneCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.ui_port))
        self._start("worker", "org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                    "--cores", str(self.cores), "--memory", self.memory, "--webui-port", str(self.worker_ui_port))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = self.state()
            if state and any(w["state"] == "ALIVE" for w in state.get("workers", [])):
                return self
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the standalone worker did not register within 120s; see {self.log_dir}")

    def state(self) -> dict | None:
        """The master's JSON status page: workers, running and completed applications."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as response:
                return json.load(response)
        except OSError:
            return None

    def stop(self) -> None:
        for process in reversed(self.processes):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(30)
