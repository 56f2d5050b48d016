"""The batch commit on real SQLite and PostgreSQL: replay, gap, fencing, forward-only offsets.

No Spark here: the transaction takes plain rows, so its invariants are checked directly and fast.
"""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Column, MetaData, Table, Text, select

from airflow_stream_provider import failures
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


def test_a_dry_runs_commit_is_fenced_though_it_read_the_live_epoch(store, results_table):
    """A dry run (an upgrade's preflight) reads the live run's epoch and must write nothing.  Its sink's
    context holds no epoch (``harness._start_query``), so that a commit it reached by mistake is refused
    instead of accepted under the live run's epoch."""
    live = _run(store)
    dry = RunContext("job", "the-preflight", None, 1)
    batch_plan = plan(store, "job", _batch(0, 0, 2))
    with pytest.raises(FencedError, match="STREAM_RUN_FENCED.*is a dry run .* nothing was written"):
        commit(store, dry, batch_plan, read={(T, 0): 2}, dead_letters=[],
               writes=[Write(results_table, [{"k": "d", "n": 1, "last": "dry"}], ("k",), ("n",))])
    assert _totals(store, results_table) == {}
    assert store.stored_offsets("job") == {}
    commit(store, live, batch_plan, read={(T, 0): 2}, dead_letters=[],
           writes=[Write(results_table, [{"k": "d", "n": 1, "last": "live"}], ("k",), ("n",))])
    assert _totals(store, results_table) == {"d": (1, "live")}


def test_offsets_moved_under_a_plan_are_rejected(store):
    run = _run(store)
    stale = plan(store, "job", _batch(0, 0, 4))
    commit(store, run, plan(store, "job", _batch(0, 0, 4)), read={(T, 0): 4}, dead_letters=[], writes=[])
    with pytest.raises(ConcurrentCommitError, match="stored offsets moved") as raised:
        commit(store, run, stale, read={(T, 0): 4}, dead_letters=[], writes=[])
    assert store.count(schema.batches, job_id="job") == 1
    # this run holds the epoch: the advice is not the fenced run's "a newer run took over"
    verdict = failures.classify(str(raised.value))
    assert (verdict.kind, verdict.signature) == (failures.FailureKind.CONCURRENT, "concurrent-commit"), verdict
    assert f"still holds the job's epoch {run.epoch}" in str(raised.value)


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
    first = plan(store, "job", _batch(0, 0, 2))
    trial_write(store, run, first, dead_letters=[letter], writes=[Write(results_table, [{"k": "a", "n": 1}], ("k",))])
    assert _totals(store, results_table) == {} and store.count(schema.dead_letters) == 0
    refused = Write(results_table, [{"k": None, "n": 1}], ("k",))  # NULL in a primary key column
    with pytest.raises(Exception) as caught:
        trial_write(store, run, first, dead_letters=[letter], writes=[refused])
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
        trial_write(store, run, plan(store, "job", _batch(2, 2 * n, 3 * n)), dead_letters=[], writes=[refused])
    assert dialect.is_data_error(caught.value), repr(caught.value)
    with store.engine.connect() as conn:
        staged = conn.exec_driver_sql("SELECT count(*) FROM pg_class WHERE relname LIKE 'stream_stage_%%'").scalar()
    assert staged == 0 and len(_totals(store, results_table)) == n


