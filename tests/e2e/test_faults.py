"""A crash at every step boundary of a batch, each followed by the provider's recovery, with exact counts.

The runtime's test-only switch ``STREAM_FAULT=<point>:<batch>`` makes the driver kill its own process
group (JVM, Python driver, workers) at that point, exactly as a SIGKILL would: no cleanup, no record.
Each crash is checked where it happened (offsets log, commit log, ledger) before the health DAG recovers
the job; the recovering driver carries the next fault.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from sqlalchemy import select

from airflow_stream_provider import kafka_offsets, local_driver
from airflow_stream_provider.__main__ import status as job_status
from airflow_stream_provider.state import schema
from stack.events import EventProducer
from stack.jobs import REPO, check_exactly_once, wait_until
from tests.dags import provider_scenarios as dags
from tests.dags import reset_scenario
from tests.dagtest.dagruns import caught_up, deployed, run_dag, runs

BATCH = 300


def _with_fault(params: dict, fault: str | None) -> dict:
    env = {k: v for k, v in params["env_vars"].items() if k != "STREAM_FAULT"}
    return {**params, "env_vars": {**env, **({"STREAM_FAULT": fault} if fault else {})}}


def _wait_dead(state, job_id: str) -> dict:
    def dead():
        run = state.latest_run(job_id)
        return run if run and run.pid and not local_driver.process_alive(run.pid) else None

    return wait_until(dead, 240, "the driver to crash at its fault point")


def _ledger_batches(state, job_id: str) -> set[int]:
    with state.store.engine.connect() as conn:
        table = schema.batches
        return {row.batch_id for row in conn.execute(select(table.c.batch_id).where(table.c.job_id == job_id))}


def test_crash_at_every_step_boundary_then_recovery(stream, broker, figures):
    state, job_id = stream["state"], stream["job_id"]
    params = {**stream["params"], "spec": {**stream["params"]["spec"],
                                           "kafka": {**stream["params"]["spec"]["kafka"],
                                                     "max_offsets_per_trigger": BATCH}}}
    gen = Path(params["spec"]["checkpoint_root"]) / job_id / "gen-1"
    producer = EventProducer(broker, stream["topic"])
    producer.send(BATCH * 8)  # batches 0..7 are planned in order, BATCH records each

    # batch_start: offsets/1 is written (Spark's write-ahead log), nothing of batch 1 is applied.
    status, tasks = run_dag(dags.deploy, _with_fault(params, "batch_start:1"))
    assert status == "success", tasks
    crashes = []
    for point, batch, next_fault in [("batch_start", 1, "before_db_commit:2"),
                                     ("before_db_commit", 2, "after_db_commit:3"),
                                     ("after_db_commit", 3, "during_stop:*")]:
        _wait_dead(state, job_id)
        applied = _ledger_batches(state, job_id)
        assert (gen / "offsets" / str(batch)).exists() and not (gen / "commits" / str(batch)).exists()
        if point == "after_db_commit":  # the results are in, Spark's commit log never heard of it
            assert batch in applied
        else:
            assert batch not in applied and batch - 1 in applied
        crashes.append(point)
        status, tasks = run_dag(dags.health, _with_fault(params, next_fault), max_restarts=10)
        assert status == "success", tasks
        assert tasks["health"][1]["health"] == "DEAD" and tasks["recover"][1]["action"] == "restart", tasks

    # during_stop: the stop marker is seen, the driver dies before the query stops.  No clean stop is
    # recorded (DEAD), and the job stays stopped, as asked: the watcher reports the death, the recovery
    # restarts nothing.  Submitted again, it resumes after its last committed batch.
    caught_up(state, job_id, producer)
    stopping = state.latest_run(job_id)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "died", tasks
    assert state.store.get_run(stopping.run_id).status == "DEAD", "no clean stop may be recorded"
    crashes.append("during_stop")
    status, tasks = run_dag(dags.health, _with_fault(params, None), max_restarts=10)
    assert status == "success" and tasks["health"][1]["health"] == "DEAD", tasks
    assert tasks["recover"][1]["action"] == "none" and "would undo the stop" in tasks["recover"][1]["why"], tasks
    assert state.latest_run(job_id).run_id == stopping.run_id
    status, tasks = run_dag(dags.deploy, _with_fault(params, None))
    assert status == "success", tasks

    producer.send(BATCH * 2)
    caught_up(state, job_id, producer)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(state.store, job_id, producer.produced)
    assert len(state.restarts_since(job_id, 0)) == 3
    figures.record("crash at every step boundary", crashes=crashes, **counts)


# The reset task runs in a process of its own, as a worker runs it: ``dag.test()`` runs tasks in the calling
# process, and the fault kills the process it fires in with a real SIGKILL.
_RESET_IN_A_CHILD = (
    "import json, sys\n"
    "from tests.dags.reset_scenario import reset\n"
    "from tests.dagtest.dagruns import run_dag\n"
    "print(run_dag(reset, json.loads(sys.argv[1]), logical_date=sys.argv[2]))\n"
)


def test_reset_killed_between_archive_and_start_is_completed_by_the_next_attempt(stream, broker, figures):
    """``STREAM_FAULT=reset_after_archive`` in the Airflow task's environment: the reset task is SIGKILLed
    after archiving generation 1 and before starting generation 2.  The archive stays, nothing starts; the
    next attempt of the reset (what Airflow's retry of the killed task runs) starts generation 2 from the
    stored offsets without archiving anything again.  Until then the job is owed the reset: its record was
    begun before the stop, and the retry's launch completes it."""
    state, job_id, params = stream["state"], stream["job_id"], stream["params"]
    root = Path(params["spec"]["checkpoint_root"]) / job_id
    producer = EventProducer(broker, stream["topic"])
    producer.send(1500)
    first = deployed(dags.deploy, params, state, job_id, producer)

    killed_run = datetime.datetime.now(datetime.UTC).isoformat()  # the retry below is the same task instance
    with open(stream["tmp"] / "killed-reset.log", "wb") as output:
        child = subprocess.run([sys.executable, "-c", _RESET_IN_A_CHILD, json.dumps({**params, "reason": "test"}),
                                killed_run],
                               env={**os.environ, "STREAM_FAULT": "reset_after_archive"}, cwd=REPO,
                               stdout=output, stderr=subprocess.STDOUT, timeout=600)
    assert child.returncode == -signal.SIGKILL, (stream["tmp"] / "killed-reset.log").read_text()[-3000:]
    stopped = state.store.get_run(first["run_id"])
    assert stopped.status == "STOPPED", "the reset stops the live run gracefully before it archives"
    archived = state.store.get_generation(job_id, 1)
    archive = Path(archived["archive_path"])
    assert archived["archived_at"] and (archive / "offsets").is_dir() and (archive / "commits").is_dir()
    assert not (root / "gen-1").exists() and not (root / "gen-2").exists()
    assert state.store.get_generation(job_id, 2) is None and len(runs(state, job_id)) == 1
    (begun,) = state.restarts_since(job_id, 0)  # recorded before its stop, as a restart's is
    assert (begun["action"], begun["failed_run_id"], begun["new_run_id"]) == ("reset", first["run_id"], None)
    # The job is down, yet nobody asked for a stop: the reset is owed (stream_health would finish it)
    shown = job_status(state.store, job_id)
    assert "the reset begun at" in shown and "A recovery finishes the reset: a new generation" in shown, shown
    stored = state.stored_offsets(job_id)

    producer.send(700)  # arrives while no driver runs
    # the killed task still holds the job's lease: another task (a new run of the DAG) is refused, and
    # does nothing; the killed task's own retry holds the same lease
    status, tasks = run_dag(reset_scenario.reset, params, reason="another reset beside the killed one")
    assert status == "failed" and tasks["reset"][0] == "failed", tasks
    assert state.store.get_generation(job_id, 2) is None and len(runs(state, job_id)) == 1
    status, tasks = run_dag(reset_scenario.reset, params, logical_date=killed_run, reason="retry of the killed reset")
    assert status == "success", tasks
    done = tasks["reset"][1]
    assert (done["generation"], done["archived_generation"], done["archive_path"]) == (2, 1, str(archive)), done
    (finished,) = state.restarts_since(job_id, 0)
    assert (finished["id"], finished["new_run_id"]) == (begun["id"], done["run_id"]), "the begun reset, completed"
    assert kafka_offsets.from_spark_json(done["starting_offsets"]) == stored
    assert sorted(p.name for p in (root / "archive").iterdir()) == [archive.name], "archived once, kept"
    assert kafka_offsets.from_spark_json(state.store.get_generation(job_id, 2)["starting_offsets"]) == stored
    producer.send(300)
    caught_up(state, job_id, producer)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(state.store, job_id, producer.produced)
    assert counts["read"] == 2500
    figures.record("reset killed between archive and start", archive=archive.name, **counts)
