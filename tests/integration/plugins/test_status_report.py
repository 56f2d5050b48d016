"""What the status page reports of a job, from a real state database (SQLite and PostgreSQL) filled by
the batch transaction itself: runs with their diagnoses, generations, offsets against Kafka's end
offsets, the ledger's batches and the dead letters, with no credential anywhere in it."""

from __future__ import annotations

import json
import time

from sqlalchemy import text

from airflow_stream_provider.plugins.status.report import job_report, masked
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.transaction import BatchRange, RunContext, commit, plan
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

T = "orders"


def _commit(store, run: RunContext, batch_id: int, start: int, end: int, dead: list[int]) -> None:
    batch = BatchRange(batch_id, {(T, 0): start}, {(T, 0): end})
    commit(store, run, plan(store, run.job_id, batch), read={(T, 0): end - start}, writes=[],
           started_at=time.time() - 0.5,
           dead_letters=[{"topic": T, "partition": 0, "offset": o, "key": None, "value": b'{"amount": "x"}',
                          "error": "amount is not a number"} for o in dead])


def test_the_report_tells_the_jobs_story_without_credentials(store):
    store.ensure_generation("orders", 1, "/ckpt/orders/gen-1", None)
    failed = store.begin_run("orders", 1, "1.0", host="nowhere", pid=1)
    store.finish_run(failed.run_id, status="FAILED", exit_code=6, failure_kind="TRANSIENT",
                     message="could not reach postgresql://stream:hunter2@db:5432/results\nretrying")
    live = store.begin_run("orders", 1, "1.1", host="nowhere", pid=2)
    store.mark_query_started(live.run_id)
    run = RunContext("orders", live.run_id, live.epoch, 1)
    _commit(store, run, 0, 0, 10, dead=[3])
    _commit(store, run, 1, 10, 25, dead=[])

    found = job_report(store, "orders", end_offsets=lambda topics: {(T, 0): 40, (T, 1): 5},
                       driver_alive=lambda r: True, secrets=["hunter2"])

    assert found["health"] == "HEALTHY" and found["current"]["run_id"] == live.run_id
    assert [r["status"] for r in found["runs"]] == ["RUNNING", "FAILED"]
    transient = found["runs"][1]
    assert (transient["failure_kind"], transient["exit_code"]) == ("TRANSIENT", 6)
    assert transient["message"] == "could not reach postgresql://stream:***@db:5432/results"
    assert "unreachable" in transient["advice"]
    assert found["generations"] == [{"generation": 1, "state": "active", "created_at": found["generations"][0]
                                     ["created_at"], "archived_at": None, "path": "/ckpt/orders/gen-1",
                                     "reason": None}]
    assert found["offsets"]["partitions"] == [
        {"topic": T, "partition": 0, "stored": 25, "start": None, "end": 40, "lag": 15},
        {"topic": T, "partition": 1, "stored": None, "start": 0, "end": 5, "lag": 5}]
    assert found["offsets"]["lag"] == 20 and found["offsets"]["kafka_error"] is None
    assert [(b["batch_id"], b["rows_read"], b["rows_applied"], b["rows_dead"]) for b in found["batches"]] == [
        (0, 10, 9, 1), (1, 15, 15, 0)]
    assert all(0.5 <= b["latency_s"] < 5 for b in found["batches"]), found["batches"]
    assert found["dead_letters"]["total"] == 1
    assert found["dead_letters"]["samples"][0]["offset"] == 3
    assert found["dead_letters"]["samples"][0]["value"] == '{"amount": "x"}'
    assert "hunter2" not in json.dumps(found) and "database_url" not in json.dumps(found)


def test_the_page_shows_what_on_call_must_know_beside_the_health(store):
    """A job that reads STOPPED because a restart stopped it and launched nothing is owed that restart, not
    stopped on purpose; the task acting on the job and an unfinished upgrade show too, as ``status`` shows
    them (``standing``)."""
    stuck = store.begin_run("orders", 1, "1.0", host="nowhere", pid=1)
    store.record_restart("orders", "restart", "STUCK: no batch for 600s", stuck.run_id, None,
                         "stream_health/asset_triggered__1/recover/-1")
    store.finish_run(stuck.run_id, status="STOPPED", exit_code=0, message="stopped")
    LeaseLog(store).take("orders", "stream_health/asset_triggered__2/recover/-1", "recover", time.time() + 60)
    upgrades = UpgradeLog(store)
    upgrades.move(upgrades.begin("orders", "1.0", "1.1", {}), UpgradePhase.VERIFYING, {})

    found = job_report(store, "orders", end_offsets=None, driver_alive=lambda r: None)
    assert (found["health"], found["advice"]) == ("STOPPED", "A recovery finishes the restart from the "
                                                             "checkpoint (stream_health does so by itself)."), found
    assert "stopped this run and started no new one: nobody asked for this stop" in found["evidence"][-1]
    upgrade, acting = found["notes"]
    assert upgrade.startswith("upgrade 1.0 -> 1.1 in progress: VERIFYING since"), upgrade
    assert acting.startswith("acting on the job: task stream_health/asset_triggered__2/recover/-1 (recover"), acting


