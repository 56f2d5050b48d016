"""The batch commit on real SQLite and PostgreSQL: replay, gap, fencing, forward-only offsets.

No Spark here: the transaction takes plain rows, so its invariants are checked directly and fast.
"""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, Text, select

from airflow_stream_provider.state import schema
from airflow_stream_provider.state.transaction import (
    BatchRange,
    ConcurrentCommitError,
    FencedError,
    OffsetGapError,
    RunContext,
    Write,
    commit,
    plan,
)

T = "events-topic"


@pytest.fixture
def results_table(store):
    table = Table(
        "totals",
        MetaData(),
        Column("k", Text, primary_key=True),
        Column("n", BigInteger),
        Column("last", Text),
    )
    table.create(store.engine)
    return table


def _run(store, job="job") -> RunContext:
    ticket = store.begin_run(job, 1, "1.0")
    return RunContext(job, ticket.run_id, ticket.epoch, 1)


def _totals(store, table):
    with store.engine.connect() as conn:
        return {r.k: (r.n, r.last) for r in conn.execute(select(table))}


def _batch(batch_id, start, end):
    return BatchRange(batch_id, {(T, 0): start}, {(T, 0): end})


def test_replay_is_skipped_and_increments_apply_once(store, results_table):
    run = _run(store)
    batch = _batch(0, 0, 3)
    rows = [{"k": "a", "n": 2, "last": "x"}, {"k": "a", "n": 1, "last": "y"}]
    first = commit(
        store,
        run,
        plan(store, "job", batch),
        read={(T, 0): 3},
        dead_letters=[
            {
                "topic": T,
                "partition": 0,
                "offset": 2,
                "key": None,
                "value": b"\xff",
                "error": "malformed JSON",
            }
        ],
        writes=[Write(results_table, rows, ("k",), ("n",))],
    )
    assert first.committed_offsets == {(T, 0): 3} and first.dead == {(T, 0): 1}
    assert _totals(store, results_table) == {"a": (3, "y")}  # summed in-batch, last value wins
    # Spark replays batch 0 after a crash between the DB commit and its checkpoint commit.
    replay = plan(store, "job", batch)
    assert replay.is_replay
    outcome = commit(
        store,
        run,
        replay,
        read={(T, 0): 3},
        dead_letters=[],
        writes=[Write(results_table, rows, ("k",), ("n",))],
    )
    assert outcome.skipped_replay
    assert _totals(store, results_table) == {"a": (3, "y")}
    assert store.stored_offsets("job") == {(T, 0): 3}
    assert store.count(schema.batches, job_id="job") == 1
    assert store.count(schema.dead_letters, job_id="job") == 1


def test_gap_is_refused(store, results_table):
    run = _run(store)
    commit(store, run, plan(store, "job", _batch(0, 0, 5)), read={(T, 0): 5}, dead_letters=[], writes=[])
    with pytest.raises(OffsetGapError, match=r"STREAM_OFFSET_GAP.*records \[5, 9\) would be lost"):
        plan(store, "job", _batch(1, 9, 12))
    assert store.stored_offsets("job") == {(T, 0): 5}


def test_partial_overlap_applies_only_the_new_part(store):
    run = _run(store)
    commit(store, run, plan(store, "job", _batch(0, 0, 5)), read={(T, 0): 5}, dead_letters=[], writes=[])
    overlapping = plan(store, "job", _batch(0, 3, 8))  # a new generation started below the stored offset
    assert overlapping.apply_from == {(T, 0): 5}
    assert (
        not overlapping.is_fresh(T, 0, 4)
        and overlapping.is_fresh(T, 0, 5)
        and not overlapping.is_fresh(T, 0, 8)
    )


