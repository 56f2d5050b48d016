"""``make demo``: the main job's whole life, end to end, on the embedded default stack.

Local Spark (the driver is a real ``spark-submit`` process), SQLite for the results and state, a local
Kafka-protocol broker (Tansu), and Airflow with its own SQLite running the four DAGs of ``dags/``:

1. a producer writes events, about 1% of them malformed;
2. ``stream_deploy`` submits the job;
3. the driver is killed with SIGKILL in the middle of the stream;
4. ``stream_health`` sees it DEAD and recovers it from the checkpoint;
5. ``stream_upgrade`` moves to ``spark_jobs/events_job_v2.py``, whose checkpoint is incompatible:
   preflight, archive, new generation from the stored offsets;
6. ``stream_stop`` stops it gracefully.

The closing figures are read from the database and the broker, not from counters kept here.
Every process the demo starts is stopped at the end, also on failure.

    python -m demo [--events 6000] [--workdir .demo]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPIC = "events"
JOB_ID = "events"


def kill_driver(pid: int) -> None:
    """SIGKILL to the driver's whole process group (the JVM and the Python driver): a machine dying."""
    from airflow_stream_provider import local_driver

    try:
        local_driver.signal_group(os.getpgid(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def configure(workdir: Path, broker_port: int) -> dict:
    """Airflow's home, DAGs folder and connections; must happen before airflow is imported."""
    sys.path.insert(0, str(REPO))
    from tests.stack.jobs import TEST_SPARK_CONF, spark_env

    env = spark_env()
    os.environ.update(
        AIRFLOW_HOME=str(workdir / "airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
        PATH=env["PATH"],  # spark-submit of the driver environment
        AIRFLOW_CONN_STREAM_STATE_DEFAULT=json.dumps(
            {"conn_type": "stream_state", "extra": {"url": f"sqlite:///{workdir / 'stream.db'}"}}),
        AIRFLOW_CONN_STREAM_KAFKA_DEFAULT=json.dumps(
            {"conn_type": "stream_kafka", "host": "127.0.0.1", "port": broker_port}),
        AIRFLOW_CONN_SPARK_DEFAULT=json.dumps(
            {"conn_type": "spark", "host": "local[2]",
             "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}}),
    )
    return {
        "stream_job_spec": {"job_id": JOB_ID, "version": "1.0", "checkpoint_root": str(workdir / "checkpoints"),
                            "trigger_interval": "1 second", "heartbeat_seconds": 1.0,
                            "kafka": {"topics": [TOPIC], "source": "python", "max_offsets_per_trigger": 2000}},
        "stream_job_application": str(REPO / "spark_jobs" / "events_job.py"),
        "stream_spark_conf": TEST_SPARK_CONF,
        "stream_driver_env": {k: env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP")},
        "stream_driver_log_dir": str(workdir / "driver-logs"),
        "stream_reset_policy": "after_preflight",
    }


class Story:
    def __init__(self, workdir: Path, events: int):
        from tests.stack.broker import Broker

        self.workdir = workdir
        self.events = events
        self.broker = Broker(workdir / "tansu.log")

    # -- the stack ----------------------------------------------------------------------------------
    def start(self) -> None:
        say(f"starting the local Kafka-protocol broker (Tansu); work directory {self.workdir}")
        self.broker.start()
        variables = configure(self.workdir, self.broker.port)
        self.broker.create_topic(TOPIC, 3)
        say("migrating Airflow's metadata database (SQLite)")
        airflow = Path(sys.executable).parent / "airflow"
        subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, timeout=600)
        from airflow.models.variable import Variable

        for key, value in variables.items():
            Variable.set(key, value, serialize_json=not isinstance(value, str))
        from airflow.dag_processing.dagbag import DagBag

        sys.path.append(str(REPO / "dags"))  # as Airflow's BundleDagBag does for the DAGs' shared module
        bag = DagBag(str(REPO / "dags"))
        if bag.import_errors:
            raise RuntimeError(f"DAG import errors: {bag.import_errors}")
        self.dags = bag.dags
        from airflow_stream_provider.hooks.state import StreamStateHook
        from tests.stack.events import EventProducer

        self.state = StreamStateHook()
        self.producer = EventProducer(self.broker, TOPIC, seed=11)

    def stop(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            from tests.stack.dagruns import runs

            for run in runs(state, JOB_ID):
                if run["pid"] and run["status"] in ("STARTING", "RUNNING", "STOPPING"):
                    kill_driver(run["pid"])
            state.store.dispose()
        if getattr(self, "producer", None) is not None:
            self.producer.close()
        self.broker.stop()
        say("stopped every process the demo started")

    # -- steps ----------------------------------------------------------------------------------------
    def trigger(self, dag_id: str, **conf) -> dict:
        say(f"triggering {dag_id}" + (f" with {conf}" if conf else ""))
        started = time.monotonic()
        dag_run = self.dags[dag_id].test(run_conf=conf or None)
        tasks = {ti.task_id: (ti.state, ti.xcom_pull(task_ids=ti.task_id)) for ti in dag_run.get_task_instances()}
        say(f"{dag_id} ended {dag_run.state} in {time.monotonic() - started:.0f}s: "
            + ", ".join(f"{task}={task_state}" for task, (task_state, _) in sorted(tasks.items())))
        if dag_run.state != "success":
            raise RuntimeError(f"{dag_id} failed: {tasks}")
        return {task: value for task, (_, value) in tasks.items()}

    def produce(self, count: int) -> None:
        self.producer.send(count)
        say(f"produced {count} events (total {self.producer.sent})")

    def wait_caught_up(self, timeout: float = 300) -> None:
        end = {(TOPIC, p): o for p, o in self.producer.produced.end_offsets.items()}
        deadline = time.monotonic() + timeout
        last = -1
        while time.monotonic() < deadline:
            stored = self.state.stored_offsets(JOB_ID)
            done = sum(stored.get(tp, 0) for tp in end)
            if done != last:
                say(f"  applied through offset sum {done} of {sum(end.values())}")
                last = done
            if all(stored.get(tp, 0) >= offset for tp, offset in end.items()):
                return
            time.sleep(1)
        raise RuntimeError(f"the job did not catch up within {timeout:.0f}s")

    def run(self) -> None:
        first = self.events // 2
        self.produce(first)
        submitted = self.trigger("stream_deploy")["submit"]
        say(f"driver pid {submitted['pid']} runs generation {submitted['generation']}, epoch {submitted['epoch']}")
        self.wait_caught_up()

        self.produce(self.events // 6)
        time.sleep(2)  # let it start on the new records
        run = self.state.latest_run(JOB_ID)
        say(f"SIGKILL to the driver (pid {run['pid']}, run {run['run_id'][:12]}) in the middle of the stream")
        kill_driver(run["pid"])
        recovered = self.trigger("stream_health")
        say(f"stream_health saw {recovered['health']['health']}; recover: {recovered['recover']['action']} "
            f"(run {recovered['recover']['run_id'][:12]}, generation {recovered['recover']['generation']})")
        self.wait_caught_up()

        self.produce(self.events // 6)
        from tests.stack.events import Trickle

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
        with self.state.store.engine.connect() as conn:
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
        result = {"produced": produced, "applied": applied, "duplicates": duplicates, "lost": lost,
                  "dead_letters": dead, "recoveries": recoveries}
        print("\nRESULT " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6000, help="events to produce in all")
    parser.add_argument("--workdir", type=Path, default=REPO / ".demo", help="scratch directory (emptied)")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    story = Story(workdir, args.events)
    try:
        story.start()
        story.run()
        result = story.report()
    finally:
        story.stop()
    return 0 if result["duplicates"] == 0 and result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
