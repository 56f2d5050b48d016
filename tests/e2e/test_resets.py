"""Resets at their edges, end to end: real DAGs (``dag.test()``), real drivers, the broker, SQLite.

A reset archives the checkpoint and starts a new generation where the results end.  Three edges:
the stored offsets are gone from Kafka and the loss is accepted; nothing was ever committed; and a
job that reads a second stream, whose stored offsets are as much a part of the resume point.
"""

from __future__ import annotations

from sqlalchemy import select, text

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.state import schema
from stack.events import EventProducer
from stack.jobs import wait_until
from tests.dags import provider_scenarios as dags
from tests.dagtest.dagruns import FIXTURE_JOBS, caught_up, run_dag


def _check_applied_once(state, expected: set[str]) -> int:
    """The events table holds exactly ``expected``, and the per-minute counts (increments, which a record
    applied twice would inflate) add up to as many events."""
    with state.store.engine.connect() as conn:
        ids = {r.event_id for r in conn.execute(text("SELECT event_id FROM events"))}
        counted = conn.execute(text("SELECT COALESCE(SUM(event_count), 0) FROM kpi_minute")).scalar()
    assert ids == expected, f"{len(expected - ids)} missing, {len(ids - expected)} unexpected"
    assert counted == len(expected), f"kpi_minute counts {counted} events, {len(expected)} were applied"
    return len(ids)


def _ledger_starts(state, job_id: str, generation: int) -> dict[tuple[str, int], int]:
    table = schema.batches
    with state.store.engine.connect() as conn:
        rows = conn.execute(select(table).where(table.c.job_id == job_id, table.c.generation == generation)
                            .order_by(table.c.batch_id.desc())).all()
    return {(r.topic, r.partition): r.start_offset for r in rows}  # the lowest batch's start wins


def _producer(broker, topic: str, first_id: int, seed: int) -> EventProducer:
    producer = EventProducer(broker, topic, seed=seed, malformed_ratio=0)
    producer.sent = first_id  # event ids e-<n>: keep each producer's ids apart
    return producer


def test_a_reset_that_accepts_data_loss_records_it_and_resumes(stream, broker, figures):
    state, job_id, params, topic = stream["state"], stream["job_id"], stream["params"], stream["topic"]
    before = _producer(broker, topic, 0, seed=7)
    before.send(600)
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(state, job_id, before)
    assert run_dag(dags.stop, params)[0] == "success"
    stored = state.stored_offsets(job_id)

    # The topic is recreated: the stored offsets are beyond everything the new log holds, whose records
    # are all new (the old log's tail past the last commit is what is lost).
    broker.delete_topic(topic)
    broker.create_topic(topic, 3)
    recreated = _producer(broker, topic, 10_000, seed=99)
    recreated.send(30)

    status, tasks = run_dag(dags.reset, params, allow_data_loss=False)
    assert status == "failed" and tasks["reset"][0] == "failed", tasks
    assert state.stored_offsets(job_id) == stored and state.current_generation(job_id) == 1

    status, tasks = run_dag(dags.reset, params, allow_data_loss=True, reason="topic recreated")
    assert status == "success", tasks
    reset = tasks["reset"][1]
    assert reset["generation"] == 2 and len(reset["lost_ranges"]) == len(stored), reset
    resume = {tp: 0 for tp in stored}  # the new log from its earliest offset
    assert kafka_offsets.from_spark_json(reset["starting_offsets"]) == resume
    # The loss is on record, and the stored offsets moved with it: they equal where generation 2 starts.
    losses = state.store.accepted_losses(job_id)
    assert {(r["topic"], r["partition"]): (r["end_offset"], r["resume_offset"]) for r in losses} == {
        tp: (stored[tp], resume[tp]) for tp in stored}
    assert all("accepted: topic recreated" in r["reason"] and r["generation"] == 2 for r in losses)
    assert state.stored_offsets(job_id) == resume

    # Generation 2 resumes there: batch 0 passes the gap check, the new log is applied once.
    after = _producer(broker, topic, 20_000, seed=5)
    after.send(400)
    caught_up(state, job_id, after)
    assert _ledger_starts(state, job_id, 2) == {tp: resume[tp] for tp in _ledger_starts(state, job_id, 2)}
    applied = _check_applied_once(state, set(before.produced.events) | set(recreated.produced.events)
                                  | set(after.produced.events))
    assert run_dag(dags.stop, params)[0] == "success"
    figures.record("reset accepting data loss", lost_partitions=len(losses), applied=applied)


