"""The cold start as it was before its cuts: drivers of the code at ``BEFORE`` (the commit whose benchmark
figures the cold-start work set out from: ``cold_start_s`` 26.1 s), started on this machine beside today's.

The old code runs from a copy of that commit (``git archive``) in a process of its own, so nothing of
today's package is imported with it: this file is that process's program, and ``BeforeDriver`` is the
benchmark's handle on it.  The old driver gets the old package on its ``PYTHONPATH``, the JVM's own class
sharing (``-Xshare:auto``) and a Spark whose Python zips hold only sources, as it had then.  The Spark
environment's packages are today's (the same Spark, pyarrow and kafka-python; no pandas, which the old
code did not use), so if anything the old start is measured a little faster than it was.

The process reads one command a line and answers one JSON line:

* ``backlog {"0": offset, ...}``: a driver applies everything up to those end offsets and stops (the
  checkpoint every timed start resumes from);
* ``start``: spawns a driver; answers with the seconds from spawn to its first committed batch;
* ``finish {"0": offset, ...}``: that driver catches up and stops gracefully;
* ``exit``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: The commit the cold-start work started from (its results: benchmarks/results/latest.md of that day).
BEFORE = "e5740bb"


class BeforeDriver:
    """The process that starts drivers of the old code for one job (topic, state database, checkpoint)."""

    def __init__(self, repo: Path, workdir: Path, *, python: str, spark_bin: Path, job: dict,
                 conf: dict[str, str], env: dict[str, str]):
        tree = workdir / f"code-{BEFORE}"
        if not tree.exists():
            tree.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(repo), "archive", BEFORE], capture_output=True, check=True)
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(tree, filter="data")
        self.process = subprocess.Popen(
            [python, __file__, str(tree), json.dumps(job), json.dumps(conf), json.dumps(env)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(tree),
            env={**os.environ, "STREAM_SPARK_BIN": str(spark_bin)})

    def ask(self, command: str, argument: object = None) -> dict:
        line = command if argument is None else f"{command} {json.dumps(argument)}"
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the {BEFORE} driver process ended on {command!r} (exit {self.process.wait()})")
        found = json.loads(answer)
        if "error" in found:
            raise RuntimeError(f"{BEFORE} driver, {command}: {found['error']}")
        return found

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("exit\n")
            self.process.stdin.flush()
            self.process.wait(60)


def _serve(tree: str, job: dict, conf: dict[str, str], env: dict[str, str]) -> None:
    """The old code's side: its own spec, state store and job runner, driven a command at a time."""
    sys.path.insert(0, tree)
    from sqlalchemy import func, select
    from tests.stack.jobs import JobRunner, make_spec

    from airflow_stream_provider.state import schema

    spec = make_spec(job["job_id"], job["bootstrap"], job["topic"], job["database_url"],
                     Path(job["checkpoints"]), trigger_interval="1 second", max_offsets_per_trigger=2000)
    runner = JobRunner(spec, Path(job["logs"]), conf=conf)
    env = {**env, "PYTHONPATH": tree}  # the driver and its Python workers import the old package
    driver = None

    def first_commit(run_id: str, after: float) -> float | None:
        with runner.store.engine.connect() as conn:
            return conn.execute(select(func.min(schema.batches.c.committed_at)).where(
                schema.batches.c.run_id == run_id, schema.batches.c.committed_at > after)).scalar()

    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        try:
            if command == "exit":
                break
            if command == "backlog":
                runner.process_backlog({int(p): o for p, o in json.loads(argument).items()})
                answer = {}
            elif command == "start":
                spawned = time.time()
                driver = runner.start(env=env)
                deadline = time.monotonic() + 300
                while (committed := first_commit(driver.run_id, spawned)) is None:
                    if time.monotonic() > deadline or not driver.alive():
                        raise RuntimeError(f"no first batch\n{runner.log_tail(driver)}")
                    time.sleep(0.1)
                answer = {"seconds": committed - spawned, "log": driver.log_path}
            elif command == "finish":
                runner.wait_caught_up({int(p): o for p, o in json.loads(argument).items()}, driver)
                code = runner.stop(driver)
                if code != 0:
                    raise RuntimeError(f"graceful stop ended with {code}\n{runner.log_tail(driver)}")
                answer = {}
            else:
                answer = {"error": f"unknown command {command!r}"}
        except Exception as err:  # the benchmark reports it and stops
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)
    runner.kill_all()
    runner.store.dispose()


if __name__ == "__main__":
    _serve(sys.argv[1], *(json.loads(arg) for arg in sys.argv[2:]))