def test_the_page_names_the_task_that_began_a_stuck_runs_restart(store):
    """A STUCK run whose recovery began the restart and has not stopped it yet: at work, or lost before its
    stop.  Which of the two is Airflow's to say, which the page does not ask; it names the task to look at."""
    stuck = store.begin_run("orders", 1, "1.0", host="nowhere", pid=1)
    store.mark_query_started(stuck.run_id)
    store._update_run(stuck.run_id, heartbeat_at=time.time() - 3600)
    store.record_restart("orders", "restart", "STUCK: silent for 3600s", stuck.run_id, None,
                         "stream_health/asset_triggered__1/recover/-1")

    found = job_report(store, "orders", end_offsets=None, driver_alive=lambda r: True)  # alive, and silent
    assert found["health"] == "STUCK", found
    (begun,) = found["notes"]
    assert begun.startswith("restart of this run begun at") and (
        "by task stream_health/asset_triggered__1/recover/-1, nothing launched yet" in begun), begun


def test_an_older_releases_database_still_shows_the_job(store):
    """A state database an older release made lacks the restart records' newer columns until a task or the
    watcher of this release uses it; the page, which never changes the schema, shows the job meanwhile and
    says what it could not read."""
    run = store.begin_run("orders", 1, "1.0", host="nowhere", pid=1)
    store.finish_run(run.run_id, status="FAILED", exit_code=1, failure_kind="TRANSIENT", message="brokers away")
    with store.engine.begin() as conn:
        for column in ("task", "finished_by"):
            conn.execute(text(f"ALTER TABLE stream_restarts DROP COLUMN {column}"))

    found = job_report(store, "orders", end_offsets=None, driver_alive=lambda r: None)
    assert (found["health"], found["current"]["run_id"]) == ("FAILED", run.run_id), found
    (note,) = found["notes"]
    assert note.startswith("what stands beside the health could not be read"), note


def test_records_below_the_generations_start_are_no_lag(store):
    """A generation started from ``latest``: a partition with no record since has no stored offset, and what
    it held before is no lag (the health check counts the same)."""
    store.ensure_generation("orders", 1, "/ckpt/orders/gen-1", '{"orders":{"0":10,"1":5}}')
    live = store.begin_run("orders", 1, "1.0", host="nowhere", pid=2)
    store.mark_query_started(live.run_id)
    _commit(store, RunContext("orders", live.run_id, live.epoch, 1), 0, 10, 25, dead=[])
    found = job_report(store, "orders", end_offsets=lambda topics: {(T, 0): 25, (T, 1): 5},
                       driver_alive=lambda r: True)
    assert found["offsets"]["partitions"] == [
        {"topic": T, "partition": 0, "stored": 25, "start": None, "end": 25, "lag": 0},
        {"topic": T, "partition": 1, "stored": None, "start": 5, "end": 5, "lag": 0}]
    assert found["offsets"]["lag"] == 0 and found["health"] == "HEALTHY"


def test_kafka_out_of_reach_is_said_and_the_rest_still_shown(store):
    ticket = store.begin_run("orders", 1, "1.0")
    store.record_launch(ticket.run_id, "orders_job.py", json.dumps({"kafka": {"topics": [T]}}))

    def unreachable(topics):
        raise ConnectionError("no broker at 10.0.0.9:9092")

    found = job_report(store, "orders", end_offsets=unreachable, driver_alive=lambda r: None)
    assert found["offsets"]["lag"] is None
    assert "no broker at 10.0.0.9:9092" in found["offsets"]["kafka_error"]
    assert found["runs"] and found["dead_letters"] == {"total": 0, "samples": []}


def test_credentials_in_any_url_are_masked():
    assert masked("kafka sasl://user:pw@b:9093 and https://a:b@h/x") == "kafka sasl://user:***@b:9093 and " \
                                                                       "https://a:***@h/x"
    assert masked("password hunter2 quoted", ["hunter2"]) == "password *** quoted"
