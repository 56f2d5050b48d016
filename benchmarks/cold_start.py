"""The floor of every restart: a driver spawned on an existing checkpoint with records waiting, to its first
committed batch; and what each of the start's cuts saves.

Up to five kinds of driver take turns (the machine's noise hits each alike); the default profile's ``cold``
section starts the two the target compares (``TARGET_KINDS``), the ``cold_cuts`` section all five:

* ``shipped``: as the provider launches it: the JVM maps the installation's class archive (``jvm_archive``),
  C2 takes only really hot code (``jvm_jit``) and Spark's Python zips are compiled (``make install`` runs
  ``runtime.precompile``);
* ``default_jit``: the same with HotSpot's own JIT thresholds;
* ``no_archive``: the same without the class archive (``-Xshare:auto``, the JVM's own default);
* ``uncut``: without the archive, on a Spark whose Python zips hold only sources, as Spark ships them (a
  ``SPARK_HOME`` of links to the driver environment's pyspark, with source-only copies of its zips);
* ``before``: the code the cold-start work started from (``cold_before.BEFORE``), on that same Spark: the
  start the target halves.  Its job has a topic, database and checkpoint of its own.

Each driver's own startup line says where its time went (``runtime.startup``; ``before`` has none).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import cold_before
from benchmarks.audit import Audit, audit
from benchmarks.stack import REPO, Stack, say
from stack.events import EventProducer

VARIANTS = ("shipped", "default_jit", "no_archive", "uncut", "before")
#: The kinds that ``cold_start_s <= cold_start_before_s / 2`` compares.
TARGET_KINDS = ("shipped", "before")
#: The sample key of each kind's seconds (``cold_start_s`` is the shipped one).
KEYS = {"shipped": "cold_start_s", "default_jit": "cold_start_default_jit_s", "no_archive": "cold_start_no_archive_s",
        "uncut": "cold_start_uncut_s", "before": "cold_start_before_s"}
ARCHIVE_WAIT_S = 300


def measure(stack: Stack, repeats: int, total: Audit, kinds: tuple[str, ...] = VARIANTS) -> dict:
    """Seconds per kind of ``kinds`` (under ``KEYS``) and ``startup_s``: each kind's median seconds per
    startup phase."""
    from stack.jobs import JobRunner, make_spec

    job = stack.new_job("cold-start")
    spec = make_spec(job.job_id, stack.broker.bootstrap, job.topic, job.database_url,
                     stack.workdir / "checkpoints", trigger_interval="1 second", max_offsets_per_trigger=2000)
    logs = stack.workdir / "driver-logs" / job.job_id
    shipped = JobRunner(spec, logs, conf=stack.spark_conf)
    producer = stack.producer(job)
    producer.send(600)
    shipped.process_backlog(dict(producer.produced.end_offsets))  # creates the checkpoint; not timed
    _await_archive(stack, shipped)
    plain = _with_java_options(stack.spark_conf, "-Xshare:auto")  # the JVM's own class sharing: no archive
    default_jit = _with_java_options(stack.spark_conf, "-XX:+TieredCompilation")  # HotSpot's own JIT settings
    spark_home = {"SPARK_HOME": str(_spark_as_shipped(stack))}
    cuts = {"default_jit": (default_jit, {}), "no_archive": (plain, {}), "uncut": (plain, spark_home)}
    # only the kinds this section starts: a runner checks the job's state tables as it is made
    runners = {"shipped": (shipped, {})} | {kind: (JobRunner(spec, logs, conf=conf), env)
                                           for kind, (conf, env) in cuts.items() if kind in kinds}
    old_code = _OldCode.ready(stack, plain, spark_home)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    phases: dict[str, list[dict]] = {kind: [] for kind in kinds if kind != "before"}
    try:
        for attempt in range(repeats):
            for kind in kinds:
                if kind == "before":
                    seconds[kind].append(old_code.cold_start())
                    say(f"  cold start {attempt + 1}/{repeats} before ({cold_before.BEFORE}): "
                        f"{seconds[kind][-1]:.1f}s")
                    continue
                runner, env = runners[kind]
                producer.send(300)
                spawned = time.time()
                driver = runner.start(env=env)
                seconds[kind].append(job.wait_first_commit(run_id=driver.run_id, after=spawned) - spawned)
                runner.wait_caught_up(dict(producer.produced.end_offsets), driver)
                runner.stop(driver)
                phases[kind].append(_startup_line(driver.log_path))
                say(f"  cold start {attempt + 1}/{repeats} {kind}: {seconds[kind][-1]:.1f}s  {_say(phases[kind][-1])}")
    finally:
        old_code.close()
    for runner, _ in runners.values():
        runner.store.dispose()
    producer.close()
    audited = audit(job.store, job.job_id, producer.produced)
    say(f"  {job.job_id}: {audited}")
    total += audited
    samples = {KEYS[kind]: values for kind, values in seconds.items()}
    samples["startup_s"] = {kind: _medians(lines) for kind, lines in phases.items()}
    return samples


def _with_java_options(conf: dict[str, str], option: str) -> dict[str, str]:
    """``conf`` with ``option`` added to the driver's Java options (one that marks a deployment's own
    choice, so the launcher leaves that cut out)."""
    return {**conf, "spark.driver.extraJavaOptions": f"{conf.get('spark.driver.extraJavaOptions', '')} {option}".strip()}


@dataclass
class _OldCode:
    """The ``before`` kind: the old code's driver process (``cold_before``) and the producer of its job's
    own topic."""

    driver: cold_before.BeforeDriver
    producer: EventProducer

    @classmethod
    def ready(cls, stack: Stack, conf: dict[str, str], env: dict[str, str]) -> _OldCode:
        """Its job set up and its checkpoint made (not timed)."""
        from stack.jobs import SPARK_BIN

        job_id = f"cold-start-before-{uuid.uuid4().hex[:6]}"
        stack.broker.create_topic(job_id, 3)
        producer = EventProducer(stack.broker, job_id)
        driver_env = {k: stack.spark_env[k] for k in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP")}
        driver = cold_before.BeforeDriver(
            REPO, stack.workdir, python=sys.executable, spark_bin=SPARK_BIN, conf=conf, env={**driver_env, **env},
            job={"job_id": job_id, "bootstrap": stack.broker.bootstrap, "topic": job_id,
                 "database_url": f"sqlite:///{stack.workdir / f'{job_id}.db'}",
                 "checkpoints": str(stack.workdir / "checkpoints"),
                 "logs": str(stack.workdir / "driver-logs" / job_id)})
        producer.send(600)
        driver.ask("backlog", dict(producer.produced.end_offsets))
        return cls(driver, producer)

    def cold_start(self) -> float:
        """Seconds from a driver's spawn to its first committed batch, with records waiting; the driver
        then catches up and stops."""
        self.producer.send(300)
        seconds = self.driver.ask("start")["seconds"]
        self.driver.ask("finish", dict(self.producer.produced.end_offsets))
        return seconds

    def close(self) -> None:
        self.driver.close()
        self.producer.close()


def _await_archive(stack: Stack, runner) -> None:
    """The first driver's launch started the class archive's run when there was none: wait for it."""
    from airflow_stream_provider import jvm_archive

    archive = jvm_archive.ClassArchive.of(stack.spark_env, "spark-submit", stack.spark_conf,
                                          runner.driver_hook.archive_dir)
    if archive is None:
        say("  no class archive: spark-submit or java not found")
        return
    deadline = time.monotonic() + ARCHIVE_WAIT_S
    while archive.lock.exists() and not archive.ready() and time.monotonic() < deadline:
        time.sleep(1)
    say(f"  class archive {'ready' if archive.ready() else 'missing (shipped = no_archive)'}: {archive.path}")


def _spark_as_shipped(stack: Stack) -> Path:
    """A SPARK_HOME whose Python zips hold only sources: links to the driver environment's pyspark, with
    copies of ``python/lib``'s zips without their compiled modules."""
    home = stack.workdir / "spark-as-shipped"
    if home.exists():
        return home
    from stack.jobs import SPARK_BIN

    pyspark = next((SPARK_BIN.parent / "lib").glob("python3*/site-packages/pyspark"))
    home.mkdir()
    for entry in pyspark.iterdir():
        if entry.name != "python":
            (home / entry.name).symlink_to(entry)
    (home / "python").mkdir()
    for entry in (pyspark / "python").iterdir():
        if entry.name != "lib":
            (home / "python" / entry.name).symlink_to(entry)
    (home / "python" / "lib").mkdir()
    for source in (pyspark / "python" / "lib").glob("*.zip"):
        with zipfile.ZipFile(source) as compiled, zipfile.ZipFile(home / "python" / "lib" / source.name, "w",
                                                                   zipfile.ZIP_DEFLATED) as plain:
            for entry in compiled.infolist():
                if not entry.filename.endswith(".pyc"):
                    plain.writestr(entry.filename, compiled.read(entry))
    return home


def _startup_line(log_path: str) -> dict:
    lines = [line for line in Path(log_path).read_text(errors="replace").splitlines() if " startup {" in line]
    return json.loads(lines[0].split(" startup ", 1)[1]) if lines else {}


def _say(phases: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "total")


def _medians(found: list[dict]) -> dict[str, float]:
    names = [name for name in (found[0] if found else {})]
    return {name: round(statistics.median(p.get(name, 0.0) for p in found), 3) for name in names}
