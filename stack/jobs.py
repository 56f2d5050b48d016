"""Run the example job as real, separate driver processes and check its results in the database."""

from __future__ import annotations

import functools
import json
import os
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select, text

from airflow_stream_provider import local_driver
from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.records import RunRecord
from airflow_stream_provider.state.store import StateStore

REPO = Path(__file__).resolve().parents[1]
EVENTS_JOB = str(REPO / "spark_jobs" / "events_job.py")
SPARK_BIN = Path(os.environ.get("STREAM_SPARK_BIN", REPO / ".venv-spark" / "bin"))
#: Packages that some test jobs' own code needs (pandas, for applyInPandasWithState), installed apart from
#: the runtime's environment (``make install``): such a job's drivers get it on their PYTHONPATH.
JOB_DEPS = SPARK_BIN.parent / "job-deps"
#: Test drivers live for seconds to minutes on 2 shared cores: the JVM's quick (C1-only) JIT and serial
#: GC cut a driver's CPU from spawn to caught up by about 40% (46 -> 29 CPU-seconds for 3,000 events).
#: A long-running production driver wants the default tiered JIT; the benchmarks use JVM defaults.
#: The Spark connection the stack's drivers are built with (set in this process's environment).
STACK_SPARK_CONN = "stream_stack_spark"
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
TEST_SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.driver.memory": "768m",
    "spark.python.worker.reuse": "true",
    "spark.driver.extraJavaOptions": FAST_JVM,
    "spark.executor.extraJavaOptions": FAST_JVM,
}


def spark_env() -> dict[str, str]:
    """Environment for a driver: the Spark venv's Python on both driver and workers."""
    python = str(SPARK_BIN / "python")
    env = dict(os.environ)
    env.update(PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python, PATH=f"{SPARK_BIN}:{env.get('PATH', '')}",
               SPARK_LOCAL_IP="127.0.0.1")  # tests talk to loopback only
    env.pop("SPARK_HOME", None)
    return env


def make_spec(
    job_id: str, bootstrap: str, topic: str, database_url: str, checkpoint_root: Path, **overrides
) -> StreamJobSpec:
    kafka = KafkaSpec(
        bootstrap_servers=bootstrap,
        topics=(topic,),
        source="python",
        max_offsets_per_trigger=overrides.pop("max_offsets_per_trigger", 1500),
    )
    return StreamJobSpec(
        job_id=job_id,
        version=overrides.pop("version", "1.0"),
        kafka=kafka,
        checkpoint_root=str(checkpoint_root),
        database_url=database_url,
        trigger_interval=overrides.pop("trigger_interval", "500 milliseconds"),
        heartbeat_seconds=overrides.pop("heartbeat_seconds", 1.0),
        **overrides,
    ).validate()


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.2,
    on_timeout: Callable[[], str] | None = None,
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    detail = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{detail}")


