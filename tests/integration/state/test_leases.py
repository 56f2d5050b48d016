"""The job's lease on SQLite and PostgreSQL: one owner at a time, its own to extend, free once it runs out,
one winner when several tasks take it at the same moment, and the upgrades whose task holds a job down."""

from __future__ import annotations

import threading
import time

from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase


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
    assert extended.until == now + 600 and extended.taken_at == taken_at
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


def test_the_upgrades_holding_jobs_down_are_read_with_their_leases_in_one_query(store):
    """The watcher's question: which job's latest upgrade stopped it (or rolls it back) while an upgrade's
    task holds the lease, or held it until it ran out.  Not an earlier upgrade, not a finished one, not a
    job whose lease another kind of task holds."""
    upgrades, leases, now = UpgradeLog(store), LeaseLog(store), time.time()
    for job_id in ("down", "expired", "done", "other-task", "preflight", "no-lease"):
        upgrades.move(upgrades.begin(job_id, "1.0", "1.1", {}), UpgradePhase.STOPPING, {"n": 1})
    leases.take("down", "up/r1/upgrade/-1", "upgrade", now + 300, {"run_id": "r-new"})
    leases.take("expired", "up/r2/upgrade/-1", "upgrade", now - 1)  # its task died; the lease ran out
    time.sleep(0.01)  # a newer upgrade of the same jobs
    upgrades.move(upgrades.begin("done", "1.1", "1.2", {}), UpgradePhase.DONE, {}, result="upgraded")
    leases.take("done", "up/r3/upgrade/-1", "upgrade", now + 300)
    leases.take("other-task", "health/r4/recover/-1", "recover", now + 300)
    upgrades.begin("preflight", "1.1", "1.2", {})  # a newer one, still in its preflight: the job runs
    leases.take("preflight", "up/r5/upgrade/-1", "upgrade", now + 300)

    holding = upgrades.holding_down()
    assert sorted(holding) == ["down", "expired"], holding
    upgrade, lease = holding["down"]
    assert (upgrade.phase, upgrade.detail, upgrade.to_version) == (UpgradePhase.STOPPING, {"n": 1}, "1.1")
    assert (lease.owner, lease.launch) == ("up/r1/upgrade/-1", {"run_id": "r-new"})
    assert holding["expired"][1].until < time.time()
    assert list(upgrades.holding_down("down")) == ["down"] and upgrades.holding_down("done") == {}