def test_per_event_rows_whose_key_comes_back_commit_with_their_offsets_on_postgresql(store):
    """A table without increments takes a direct COPY inside the batch's transaction; a batch that repeats a
    stored key rolls only that COPY back (to its savepoint) and upserts instead: the batch's offsets, dead
    letters and rows commit together, the latest row wins, and the stored offsets move once per batch."""
    from airflow_stream_provider.state import bulk

    if store.dialect != "postgresql":
        pytest.skip("COPY is PostgreSQL's")
    table = Table("per_event", MetaData(), Column("k", Text, primary_key=True), Column("last", Text))
    table.create(store.engine)
    n = bulk.COPY_FROM_ROWS * 2
    run = _run(store)
    for batch_id, (start, last) in enumerate([(0, "first"), (n // 2, "again")]):
        rows = [{"k": f"e-{i}", "last": last} for i in range(start, start + n)]
        first, end = batch_id * (n + 1), (batch_id + 1) * (n + 1)  # n events and a malformed record
        letter = {"topic": T, "partition": 0, "offset": end - 1, "key": None, "value": b"x", "error": "malformed JSON"}
        batch = plan(store, "job", _batch(batch_id, first, end))
        assert not batch.is_replay and not batch.restarted
        outcome = commit(store, run, batch, read={(T, 0): n + 1}, dead_letters=[letter],
                         writes=[Write(table, rows, ("k",))])
        assert outcome.committed_offsets == {(T, 0): end}
    assert table.info["staged_backoff"] == 1  # the second batch met stored keys
    with store.engine.connect() as conn:
        stored = dict(conn.execute(select(table.c.k, table.c.last)).all())
    assert len(stored) == n + n // 2 and stored["e-0"] == "first" and stored[f"e-{n // 2}"] == "again"
    assert store.count(schema.dead_letters) == 2


def test_a_driver_frozen_inside_its_commit_loses_the_job_row_to_a_takeover_on_postgresql(
    postgres_url, monkeypatch
):
    """A driver frozen (SIGSTOP, a suspended VM) inside its commit holds the job's row, which a takeover
    must update.  PostgreSQL ends the frozen session after the idle-in-transaction timeout (1 s here, 30 s
    by default), the takeover proceeds, and the frozen driver, woken, fails having written nothing."""
    import threading

    from sqlalchemy import exc as sql_errors

    from airflow_stream_provider.state import dialect
    from airflow_stream_provider.state.store import StateStore

    monkeypatch.setattr(dialect, "IDLE_IN_TRANSACTION_TIMEOUT_S", 1)
    frozen_store = StateStore.from_url(postgres_url)
    frozen_store.ensure_schema()
    table = Table("totals", MetaData(), Column("k", Text, primary_key=True), Column("n", BigInteger))
    table.create(frozen_store.engine)
    zombie = _run(frozen_store)
    batch_plan = plan(frozen_store, "job", _batch(0, 0, 2))
    frozen, wake, failed = threading.Event(), threading.Event(), []

    class FreezingRows(list):
        def __iter__(self):  # the rows are read inside the transaction, after the epoch check took the row
            frozen.set()
            wake.wait(30)
            return super().__iter__()

    def commit_and_freeze():
        try:
            commit(frozen_store, zombie, batch_plan, read={(T, 0): 2}, dead_letters=[],
                   writes=[Write(table, FreezingRows([{"k": "z", "n": 1}] * 300), ("k",), ("n",))])
        except Exception as error:
            failed.append(error)

    driver = threading.Thread(target=commit_and_freeze, daemon=True)
    driver.start()
    assert frozen.wait(30)
    # the taking-over side gives up on the row after 10 s instead of waiting forever (its URL's own options)
    takeover = StateStore.from_url(f"{postgres_url}?options=-c%20lock_timeout%3D10000")
    try:
        newer = takeover.begin_run("job", 1, "1.0")
        assert newer.epoch == zombie.epoch + 1
        with takeover.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW lock_timeout").scalar() == "10s"
            assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "1s"
    finally:
        wake.set()
        driver.join(30)
        takeover.dispose()
    # SQLSTATE 25P03: the transaction's fault, not a refused value, so no poison isolation starts on it
    assert len(failed) == 1 and "idle-in-transaction timeout" in str(failed[0]), failed
    assert isinstance(failed[0], sql_errors.DBAPIError) and not dialect.is_data_error(failed[0])
    assert _totals(frozen_store, table) == {} and frozen_store.stored_offsets("job") == {}
    frozen_store.dispose()
