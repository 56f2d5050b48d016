"""``mttr_real_airflow``: SIGKILL -> processing again, under a real Airflow (scheduler, triggerer,
dag-processor, api-server; LocalExecutor), three ways, each on a fresh deployment of its own:

* ``watcher``: the example DAGs as shipped.  The always-on watcher reports the death, ``stream_health``
  runs on the asset event and restarts the job.
* ``polling``: the health DAG as it was before the watcher (``bench_polling_health``: every 5 minutes,
  a 4-minute deferred sensor).  Kills land uniformly over its 5-minute cycle, so those that fall
  outside the sensor's window wait for the next run.
* ``spark_submit``: the job attached under ``SparkSubmitOperator`` with task retries (``retry_delay``
  5 s): a dead driver fails the task and Airflow retries it.

"Processing again" is the first batch the new run commits (read from the ledger the sink writes in its
transaction), with a trickle of events flowing.  Every job is audited for lost and duplicated records.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from benchmarks.audit import Audit, audit
from benchmarks.stack import EVENTS_JOB, REPO, Stack, kill_driver_tree, say

#: Kill moments: uniformly random over what decides a variant's wait (the watcher's 1 s poll, a retry's
#: 5 s delay; the polling DAG's 5-minute schedule), counted from when the job is processing again.
KILL_WINDOW_S = {"watcher": 20.0, "polling": 300.0, "spark_submit": 20.0}
RECOVERY_TIMEOUT_S = 600


def _dags(workdir: Path, variant: str) -> tuple[Path, tuple[str, ...]]:
    """A DAG folder holding only what the variant runs (symlinks, as a bundle would hold the files)."""
    folder = workdir / f"dags-{variant}"
    folder.mkdir(parents=True)
    shared = [REPO / "dags" / "stream_job.py", REPO / "dags" / "stream_deploy.py", REPO / "dags" / "stream_stop.py"]
    files, dag_ids = {
        "watcher": ([*shared, REPO / "dags" / "stream_health.py"], ("stream_deploy", "stream_stop", "stream_health")),
        "polling": ([*shared, REPO / "benchmarks" / "dags" / "bench_polling_health.py"],
                    ("stream_deploy", "stream_stop", "bench_polling_health")),
        "spark_submit": ([REPO / "benchmarks" / "dags" / "bench_baseline.py"], ("bench_baseline",)),
    }[variant]
    for source in files:
        (folder / source.name).symlink_to(source)
    return folder, dag_ids


def measure(stack: Stack, variant: str, kills: int, total: Audit, seed: int = 14) -> list[float]:
    """``kills`` SIGKILLs of the live driver at uniformly random moments; seconds to processing again."""
    from stack.deployment import StreamDeployment
    from stack.events import EventProducer, Trickle

    rng = random.Random(f"{seed}-{variant}")
    job_id = f"airflow-{variant.replace('_', '-')}-{rng.randrange(16**6):06x}"
    workdir = stack.workdir / job_id
    workdir.mkdir()
    stack.broker.create_topic(job_id, 3)
    folder, dag_ids = _dags(workdir, variant)
    deployment = StreamDeployment(workdir, stack.broker, job_id, job_id, dags_folder=folder, dag_ids=dag_ids,
                                  spark_conf=stack.spark_conf)
    producer = EventProducer(stack.broker, job_id, seed=seed)
    seconds: list[float] = []
    try:
        say(f"  {variant}: starting Airflow (scheduler, triggerer, dag-processor, api-server)")
        deployment.start()
        producer.send(1000)
        if variant == "spark_submit":
            from airflow_stream_provider.spec import StreamJobSpec

            spec = StreamJobSpec.from_dict({**deployment.spec, "database_url": deployment.database_url,
                                            "kafka": {**deployment.spec["kafka"],
                                                      "bootstrap_servers": stack.broker.bootstrap}})
            deployment.airflow.trigger_dag("bench_baseline", {
                "application": EVENTS_JOB, "spec": spec.to_json(), "conf": stack.spark_conf,
                "env_vars": deployment.variables["stream_driver_env"]})
        else:
            state, run_id = deployment.trigger("stream_deploy")["_run"]
            if state != "success":
                raise RuntimeError(f"stream_deploy failed: {deployment.explain('stream_deploy', run_id)}")
        with Trickle(producer, chunk=10, pause_s=0.5):
            for attempt in range(kills):
                victim = deployment.processing(RECOVERY_TIMEOUT_S)
                time.sleep(rng.uniform(0, KILL_WINDOW_S[variant]))
                killed_at = time.time()
                kill_driver_tree(victim["pid"])
                recovered = deployment.processing(RECOVERY_TIMEOUT_S, other_than=victim["run_id"], after=killed_at)
                seconds.append(recovered["committed_at"] - killed_at)
                say(f"  {variant} kill -9 {attempt + 1}/{kills}: processing again after {seconds[-1]:.1f}s")
        deployment.wait_caught_up(producer.produced, timeout=RECOVERY_TIMEOUT_S)
        found = audit(deployment.store, job_id, producer.produced)
        say(f"  {job_id}: {found}")
        total += found
    finally:
        producer.close()
        deployment.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return seconds
