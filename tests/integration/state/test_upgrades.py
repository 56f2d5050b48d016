"""The upgrade records on SQLite and PostgreSQL: which job's latest upgrade leaves it down."""

from __future__ import annotations

import time

from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase


def test_the_latest_upgrades_that_leave_jobs_down_are_read_in_one_query(store):
    """The watcher's question each poll: which job's latest upgrade is in STOPPING, STARTING or ROLLING_BACK
    (at work, or left there by a task that ended).  Not an earlier upgrade, not a finished one, not one in
    its preflight or verifying a running version."""
    upgrades = UpgradeLog(store)
    for job_id, phase in (("stopping", UpgradePhase.STOPPING), ("starting", UpgradePhase.STARTING),
                          ("rolling-back", UpgradePhase.ROLLING_BACK), ("verifying", UpgradePhase.VERIFYING),
                          ("superseded", UpgradePhase.STOPPING), ("done", UpgradePhase.STOPPING)):
        upgrades.move(upgrades.begin(job_id, "1.0", "1.1", {}), phase, {"task": f"up/{job_id}/upgrade/-1"})
    time.sleep(0.01)  # newer upgrades of two of the jobs
    upgrades.begin("superseded", "1.1", "1.2", {})  # in its preflight: the job runs
    upgrades.move(upgrades.begin("done", "1.1", "1.2", {}), UpgradePhase.DONE, {}, result="upgraded")

    leaving = upgrades.leaving_down()
    assert sorted(leaving) == ["rolling-back", "starting", "stopping"], leaving
    assert (leaving["starting"].phase, leaving["starting"].task) == (UpgradePhase.STARTING, "up/starting/upgrade/-1")
    assert list(upgrades.leaving_down("stopping")) == ["stopping"]
    assert upgrades.leaving_down("superseded") == {} and upgrades.leaving_down("unknown") == {}
