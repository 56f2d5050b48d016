"""A crash at every step boundary of a batch, each followed by the provider's recovery, with exact counts.

The runtime's test-only switch ``STREAM_FAULT=<point>:<batch>`` makes the driver kill its own process
group (JVM, Python driver, workers) at that point, exactly as a SIGKILL would: no cleanup, no record.
Each crash is checked where it happened (offsets log, commit log, ledger) before the health DAG recovers
the job; the recovering driver carries the next fault.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from airflow_stream_provider import local_driver
from airflow_stream_provider.state import schema
from tests.dags import provider_scenarios as dags
from tests.stack.dagruns import caught_up, run_dag
from tests.stack.events import EventProducer
from tests.stack.jobs import check_exactly_once, wait_until

BATCH = 300


def _with_fault(params: dict, fault: str | None) -> dict:
    env = {k: v for k, v in params["env_vars"].items() if k != "STREAM_FAULT"}
    return {**params, "env_vars": {**env, **({"STREAM_FAULT": fault} if fault else {})}}


def _wait_dead(state, job_id: str) -> dict:
    def dead():
        run = state.latest_run(job_id)
        return run if run and run["pid"] and not local_driver.process_alive(run["pid"]) else None

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

    # during_stop: the stop marker is seen, the driver dies before the query stops.
    caught_up(state, job_id, producer)
    stopping = state.latest_run(job_id)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "died", tasks
    assert state.store.get_run(stopping["run_id"])["status"] == "DEAD", "no clean stop may be recorded"
    crashes.append("during_stop")
    status, tasks = run_dag(dags.health, _with_fault(params, None), max_restarts=10)
    assert status == "success" and tasks["recover"][1]["action"] == "restart", tasks

    producer.send(BATCH * 2)
    caught_up(state, job_id, producer)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    counts = check_exactly_once(state.store, job_id, producer.produced)
    assert len(state.restarts_since(job_id, 0)) == 4
    figures.record("crash at every step boundary", crashes=crashes, **counts)
