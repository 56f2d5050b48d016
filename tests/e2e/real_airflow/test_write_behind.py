"""Write-behind's kill window on a real Airflow (scheduler, triggerer, dag-processor, api-server;
LocalExecutor): the driver dies by SIGKILL while a batch's commit waits in its writer thread, after Spark
logged the batch as done and before the database holds it.  Airflow alone repairs it: the always-on
watcher reports the death, ``stream_health`` restarts the job, and the new run applies that batch from
Kafka before its query starts.  The test ends with exact counts against Kafka and the result tables.

The kill is the driver's own crash point ``write_behind:1`` (SIGKILL to its process group once batch 2
has started and batch 1's commit has not run), set in the drivers' environment (``stream_driver_env``):
on SQLite a 25,000-record commit lands about as soon as Spark logs the batch, so a kill from outside
cannot aim at the window.  Every run gets the setting; only the first meets it, as batch 1 goes through
the writer once (the next run applies it in line, before its query starts).

Batches of 25,000 records (the ceiling; a run's first batch reads 10,000), so batch 1 goes behind
(``write_behind.MIN_RECORDS``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select

from airflow_stream_provider.local_driver import process_alive
from airflow_stream_provider.runtime.write_behind import MIN_RECORDS
from airflow_stream_provider.spec import generation_path
from airflow_stream_provider.state import schema
from stack.deployment import StreamDeployment
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until

CEILING = 25_000
assert CEILING >= MIN_RECORDS
#: Events waiting when the job starts: a first batch of 10,000, then full batches that go behind.  Produced
#: while the job runs, this producer's events would arrive no faster than the job applies them.
BACKLOG = 60_000
RECOVERY_TIMEOUT = 240


@pytest.fixture
def deployment_options(topic) -> dict:
    return {"spec": {"kafka": {"topics": [topic], "source": "python", "max_offsets_per_trigger": CEILING}},
            "driver_env": {"STREAM_FAULT": "write_behind:1"}}


def _checkpoint(deployment: StreamDeployment) -> Path:
    return Path(generation_path(f"{deployment.spec['checkpoint_root']}/{deployment.job_id}", 1))


def _ledger(deployment: StreamDeployment) -> set[int]:
    with deployment.store.engine.connect() as conn:
        return set(conn.execute(select(schema.batches.c.batch_id)
                                .where(schema.batches.c.job_id == deployment.job_id)).scalars())


def _marks(checkpoint: Path) -> list[int]:
    folder = checkpoint / "write-behind"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def test_a_kill_with_a_commit_in_the_writer_is_repaired_by_airflow_exactly_once(deployment, broker, topic,
                                                                               figures):
    producer = EventProducer(broker, topic, seed=13)
    producer.send(BACKLOG)
    deploy = deployment.airflow.trigger_dag("stream_deploy")
    victim = deployment.processing(RECOVERY_TIMEOUT)
    # the crash point's SIGKILL reaches the driver's whole process group at once
    wait_until(lambda: not process_alive(victim["pid"]), 120, "the driver to die with batch 1 in its writer",
               interval=0.01)
    killed_at = time.time()
    # what the next run finds: Spark's commit log ahead of the database, and the mark that says so
    checkpoint = _checkpoint(deployment)
    assert (checkpoint / "commits" / "1").exists() and (checkpoint / "offsets" / "2").exists()
    assert 1 not in _ledger(deployment) and 1 in _marks(checkpoint), (_ledger(deployment), _marks(checkpoint))
    run = deployment.airflow.wait_dag_run("stream_deploy", deploy, timeout=300)
    assert run["state"] == "success", deployment.explain("stream_deploy", deploy)

    recovered = deployment.processing(RECOVERY_TIMEOUT, other_than=victim["run_id"], after=killed_at)
    repair_s = recovered["committed_at"] - killed_at
    producer.send(5_000)
    deployment.wait_caught_up(producer.produced, timeout=300)
    log = Path(recovered["log_path"]).read_text(errors="replace")
    assert "batch 1 was handed to the writer of a run that ended" in log, log[-3000:]
    assert "'write_behind':" in log, "the recovered run's full batches commit behind"

    # the repair came from the watcher's event, not from a person or a schedule
    repairs = deployment.repairs(recovered["run_id"], since=killed_at)
    assert [r["run_type"] for r in repairs] == ["asset_triggered"], repairs

    tasks = deployment.trigger("stream_stop")
    assert tasks["stop"][0] == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    assert _marks(checkpoint) == [], "a clean stop leaves every batch in the database"
    counts = check_exactly_once(deployment.store, deployment.job_id, producer.produced)
    assert counts["read"] == BACKLOG + 5_000, counts
    figures.record("real airflow: a kill with a commit in the writer", seconds=round(repair_s, 1), **counts)
