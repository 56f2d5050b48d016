"""The real stack every benchmark runs on: Tansu, PostgreSQL, local Spark drivers, and Airflow running
the example DAGs of ``dags/`` (what on-call engineers run) next to the baseline DAG.

Airflow reads its configuration when first imported, so ``Stack.start`` configures it before any
Airflow import; each benchmark then points the DAGs' connections and Variables at its own job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import func, select

from stack.events import EventProducer

REPO = Path(__file__).resolve().parents[1]
EVENTS_JOB = str(REPO / "spark_jobs" / "events_job.py")
EVENTS_JOB_V2 = str(REPO / "spark_jobs" / "events_job_v2.py")
AT_LEAST_ONCE_JOB = str(REPO / "benchmarks" / "jobs" / "events_at_least_once.py")


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def kill_driver_tree(pid: int) -> None:
    """SIGKILL the driver as a dying machine would: the spark-submit JVM it runs under, the Python driver
    and every worker.  Works for the provider's detached drivers and for the baseline's attached ones
    (which share the Airflow worker's process group, so killing the group is not an option)."""
    wait_dead(signal_driver_tree(pid, signal.SIGKILL), timeout=10)


def wait_dead(processes: list[psutil.Process], timeout: float) -> None:
    """Until each process is gone or a zombie, without reaping any.  Not ``psutil.wait_procs``: it reaps
    the bench's own children, and the baseline's spark-submit is one (``dag.test()`` runs the operator in
    this process); its ``Popen.wait`` then finds no child and reads the kill as exit 0, a task that
    succeeded instead of one Airflow retries."""
    from airflow_stream_provider.local_driver import process_alive

    deadline = time.monotonic() + timeout
    while any(process_alive(process.pid) for process in processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def driver_tree(pid: int) -> list[psutil.Process]:
    """The driver's processes: the spark-submit JVM it runs under (when it does), the Python driver and
    every worker; empty once the driver is gone."""
    try:
        driver = psutil.Process(pid)
        parent = driver.parent()
        root = parent if parent is not None and "java" in (parent.name() or "") else driver
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_driver_tree(pid: int, sig: int) -> list[psutil.Process]:
    """Send ``sig`` to the driver's whole tree (its JVM, the Python driver, every worker); return the tree."""
    tree = driver_tree(pid)
    for process in tree:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return tree


def tree_rss(processes: list[tuple[psutil.Process, bool]]) -> dict[str, int]:
    """Resident memory of a driver's ``processes`` (``driver_processes``) in bytes: its JVM, and its Python
    processes (the driver and the workers); and ``pss``, the whole tree's proportional set size.  Summed RSS counts the pages that
    Spark's forked Python workers share with their daemon once per process; PSS splits each shared page
    among its sharers, so it is what the tree really holds."""
    parts = {"jvm": 0, "python": 0, "pss": 0}
    for process, java in processes:
        try:
            parts["jvm" if java else "python"] += process.memory_info().rss
            parts["pss"] += process.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return parts


def driver_processes(pid: int) -> list[tuple[psutil.Process, bool]]:
    """The driver's tree (``driver_tree``) as (process, whether it is the JVM), without the processes the JVM
    is starting (``jvm_spawns``) and without those that ended meanwhile."""
    processes, tree = driver_tree(pid), {}
    for process in processes:
        try:
            tree[process.pid] = (process.ppid(), runs_java(process))
        except psutil.NoSuchProcess:
            pass
    clones = jvm_spawns(tree)
    return [(process, tree[process.pid][1]) for process in processes
            if process.pid in tree and process.pid not in clones]


def runs_java(process: psutil.Process) -> bool:
    """Whether the process runs the java binary (the JVM, or a child it has not yet exec'd)."""
    try:
        return Path(process.exe()).name == "java"
    except psutil.AccessDenied:
        return "java" in (process.name() or "")


def jvm_spawns(tree: dict[int, tuple[int, bool]]) -> set[int]:
    """The processes a JVM is starting (pid -> (parent pid, runs java)): a child that runs java under a
    JVM has not exec'd yet and shares the JVM's memory, so its RSS is the JVM's counted twice.  A driver's
    JVM starts processes during its batches (without Hadoop's native library, its local file system runs
    ``chmod`` for each checkpoint file it writes), each named after the JVM thread that starts it."""
    return {pid for pid, (parent, java) in tree.items() if java and tree.get(parent, (None, False))[1]}


#: A driver JVM's threads by what they do, from their names (Linux's 15-character ``comm``), in table order.
JVM_THREAD_KINDS = (
    ("jit", ("C1 CompilerThre", "C2 CompilerThre")),  # HotSpot's compilers
    ("tasks", ("Executor task",)),  # Spark's task threads: reading, parsing, caching, aggregating
    ("python_calls", ("Thread-",)),  # py4j's threads, one per Python driver thread: collects, conf, plans
    ("stream", ("stream executio",)),  # the query's micro-batch loop: planning, offsets, the logs
    ("gc", ("VM Thread", "GC Thread")),  # the serial collector runs in the VM thread
)


def thread_kind(name: str) -> str | None:
    """A JVM thread's kind (``JVM_THREAD_KINDS``) from its name; None for the rest."""
    return next((kind for kind, prefixes in JVM_THREAD_KINDS if name.startswith(prefixes)), None)


def jvm_thread_cpu(processes: list[tuple[psutil.Process, bool]]) -> dict[str, float]:
    """CPU seconds the JVM among a driver's ``processes`` (``driver_processes``) has spent so far, by kind
    of thread (``JVM_THREAD_KINDS``), from ``/proc``; ``other`` is the rest of the process's time, threads
    that ended included."""
    found = {kind: 0.0 for kind, _ in JVM_THREAD_KINDS} | {"other": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for process, java in processes:
        if not java:
            continue
        try:
            times = process.cpu_times()
            tasks = list(Path(f"/proc/{process.pid}/task").iterdir())
        except (psutil.NoSuchProcess, OSError):  # the driver ended meanwhile
            continue
        found["other"] += times.user + times.system
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended meanwhile
                continue
            kind = thread_kind(name)
            if kind is not None:
                seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                found[kind] += seconds
                found["other"] -= seconds
    found["other"] = max(0.0, found["other"])
    return found


def cpu_seconds(process: psutil.Process) -> float:
    """User and system CPU seconds of a process and of its children it has reaped: summed at two moments
    over the processes alive at each, a child's time is counted once whether it is still running or gone."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def tree_cpu(processes: list[tuple[psutil.Process, bool]], broker_pid: int | None) -> dict[str, float]:
    """Cumulative CPU seconds by who spends them: among a driver's ``processes`` (``driver_processes``), its
    JVM, its Python driver and Spark's Python workers (read tasks, the source's runner, planning); the
    PostgreSQL server (every ``postgres`` process: nothing else uses it while a benchmark drains) and the
    broker."""
    parts = {"jvm": 0.0, "python_driver": 0.0, "python_workers": 0.0, "postgresql": 0.0, "broker": 0.0}
    for process, java in processes:
        try:
            if java:
                kind = "jvm"
            else:
                worker = any(arg.startswith("pyspark.") for arg in process.cmdline())  # -m pyspark.daemon
                kind = "python_workers" if worker else "python_driver"
            parts[kind] += cpu_seconds(process)
        except psutil.NoSuchProcess:
            pass
    for process in psutil.process_iter(["name"]):
        try:
            if process.info["name"] == "postgres":
                parts["postgresql"] += cpu_seconds(process)
            elif process.pid == broker_pid:
                parts["broker"] += cpu_seconds(process)
        except psutil.NoSuchProcess:
            pass
    return parts


@dataclass
class Job:
    """One stream job of a benchmark: its topic, database, spec and state hook."""

    job_id: str
    topic: str
    partitions: int
    database_url: str
    spec: dict
    state: object  # StreamStateHook (imported after Airflow is configured)

    @property
    def store(self):
        return self.state.store

    def latest_run(self) -> dict | None:
        return self.state.latest_run(self.job_id)

    def first_commit(self, *, run_id: str | None = None, generation: int | None = None,
                     after: float = 0.0) -> float | None:
        """When the first batch of ``run_id`` (or ``generation``) committed after ``after``: the moment a
        recovered job is processing again, read from the ledger the sink writes in its transaction."""
        from airflow_stream_provider.state import schema

        ledger = schema.batches
        query = select(func.min(ledger.c.committed_at)).where(ledger.c.job_id == self.job_id,
                                                               ledger.c.committed_at > after)
        if run_id is not None:
            query = query.where(ledger.c.run_id == run_id)
        if generation is not None:
            query = query.where(ledger.c.generation == generation)
        with self.store.engine.connect() as conn:
            return conn.execute(query).scalar()

    def wait_first_commit(self, timeout: float = 300, **where) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.first_commit(**where)
            if found is not None:
                return found
            time.sleep(0.1)
        raise RuntimeError(f"job {self.job_id}: no batch committed within {timeout:.0f}s ({where})")

    def wait_caught_up(self, produced, timeout: float = 600, alive_pid: int | None = None) -> None:
        end = {(self.topic, p): o for p, o in produced.end_offsets.items()}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stored = self.state.stored_offsets(self.job_id)
            if all(stored.get(tp, 0) >= o for tp, o in end.items()):
                return
            if alive_pid is not None and not psutil.pid_exists(alive_pid):
                raise RuntimeError(f"job {self.job_id}: the driver {alive_pid} died while catching up")
            time.sleep(0.2)
        raise RuntimeError(f"job {self.job_id} did not catch up within {timeout:.0f}s: "
                           f"stored {self.state.stored_offsets(self.job_id)} vs {end}")


class Stack:
    def __init__(self, workdir: Path, jvm: str = "defaults"):
        self.workdir = workdir
        self.jvm = jvm
        self.pg_databases: list[str] = []
        self.jobs: list[Job] = []
        self.backlogs: dict[tuple[int, int], object] = {}  # (events, partitions) -> stack.events.Produced

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> Stack:
        sys.path.insert(0, str(REPO))
        from stack import postgres
        from stack.broker import Broker
        from stack.jobs import TEST_SPARK_CONF, spark_env

        say(f"starting Tansu; work directory {self.workdir}")
        self.broker = Broker(self.workdir / "tansu.log").start()
        postgres.ensure_server()
        self.spark_env = spark_env()
        # "defaults": the JVM as a deployment gets it (C2 JIT, G1).  "quick": the tests' flags (C1 JIT, serial
        # GC): drivers start sooner on two cores, but a long run's micro-batches are slower.
        self.spark_conf = dict(TEST_SPARK_CONF) if self.jvm == "quick" else \
            {k: v for k, v in TEST_SPARK_CONF.items() if "extraJavaOptions" not in k}
        say(f"driver JVM: {self.jvm} ({self.spark_conf.get('spark.driver.extraJavaOptions', 'no extra options')})")
        dags = self.workdir / "dags"  # the example DAGs and the baseline DAG, as one bundle
        dags.mkdir()
        for source in [*sorted((REPO / "dags").glob("*.py")), *sorted((REPO / "benchmarks" / "dags").glob("bench_*.py"))]:
            (dags / source.name).symlink_to(source)
        os.environ.update(
            AIRFLOW_HOME=str(self.workdir / "airflow"),
            AIRFLOW__CORE__DAGS_FOLDER=str(dags),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__LOGGING__LOGGING_LEVEL="WARNING",
            PATH=self.spark_env["PATH"],  # spark-submit of the driver environment
        )
        self._connection("stream_kafka_default", conn_type="stream_kafka", host="127.0.0.1", port=self.broker.port)
        self._connection("spark_default", conn_type="spark", host="local[2]",
                         extra={"deploy-mode": "client", "spark-binary": "spark-submit"})
        say("migrating Airflow's metadata database (SQLite)")
        airflow = Path(sys.executable).parent / "airflow"
        subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, timeout=600)
        sys.path.append(str(dags))  # as Airflow's BundleDagBag does for the DAGs' shared module
        from airflow.dag_processing.dagbag import DagBag

        bag = DagBag(str(dags))
        if bag.import_errors:
            raise RuntimeError(f"DAG import errors: {bag.import_errors}")
        self.dags = bag.dags
        return self

    def stop(self) -> None:
        from stack import postgres

        for job in self.jobs:
            self.kill_live_drivers(job)
            job.store.dispose()
        for name in self.pg_databases:
            postgres.drop_database(name)
        if getattr(self, "broker", None) is not None:
            self.broker.stop()

    def kill_live_drivers(self, job: Job) -> None:
        from airflow_stream_provider.state import schema

        with job.store.engine.connect() as conn:
            rows = conn.execute(select(schema.runs.c.pid).where(
                schema.runs.c.job_id == job.job_id,
                schema.runs.c.status.in_(("STARTING", "RUNNING", "STOPPING")))).all()
        for (pid,) in rows:
            if pid:
                kill_driver_tree(pid)

    @staticmethod
    def _connection(conn_id: str, **fields) -> None:
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(fields)

    # -- jobs ---------------------------------------------------------------------------------------
    def database(self, kind: str) -> str:
        if kind == "sqlite":
            return f"sqlite:///{self.workdir / f'state-{uuid.uuid4().hex[:8]}.db'}"
        from stack import postgres

        name, url = postgres.create_database()
        self.pg_databases.append(name)
        return url

    def new_job(self, name: str, *, partitions: int = 3, database: str = "sqlite", max_offsets: int = 2000,
                trigger_interval: str = "1 second", application: str = EVENTS_JOB, topic: str | None = None) -> Job:
        """A fresh database for ``name``, a fresh topic unless it reads ``topic`` (of ``partitions``), and the
        DAGs' connections and Variables set to it."""
        from airflow.models.variable import Variable

        from airflow_stream_provider.hooks.state import StreamStateHook

        job_id = f"{name}-{uuid.uuid4().hex[:6]}"
        if topic is None:
            topic = job_id
            self.broker.create_topic(topic, partitions)
        url = self.database(database)
        self._connection("stream_state_default", conn_type="stream_state", extra={"url": url})
        spec = {"job_id": job_id, "version": "1.0", "checkpoint_root": str(self.workdir / "checkpoints"),
                "trigger_interval": trigger_interval, "heartbeat_seconds": 1.0,
                "kafka": {"topics": [topic], "source": "python", "max_offsets_per_trigger": max_offsets}}
        variables = {
            "stream_job_spec": spec,
            "stream_job_application": application,
            "stream_spark_conf": self.spark_conf,
            "stream_driver_env": {k: self.spark_env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON",
                                                                 "SPARK_LOCAL_IP")},
            "stream_driver_log_dir": str(self.workdir / "driver-logs" / job_id),
            "stream_reset_policy": "after_preflight",
        }
        for key, value in variables.items():
            Variable.set(key, value, serialize_json=not isinstance(value, str))
        state = StreamStateHook()
        state.store.ensure_schema()
        job = Job(job_id, topic, partitions, url, spec, state)
        self.jobs.append(job)
        return job

    def set_spec(self, job: Job, **changes) -> None:
        """Change the job spec the DAGs render from now on (as a person editing the Variable would)."""
        from airflow.models.variable import Variable

        job.spec = {**job.spec, **changes}
        Variable.set("stream_job_spec", job.spec, serialize_json=True)

    def producer(self, job: Job, **kwargs):
        return EventProducer(self.broker, job.topic, **kwargs)

    def backlog(self, events: int, partitions: int = 3):
        """A topic of ``events`` events (``stack.events.Produced``), produced once per run: every drain of that
        size reads it from the beginning with a job and database of its own, so the drains compare on the same
        records and the run does not spend minutes producing the same backlog again."""
        key = (events, partitions)
        if key not in self.backlogs:
            topic = f"backlog-{events}-{uuid.uuid4().hex[:6]}"
            self.broker.create_topic(topic, partitions)
            producer = EventProducer(self.broker, topic)
            started = time.monotonic()
            try:
                producer.send(events)
            finally:
                producer.close()
            say(f"  produced a {events:,}-event backlog on {topic} in {time.monotonic() - started:.1f} s")
            self.backlogs[key] = producer.produced
        return self.backlogs[key]

    # -- Airflow ------------------------------------------------------------------------------------
    def trigger(self, dag_id: str, **conf) -> dict:
        """Run one DAG with ``dag.test()``; return {task_id: (state, XCom return value)}."""
        dag_run = self.dags[dag_id].test(run_conf=conf or None)
        return {ti.task_id: (ti.state, ti.xcom_pull(task_ids=ti.task_id)) for ti in dag_run.get_task_instances()}

    def trigger_ok(self, dag_id: str, **conf) -> dict:
        tasks = self.trigger(dag_id, **conf)
        failed = {t: s for t, (s, _) in tasks.items() if s not in ("success", "skipped")}
        if failed:
            raise RuntimeError(f"{dag_id} failed: {failed}")
        return {task: value for task, (_, value) in tasks.items()}
