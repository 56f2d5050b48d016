"""The job's lease on SQLite and PostgreSQL: one owner at a time, its own to extend, free once it runs out,
and one winner when several tasks take it at the same moment."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_stream_provider.state.leases import LeaseLog


def test_one_owner_holds_the_lease_until_it_lets_go_or_it_runs_out(store):
    leases = LeaseLog(store)
    now = time.time()
    assert leases.take("job", "deploy/run-1/submit/-1", "submit", now + 60) is None
    held = leases.take("job", "health/run-7/recover/-1", "recover", now + 60)
    assert (held.owner, held.action) == ("deploy/run-1/submit/-1", "submit")
    assert "task deploy/run-1/submit/-1 (submit" in held.describe(time.time())
    taken_at = held.taken_at

    assert leases.take("job", "deploy/run-1/submit/-1", "submit", now + 600) is None  # its own: extended
    extended = leases.get("job")
    # stored by the database's clock, read back in this host's terms (``state.clock``): equal to the microsecond
    assert extended.until == pytest.approx(now + 600, abs=1e-3) and extended.taken_at == taken_at
    assert leases.take("other-job", "health/run-7/recover/-1", "recover", now + 60) is None  # per job

    leases.release("job", "health/run-7/recover/-1")  # not its lease: nothing happens
    assert leases.get("job").owner == "deploy/run-1/submit/-1"
    leases.release("job", "deploy/run-1/submit/-1")
    assert leases.get("job") is None
    assert leases.take("job", "health/run-7/recover/-1", "recover", now + 60) is None


def test_a_lease_that_ran_out_is_taken_and_its_old_owner_cannot_let_go_of_the_new_one(store):
    leases = LeaseLog(store)
    assert leases.take("job", "dead-task", "restart", time.time() - 1) is None  # its task died; it ran out
    assert leases.take("job", "recover", "recover", time.time() + 60) is None
    leases.release("job", "dead-task")
    assert leases.get("job").owner == "recover"
    assert leases.take("job", "dead-task", "restart", time.time() + 60).owner == "recover"


def test_of_tasks_taking_the_lease_at_once_exactly_one_holds_it(store):
    leases, until = LeaseLog(store), time.time() + 60
    start, results = threading.Barrier(8), {}

    def take(owner: str) -> None:
        start.wait()
        results[owner] = leases.take("job", owner, "submit", until)

    threads = [threading.Thread(target=take, args=(f"task-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    winners = [owner for owner, held in results.items() if held is None]
    assert len(results) == 8 and len(winners) == 1, results
    assert leases.get("job").owner == winners[0]
    assert all(held.owner == winners[0] for held in results.values() if held is not None)