def test_a_reset_with_nothing_committed_resumes_where_the_last_generation_began(stream, broker):
    """A job started at ``latest`` that never committed a batch: its reset must not start at ``latest``
    again, which would skip everything produced since the first start."""
    state, job_id, params, topic = stream["state"], stream["job_id"], stream["params"], stream["topic"]
    producer = _producer(broker, topic, 0, seed=7)
    producer.send(300)  # before the first start: ``latest`` skips these, as asked
    params = {**params, "spec": {**params["spec"], "kafka": {**params["spec"]["kafka"],
                                                             "starting_offsets": "latest"}}}
    assert run_dag(dags.deploy, params)[0] == "success"
    first_start = kafka_offsets.from_spark_json(state.store.get_generation(job_id, 1)["starting_offsets"])
    assert run_dag(dags.stop, params)[0] == "success"
    assert state.stored_offsets(job_id) == {}

    skipped_by_latest = set(producer.produced.events)
    producer.send(200)  # after generation 1 began: these must be applied
    status, tasks = run_dag(dags.reset, params, reason="manual")
    assert status == "success", tasks
    assert kafka_offsets.from_spark_json(tasks["reset"][1]["starting_offsets"]) == first_start
    caught_up(state, job_id, producer)
    _check_applied_once(state, set(producer.produced.events) - skipped_by_latest)
    assert run_dag(dags.stop, params)[0] == "success"


def test_a_reset_resumes_every_topic_the_sink_accounts_for(stream, broker):
    """A job that also reads ``<topic>-control``, from ``latest`` on its first start.  The control topic's
    stored offsets are checked against Kafka with the rest (not taken for a vanished partition that blocks
    every reset), and the new generation's control stream resumes from them, not from ``latest``: what was
    sent to it while no driver ran is applied, once."""
    state, job_id, params, topic = stream["state"], stream["job_id"], stream["params"], stream["topic"]
    control_topic = f"{topic}-control"
    broker.create_topic(control_topic, 2)
    params = {**params, "application": str(FIXTURE_JOBS / "control_topic_from_latest.py")}
    main, control = _producer(broker, topic, 0, seed=7), _producer(broker, control_topic, 50_000, seed=3)
    main.send(400)
    assert run_dag(dags.deploy, params)[0] == "success"  # every stream's start is resolved by now
    control.send(40)

    def stored_by_topic() -> dict[str, dict[int, int]]:
        found: dict[str, dict[int, int]] = {}
        for (t, p), offset in state.stored_offsets(job_id).items():
            found.setdefault(t, {})[p] = offset
        return found

    def caught_up_both() -> bool:
        seen = stored_by_topic()
        return (seen.get(topic) == dict(main.produced.end_offsets)
                and seen.get(control_topic) == dict(control.produced.end_offsets))

    wait_until(caught_up_both, 240, "both streams to be applied", on_timeout=lambda: str(stored_by_topic()))
    assert run_dag(dags.stop, params)[0] == "success"
    stored = state.stored_offsets(job_id)
    main.send(200)
    control.send(20)  # while no driver runs: a start from latest would skip them

    status, tasks = run_dag(dags.reset, params, reason="manual")
    assert status == "success", tasks
    starting = kafka_offsets.from_spark_json(tasks["reset"][1]["starting_offsets"])
    assert starting == stored and {t for t, _ in starting} == {topic, control_topic}
    # Every stream's start is recorded with the generation: batch 0 covers, and gap-checks, them all.
    recorded = kafka_offsets.from_spark_json(state.store.get_generation(job_id, 2)["starting_offsets"])
    assert {tp: o for tp, o in recorded.items() if tp[0] == control_topic} == {
        tp: o for tp, o in stored.items() if tp[0] == control_topic}
    wait_until(caught_up_both, 240, "both streams to be applied after the reset",
               on_timeout=lambda: str(stored_by_topic()))
    _check_applied_once(state, set(main.produced.events) | set(control.produced.events))
    assert run_dag(dags.stop, params)[0] == "success"