class JobRunner:
    """Starts drivers for one job spec and knows where their logs are."""

    def __init__(self, spec: StreamJobSpec, log_dir: Path, application: str = EVENTS_JOB,
                 conf: dict[str, str] | None = None):
        self.spec = spec
        self.log_dir = log_dir
        self.application = application
        self.conf = TEST_SPARK_CONF if conf is None else conf
        self.store = StateStore.from_url(spec.database_url)
        self.store.ensure_schema()
        self.drivers: list[local_driver.DriverProcess] = []

    @functools.cached_property
    def driver_hook(self):
        """The provider's own driver hook over a local-mode Spark connection: the command a test driver runs
        is built exactly as production builds it (``StreamDriverHook.submit_command``)."""
        from airflow_stream_provider.hooks.driver import StreamDriverHook

        os.environ.setdefault(f"AIRFLOW_CONN_{STACK_SPARK_CONN.upper()}", json.dumps(
            {"conn_type": "spark", "host": "local[2]",
             "extra": {"deploy-mode": "client", "spark-binary": "spark-submit"}}))
        return StreamDriverHook(STACK_SPARK_CONN, conf=self.conf, log_dir=str(self.log_dir))

    def start(
        self, spec: StreamJobSpec | None = None, env: dict[str, str] | None = None, *, standby: bool = False
    ) -> local_driver.DriverProcess:
        """A driver for ``spec``; with ``standby``, the job's warm standby (its run id is the standby id)."""
        spec = spec or self.spec
        run_id = uuid.uuid4().hex
        role = "standby" if standby else "driver"
        log_path = str(self.log_dir / f"{role}-{len(self.drivers):02d}-{run_id[:8]}.log")
        driver_env = {**spark_env(), **(env or {})}
        cmd = self.driver_hook.submit_command(self.application, spec, run_id, log_path, standby=standby, env=driver_env)
        popen = local_driver.start_detached(cmd, log_path, env=driver_env, cwd=str(REPO))
        driver = local_driver.DriverProcess(popen.pid, log_path, run_id, popen)
        self.drivers.append(driver)
        return driver

    def log_tail(self, driver: local_driver.DriverProcess | None = None, lines: int = 60) -> str:
        driver = driver or self.drivers[-1]
        try:
            content = Path(driver.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return f"--- {driver.log_path} (last {lines} lines)\n" + "\n".join(
            line[:400] for line in content[-lines:]
        )

    def run_row(self, driver: local_driver.DriverProcess) -> RunRecord | None:
        return self.store.get_run(driver.run_id)

    def wait_running(self, driver: local_driver.DriverProcess, timeout: float = 120) -> dict:
        def started():
            if not driver.alive():
                raise AssertionError(f"driver exited before its query started\n{self.log_tail(driver)}")
            row = self.run_row(driver)
            return row if row and row.query_started_at else None

        return wait_until(started, timeout, "the query to start", on_timeout=lambda: self.log_tail(driver))

    def stored_offsets(self) -> dict[int, int]:
        return {p: o for (t, p), o in self.store.stored_offsets(self.spec.job_id).items()}

    def wait_caught_up(
        self, end_offsets: dict[int, int], driver: local_driver.DriverProcess, timeout: float = 240
    ) -> None:
        def caught_up():
            if not driver.alive():
                raise AssertionError(f"driver died while catching up\n{self.log_tail(driver)}")
            return self.stored_offsets() == end_offsets

        wait_until(
            caught_up,
            timeout,
            f"stored offsets to reach {end_offsets}",
            on_timeout=lambda: f"stored: {self.stored_offsets()}\n{self.log_tail(driver)}",
        )

    def stop(self, driver: local_driver.DriverProcess, timeout: float = 90) -> int | None:
        assert self.store.request_stop(driver.run_id), "stop request was not accepted"
        return driver.wait(timeout)

    def process_backlog(self, end_offsets: dict[int, int], spec: StreamJobSpec | None = None) -> None:
        """Start a driver, let it apply everything up to ``end_offsets``, stop it gracefully (exit 0)."""
        driver = self.start(spec)
        self.wait_caught_up(end_offsets, driver)
        code = self.stop(driver)
        assert code == 0, f"graceful stop ended with exit code {code}\n{self.log_tail(driver)}"

    def committed_batches(self) -> int:
        return self.store.count(schema.batches, job_id=self.spec.job_id)

    def kill_all(self) -> None:
        for driver in self.drivers:
            driver.kill()


def group_stopped(pgid: int) -> bool:
    """Every process of the group has stopped (SIGSTOP is delivered asynchronously).  The group, not the
    driver's process tree: Spark's Python worker daemon moves into a group of its own (``os.setpgid``),
    so ``killpg`` never stops it and it holds no state-database connection."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid:
            states.append(fields[0])
    return bool(states) and all(state in "TtZX" for state in states)  # Z: an exited child not yet reaped


def freeze_between_transactions(database: str, pgid: int, attempts: int = 200) -> None:
    """SIGSTOP a driver's process group (``pgid``) at a moment it holds no transaction on the SQLite
    database file ``database``: a driver hung, or a VM suspended.

    SQLite has one write lock per file and every transaction here takes it (``BEGIN IMMEDIATE``): a
    process frozen inside one keeps it, and no other process can write, a takeover or a stop included,
    until it resumes or dies.  That is SQLite's limit, named in the README; the tests that freeze a driver
    are about what happens next, so they freeze it between its transactions (where a pause finds it nearly
    all the time: a commit is milliseconds of a batch).  Stopped, the driver cannot take the lock; a probe
    that takes it shows the driver did not hold it."""
    for _ in range(attempts):
        os.killpg(pgid, signal.SIGSTOP)
        wait_until(lambda: group_stopped(pgid), 10, "the driver's processes to stop", interval=0.01)
        probe = sqlite3.connect(database, timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # frozen inside a transaction: let it finish, try again
            os.killpg(pgid, signal.SIGCONT)
            time.sleep(0.02)
        finally:
            probe.close()
    raise AssertionError(f"the driver held the database at each of {attempts} tries to freeze it")


def check_exactly_once(store: StateStore, job_id: str, produced) -> dict[str, int]:
    """Assert the results equal what was produced, each record applied once; return the counts."""
    with store.engine.connect() as conn:
        events = {r.event_id: r for r in conn.execute(text("SELECT event_id, user_id, amount FROM events"))}
        kpi = {
            (r.user_id, str(r.minute)[:16].replace(" ", "T")): (r.event_count, r.amount_cents)
            for r in conn.execute(text("SELECT user_id, minute, event_count, amount_cents FROM kpi_minute"))
        }
        dead = {
            (r.partition, r.offset): (bytes(r.value), r.error)
            for r in conn.execute(select(schema.dead_letters).where(schema.dead_letters.c.job_id == job_id))
        }
        ledger = conn.execute(
            select(schema.batches)
            .where(schema.batches.c.job_id == job_id)
            .order_by(schema.batches.c.partition, schema.batches.c.generation, schema.batches.c.batch_id)
        ).all()
    missing = set(produced.events) - set(events)
    extra = set(events) - set(produced.events)
    assert not missing and not extra, f"events: {len(missing)} missing, {len(extra)} unexpected"
    for event_id, row in events.items():
        assert row.user_id == produced.events[event_id]["user_id"]
    expected_kpi = produced.kpi_minute()
    wrong = {k: (kpi.get(k), v) for k, v in expected_kpi.items() if kpi.get(k) != v}
    assert not wrong and set(kpi) == set(expected_kpi), (
        f"kpi_minute differs (stored, expected): {list(wrong.items())[:5]}"
    )
    assert set(dead) == set(produced.malformed), (
        f"dead letters: {len(set(produced.malformed) - set(dead))} missing, {len(set(dead) - set(produced.malformed))} extra"
    )
    for position, (value, error) in dead.items():
        assert value == produced.malformed[position] and error
    stored = {p: o for (t, p), o in store.stored_offsets(job_id).items()}
    assert stored == dict(produced.end_offsets), (
        f"stored offsets {stored} != Kafka end offsets {dict(produced.end_offsets)}"
    )
    # The ledger is contiguous per partition and accounts for every record exactly once.
    position: dict[int, int] = {}
    for row in ledger:
        assert row.start_offset == position.get(row.partition, 0), f"ledger gap/overlap at {row}"
        assert row.rows_applied + row.rows_dead == row.rows_read
        position[row.partition] = row.end_offset
    assert position == dict(produced.end_offsets)
    read = sum(r.rows_read for r in ledger)
    assert read == produced.total, f"ledger read {read} records, {produced.total} were produced"
    return {"events": len(events), "dead_letters": len(dead), "read": read, "batches": len(ledger)}
