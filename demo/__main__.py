"""``make demo``: the main job's whole life, end to end, on the embedded default stack, under a real
Airflow.

Local Spark (the driver is a real ``spark-submit`` process), SQLite for the results and state, a local
Kafka-protocol broker (Tansu), and a real Airflow 3 (scheduler, triggerer, dag-processor and api-server
as separate processes on free loopback ports, LocalExecutor, its own SQLite) running the four DAGs of
``dags/``:

1. a producer writes events, about 1% of them malformed;
2. ``stream_deploy`` is triggered through Airflow's REST API and submits the job;
3. the driver is killed with SIGKILL in the middle of the stream, and again right after it was
   repaired: the always-on watcher in the triggerer reports it, ``stream_health`` runs on that event
   and restarts the job from its checkpoint.  The demo only observes, and prints the time from each
   kill to the job processing again;
4. ``stream_upgrade`` moves to ``spark_jobs/events_job_v2.py``, whose checkpoint is incompatible:
   preflight, archive, new generation from the stored offsets;
5. ``stream_stop`` stops it gracefully.

The closing figures are read from the database and the broker, not from counters kept here.  Every
process the demo starts is stopped at the end, also on failure, unless ``--keep`` asks to leave the
stack running for a look around (the UI address and login are printed).

    python -m demo [--events 6000] [--workdir .demo] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPIC = "events"
JOB_ID = "events"


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Story:
    def __init__(self, workdir: Path, events: int):
        sys.path.insert(0, str(REPO))
        from stack.broker import Broker

        self.workdir = workdir
        self.events = events
        self.broker = Broker(workdir / "tansu.log")
        self.deployment = None
        self.kills: list[float] = []

    # -- the stack ----------------------------------------------------------------------------------
    def start(self) -> None:
        from stack.deployment import StreamDeployment
        from stack.events import EventProducer

        say(f"starting the local Kafka-protocol broker (Tansu); work directory {self.workdir}")
        self.broker.start()
        say(f"broker at {self.broker.bootstrap}")
        self.broker.create_topic(TOPIC, 3)
        self.deployment = StreamDeployment(self.workdir, self.broker, JOB_ID, TOPIC)
        say("starting Airflow: scheduler, triggerer, dag-processor, api-server (LocalExecutor, SQLite)")
        started = time.monotonic()
        self.deployment.start()
        say(f"Airflow is up at {self.deployment.airflow.url} after {time.monotonic() - started:.0f}s; "
            "the four DAGs are parsed and unpaused")
        self.store = self.deployment.store
        self.producer = EventProducer(self.broker, TOPIC, seed=11)

    def stop(self, keep: bool) -> None:
        if keep and self.deployment is not None:
            user, password = self.deployment.airflow.login()
            say(f"--keep: the stack stays up. Airflow UI: {self.deployment.airflow.url}  login: {user} / "
                f"{password}")
            say(f"stop everything with: python -m demo --stop --workdir {self.workdir}")
            (self.workdir / "broker.pid").write_text(str(self.broker.process.pid))
            return
        if getattr(self, "producer", None) is not None:
            self.producer.close()
        if self.deployment is not None:
            self.deployment.stop()
        self.broker.stop()
        say("stopped every process the demo started")

    # -- steps ----------------------------------------------------------------------------------------
    def trigger(self, dag_id: str, **conf) -> dict:
        say(f"triggering {dag_id} through the REST API" + (f" with {conf}" if conf else ""))
        started = time.monotonic()
        tasks = self.deployment.trigger(dag_id, **conf)
        state, run_id = tasks.pop("_run")
        say(f"{dag_id} ended {state} in {time.monotonic() - started:.0f}s: "
            + ", ".join(f"{task}={task_state}" for task, (task_state, _) in sorted(tasks.items())))
        if state != "success":
            raise RuntimeError(f"{dag_id} failed: {tasks}\n{self.deployment.explain(dag_id, run_id)}")
        return {task: value for task, (_, value) in tasks.items()}

    def produce(self, count: int) -> None:
        self.producer.send(count)
        say(f"produced {count} events (total {self.producer.sent})")

    def wait_caught_up(self, timeout: float = 300) -> None:
        self.deployment.wait_caught_up(self.producer.produced, timeout, progress=say)

    def kill_and_watch(self, when: str) -> None:
        """SIGKILL the live driver; Airflow alone must notice and repair it.  Report what it did."""
        from stack.deployment import kill_driver
        from stack.events import Trickle

        with Trickle(self.producer, chunk=10, pause_s=0.5):  # a live topic: "processing" is a committed batch
            victim = self.deployment.processing()
            killed_at = time.time()
            say(f"SIGKILL to the driver (pid {victim['pid']}, run {victim['run_id'][:12]}) {when}")
            kill_driver(victim["pid"])
            recovered = self.deployment.processing(timeout=300, other_than=victim["run_id"], after=killed_at)
        seconds = recovered["committed_at"] - killed_at
        self.kills.append(seconds)
        # recover names the run it started once that run's first batch is over
        runs = [r for r in self.deployment.repairs(recovered["run_id"], since=killed_at - 5)
                if r["run_type"] == "asset_triggered"]
        if runs:
            run_id = runs[0]["dag_run_id"]
            recover = self.deployment.tasks("stream_health", run_id).get("recover", (None, {}))[1] or {}
            found = self.deployment.airflow.xcom("stream_health", run_id, "diagnose", key="diagnosis") or {}
            say(f"stream_health ran on the watcher's event and saw {found.get('health')}; recover: "
                f"{recover.get('action')} (run {str(recover.get('run_id'))[:12]}, generation {recover.get('generation')})")
        say(f"processing again {seconds:.1f}s after the kill (run {recovered['run_id'][:12]})")

    def run(self) -> None:
        first = self.events // 2
        self.produce(first)
        submitted = self.trigger("stream_deploy")["submit"]
        say(f"driver pid {submitted['pid']} runs generation {submitted['generation']}, epoch {submitted['epoch']}")
        self.wait_caught_up()

        self.kill_and_watch("in the middle of the stream")
        time.sleep(10)
        self.kill_and_watch("10 s after it was repaired")
        self.wait_caught_up()

        self.produce(self.events // 6)
        from stack.events import Trickle

        with Trickle(self.producer, chunk=20, pause_s=1.0):  # a live topic keeps flowing during the upgrade
            upgraded = self.trigger("stream_upgrade", application=str(REPO / "spark_jobs" / "events_job_v2.py"),
                                    version="2.0")["upgrade"]
        preflight = upgraded["preflight"]
        say(f"preflight: {preflight['verdict']} ({preflight['error_class']}) in {preflight['seconds']}s; "
            f"{upgraded['action']}: generation {upgraded.get('archived_generation')} archived to "
            f"{upgraded.get('archive_path')}, generation {upgraded['generation']} resumed from "
            f"{upgraded.get('starting_offsets')}")
        self.produce(max(0, self.events - self.producer.sent))
        self.wait_caught_up()
        stopped = self.trigger("stream_stop")["stop"]
        say(f"stream_stop: {stopped['outcome']} in {stopped['seconds']}s (exit code {stopped['exit_code']})")

    # -- the figures, from the database and the broker -------------------------------------------------
    def report(self) -> dict[str, int]:
        from sqlalchemy import text

        from airflow_stream_provider import kafka_client

        consumer = kafka_client.new_consumer(self.broker.bootstrap, {})
        try:
            _, latest = kafka_client.watermarks(consumer, [TOPIC])
        finally:
            consumer.close()
        produced = sum(latest.values())
        with self.store.engine.connect() as conn:
            def one(sql: str) -> int:
                return int(conn.execute(text(sql), {"job": JOB_ID}).scalar() or 0)

            applied = one("SELECT COUNT(*) FROM events")
            dead = one("SELECT COUNT(*) FROM dead_letters WHERE job_id = :job")
            counted = one("SELECT SUM(event_count) FROM kpi_minute")
            ledger = conn.execute(text(
                "SELECT partition, start_offset, end_offset, rows_read FROM stream_batches "
                "ORDER BY partition, start_offset")).all()
            recoveries = one("SELECT COUNT(*) FROM stream_restarts WHERE job_id = :job")
            runs = conn.execute(text(
                "SELECT version, generation, status, exit_code, failure_kind FROM stream_runs "
                "WHERE dry_run = 0 ORDER BY started_at")).all()
        covered, overlap, position = 0, 0, {}
        for partition, start, end, _ in ledger:
            overlap += max(0, position.get(partition, 0) - start)
            covered += end - max(start, position.get(partition, 0))
            position[partition] = max(position.get(partition, 0), end)
        duplicates = overlap + max(0, counted - applied) + max(0, applied + dead - produced)
        lost = max(0, produced - covered) + max(0, produced - applied - dead)
        print("\nruns (version, generation, status, exit code, failure):")
        for row in runs:
            print(f"  {row.version:<5} gen {row.generation}  {row.status:<8} exit {row.exit_code}  {row.failure_kind or ''}")
        print(f"\n{'produced (Kafka end offsets)':<34}{produced:>8}")
        for name, value in [("applied (rows in events)", applied), ("dead letters", dead),
                            ("events counted in kpi_minute", counted), ("ledger batches", len(ledger)),
                            ("recoveries (restart/reset)", recoveries),
                            ("malformed records produced", len(self.producer.produced.malformed))]:
            print(f"{name:<34}{value:>8}")
        kills = ", ".join(f"{seconds:.1f}s" for seconds in self.kills)
        print(f"{'kill -9 -> processing again':<34}{kills:>8}")
        result = {"produced": produced, "applied": applied, "duplicates": duplicates, "lost": lost,
                  "dead_letters": dead, "recoveries": recoveries}
        print("\nRESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        return result


def stop_leftovers(workdir: Path) -> int:
    """Stop what a demo run with ``--keep`` left in ``workdir``: Airflow's components and the tasks they
    started, the drivers (their command line names the work directory) and the broker."""
    import os
    import signal

    import psutil

    sys.path.insert(0, str(REPO))
    from stack.real_airflow import stop_left_running

    stopped = stop_left_running(workdir / "airflow")
    groups = set()
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(workdir) in part for part in process.info["cmdline"] or []):
                groups.add(os.getpgid(process.pid))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    groups.discard(os.getpgrp())  # this demo, and whatever started it
    broker = workdir / "broker.pid"
    if broker.exists():
        try:
            os.kill(int(broker.read_text()), signal.SIGKILL)
            stopped += 1
        except ProcessLookupError:
            pass
        broker.unlink()
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return stopped + len(groups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6000, help="events to produce in all")
    parser.add_argument("--workdir", type=Path, default=REPO / ".demo", help="scratch directory (emptied)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the stack running at the end and print the Airflow UI address and login")
    parser.add_argument("--stop", action="store_true", help="stop what an earlier --keep left running, and exit")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    if args.stop:
        say(f"stopped {stop_leftovers(workdir)} process groups of the demo in {workdir}")
        return 0
    stop_leftovers(workdir)  # a kept stack of an earlier run
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    story = Story(workdir, args.events)
    result = None
    try:
        story.start()
        story.run()
        result = story.report()
    finally:
        story.stop(keep=args.keep)
    return 0 if result["duplicates"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
