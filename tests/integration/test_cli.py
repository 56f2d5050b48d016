"""The on-call status command, against a real state database."""

from __future__ import annotations

import time

import pytest

from airflow_stream_provider.__main__ import main
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase


def test_status_shows_runs_generations_and_offsets(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = StateStore.from_url(url)
    store.ensure_schema()
    store.ensure_generation("orders", 1, "/ckpt/orders/gen-1", '{"orders":{"0":0}}')
    old = store.begin_run("orders", 1, "1.0")
    store.finish_run(old.run_id, status="FAILED", exit_code=4, failure_kind="DATA_LOSS", message="gone")
    live = store.begin_run("orders", 1, "1.1")
    store.mark_query_started(live.run_id)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO stream_offsets (job_id, topic, partition, next_offset) "
                             "VALUES ('orders', 'orders', 0, 42)")
    store.dispose()

    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job orders: HEALTHY")
    assert live.run_id[:12] in out and old.run_id[:12] in out and "DATA_LOSS" in out
    assert "/ckpt/orders/gen-1" in out and "active" in out
    assert 'stored offsets: {"orders":{"0":42}}' in out


def test_status_shows_where_an_upgrade_stands(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = StateStore.from_url(url)
    store.ensure_schema()
    store.begin_run("orders", 1, "1.0")
    log = UpgradeLog(store)
    upgrade_id = log.begin("orders", "1.0", "2.0", {})
    log.move(upgrade_id, UpgradePhase.STOPPING, {"live_run_id": "r1"})
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert "upgrade 1.0 -> 2.0 in progress: STOPPING" in out
    assert "has ended without resuming or rolling it back, stream_health's recover ends the upgrade" in out

    log.move(upgrade_id, UpgradePhase.VERIFYING, {"new_run_id": "r2"})
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert "upgrade 1.0 -> 2.0 in progress: VERIFYING" in out and "stream_health" not in out

    log.move(upgrade_id, UpgradePhase.DONE, {}, result="rolled back")
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert "last upgrade 1.0 -> 2.0: rolled back" in out and "acting on the job" not in out

    LeaseLog(store).take("orders", "stream_stop/manual__1/stop/-1", "stop", time.time() + 60)
    store.dispose()
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    assert "acting on the job: task stream_stop/manual__1/stop/-1 (stop, for 0 s" in capsys.readouterr().out


def test_status_shows_a_restart_that_stopped_the_run_and_started_none(tmp_path, capsys):
    """A restart's task was lost between its stop and its launch: the job reads STOPPED, yet nobody asked for
    that stop, and the next recovery finishes the restart.  On-call sees both, not a plain STOPPED."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = StateStore.from_url(url)
    store.ensure_schema()
    run = store.begin_run("orders", 1, "1.0")
    store.record_restart("orders", "restart", "STUCK: no batch for 300s", run.run_id, None)
    store.finish_run(run.run_id, status="STOPPED", exit_code=0, message="stopped")
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job orders: STOPPED")
    assert "(STUCK: no batch for 300s) stopped this run and started no new one" in out
    assert "A recovery finishes the restart from the checkpoint" in out

    store.cancel_begun_restarts("orders")  # a person's stop since: the stop is theirs, nothing is owed
    store.dispose()
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert "started no new one" not in out and "A recovery finishes" not in out


def test_status_shows_a_restart_of_a_failed_run_begun_and_not_launched(tmp_path, capsys):
    """A failed run's recovery began its restart and launched nothing yet: at work, or lost.  Which of the two
    is Airflow's to say, which the command does not ask; it names the task to look at."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = StateStore.from_url(url)
    store.ensure_schema()
    run = store.begin_run("orders", 1, "1.0")
    store.finish_run(run.run_id, status="FAILED", exit_code=1, failure_kind="TRANSIENT", message="brokers away")
    store.record_restart("orders", "restart", "FAILED: brokers away", run.run_id, None,
                         "stream_health/asset_triggered__1/recover/-1")
    store.dispose()
    assert main(["status", "--database-url", url, "--job-id", "orders"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job orders: FAILED/TRANSIENT")
    assert ("restart of this run begun at" in out and "by task stream_health/asset_triggered__1/recover/-1, "
            "nothing launched yet; if that task has ended without launching, stream_health's recover finishes it"
            in out), out


def test_status_on_a_database_without_stream_state_says_so(tmp_path, capsys):
    assert main(["status", "--database-url", f"sqlite:///{tmp_path / 'empty.db'}", "--job-id", "x"]) == 2
    assert "no stream state" in capsys.readouterr().err


def test_status_with_checkpoints_then_prune_by_retention(tmp_path, capsys):
    """Generations on disk in Spark's format: two archives and the active one."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    StateStore.from_url(url).ensure_schema()
    job = tmp_path / "ckpt" / "orders"
    for directory, batch, committed in [("archive/gen-1-20260101T000000Z", 4, True),
                                        ("archive/gen-2-20261101T000000Z", 9, True), ("gen-3", 2, False)]:
        for log in ("offsets", "commits"):
            (job / directory / log).mkdir(parents=True)
        (job / directory / "offsets" / str(batch)).write_text(f'v1\n{{}}\n{{"orders":{{"0":{batch * 10}}}}}\n')
        if committed:
            (job / directory / "commits" / str(batch)).write_text("v1\n{}\n")

    assert main(["status", "--database-url", url, "--job-id", "orders", "--checkpoint-root",
                 str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out.split("checkpoints:")[1].splitlines()
    assert [line.split()[:2] for line in out[3:]] == [["1", "archived"], ["2", "archived"], ["3", "active"]]
    assert '{"orders":{"0":20}}' in out[5] and "no (replayed on start)" in out[5]

    assert main(["prune", "--checkpoint-root", str(tmp_path / "ckpt"), "--job-id", "orders"]) == 2
    for flag, value in [("--max-age-days", "nan"), ("--max-age-days", "-1"), ("--keep", "-2"), ("--keep", "all")]:
        with pytest.raises(SystemExit) as refused:  # argparse's usage error, before anything is listed
            main(["prune", "--checkpoint-root", str(tmp_path / "ckpt"), "--job-id", "orders", flag, value])
        assert refused.value.code == 2 and flag in capsys.readouterr().err
    assert len(list((job / "archive").iterdir())) == 2
    assert main(["prune", "--checkpoint-root", str(tmp_path / "ckpt"), "--job-id", "orders", "--keep", "1"]) == 0
    assert "removed" in capsys.readouterr().out
    assert sorted(p.name for p in (job / "archive").iterdir()) == ["gen-2-20261101T000000Z"]
    assert (job / "gen-3" / "offsets" / "2").exists()
