"""The on-call status command, against a real state database."""

from __future__ import annotations

from airflow_stream_provider.__main__ import main
from airflow_stream_provider.state.store import StateStore


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


def test_status_on_a_database_without_stream_state_says_so(tmp_path, capsys):
    assert main(["status", "--database-url", f"sqlite:///{tmp_path / 'empty.db'}", "--job-id", "x"]) == 2
    assert "no stream state" in capsys.readouterr().err