def test_zombie_driver_is_fenced(store, results_table):
    zombie = _run(store)
    newer = _run(store)
    assert newer.epoch == zombie.epoch + 1
    batch_plan = plan(store, "job", _batch(0, 0, 2))
    with pytest.raises(
        FencedError,
        match=rf"STREAM_RUN_FENCED.*holds epoch {zombie.epoch}.*current epoch is "
        rf"{newer.epoch}",
    ):
        commit(
            store,
            zombie,
            batch_plan,
            read={(T, 0): 2},
            dead_letters=[],
            writes=[Write(results_table, [{"k": "z", "n": 1, "last": "zombie"}], ("k",), ("n",))],
        )
    assert _totals(store, results_table) == {}
    assert store.stored_offsets("job") == {}
    commit(
        store,
        newer,
        batch_plan,
        read={(T, 0): 2},
        dead_letters=[],
        writes=[Write(results_table, [{"k": "z", "n": 1, "last": "newer"}], ("k",), ("n",))],
    )
    assert _totals(store, results_table) == {"z": (1, "newer")}


def test_offsets_moved_under_a_plan_are_rejected(store):
    run = _run(store)
    stale = plan(store, "job", _batch(0, 0, 4))
    commit(store, run, plan(store, "job", _batch(0, 0, 4)), read={(T, 0): 4}, dead_letters=[], writes=[])
    with pytest.raises(ConcurrentCommitError, match="stored offsets moved"):
        commit(store, run, stale, read={(T, 0): 4}, dead_letters=[], writes=[])
    assert store.count(schema.batches, job_id="job") == 1


def test_dry_run_does_not_take_the_epoch(store):
    live = _run(store)
    ticket = store.begin_run("job", 1, "2.0", dry_run=True)
    assert ticket.epoch == live.epoch
    assert store.current_epoch("job") == live.epoch


def test_trial_write_answers_without_writing(store, results_table):
    """Poison isolation asks the database whether it accepts a batch's rows: the answer is the error it
    raises (a data error for a refused value), and nothing stays written either way."""
    from airflow_stream_provider.state.dialect import is_data_error
    from airflow_stream_provider.state.transaction import trial_write

    run = _run(store)
    letter = {"topic": T, "partition": 0, "offset": 1, "key": None, "value": b"x", "error": "bad"}
    trial_write(store, run, 0, dead_letters=[letter], writes=[Write(results_table, [{"k": "a", "n": 1}], ("k",))])
    assert _totals(store, results_table) == {} and store.count(schema.dead_letters) == 0
    refused = Write(results_table, [{"k": None, "n": 1}], ("k",))  # NULL in a primary key column
    with pytest.raises(Exception) as caught:
        trial_write(store, run, 0, dead_letters=[letter], writes=[refused])
    assert is_data_error(caught.value), caught.value
    assert store.count(schema.dead_letters) == 0


def test_a_large_postgresql_write_goes_through_copy_with_the_same_upsert_and_errors(store, results_table):
    """From ``COPY_FROM_ROWS`` rows, PostgreSQL takes the rows through COPY into a temporary table: the
    upsert keeps its meaning (increments add, other columns overwrite), a refused value is still a data
    error (what poison isolation asks), and nothing of the staging stays behind."""
    from airflow_stream_provider.state import bulk, dialect
    from airflow_stream_provider.state.transaction import trial_write

    if store.dialect != "postgresql":
        pytest.skip("COPY is PostgreSQL's")
    n = bulk.COPY_FROM_ROWS * 3
    run = _run(store)
    for batch_id, (start, last) in enumerate([(0, "first"), (n, "second")]):
        rows = [{"k": f"key-{i}", "n": i, "last": last} for i in range(n)]
        commit(store, run, plan(store, "job", _batch(batch_id, start, start + n)), read={(T, 0): n},
               dead_letters=[], writes=[Write(results_table, rows, ("k",), ("n",))])
    totals = _totals(store, results_table)
    assert len(totals) == n and totals["key-7"] == (14, "second") and totals[f"key-{n - 1}"] == (2 * (n - 1), "second")
    refused = Write(results_table, [{"k": None, "n": 1}] + [{"k": f"x{i}", "n": 1} for i in range(n)], ("k",))
    with pytest.raises(Exception) as caught:
        trial_write(store, run, 2, dead_letters=[], writes=[refused])
    assert dialect.is_data_error(caught.value), repr(caught.value)
    with store.engine.connect() as conn:
        staged = conn.exec_driver_sql("SELECT count(*) FROM pg_class WHERE relname LIKE 'stream_stage_%%'").scalar()
    assert staged == 0 and len(_totals(store, results_table)) == n
