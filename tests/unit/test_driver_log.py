"""Following a driver's log into the task log: whole lines only, secrets masked, a flood capped."""

from __future__ import annotations

from airflow_stream_provider.lifecycle.driver_log import MAX_LINES_PER_READ, DriverLogFollower, log_tail


def test_only_whole_lines_are_handed_out_each_once(tmp_path):
    path = tmp_path / "driver.log"
    path.write_text("$ spark-submit app.py\nstarting")
    follower = DriverLogFollower(str(path), from_start=True)
    assert follower.new_lines() == ["$ spark-submit app.py"]
    assert follower.new_lines() == []
    with path.open("a") as log:
        log.write(" the query\nbatch 0 committed\n")
    assert follower.new_lines() == ["starting the query", "batch 0 committed"]


def test_a_follower_from_the_end_skips_what_was_there(tmp_path):
    path = tmp_path / "driver.log"
    path.write_text("old line\n")
    follower = DriverLogFollower(str(path), from_start=False)
    with path.open("a") as log:
        log.write("stop marker seen\n")
    assert follower.new_lines() == ["stop marker seen"]


def test_secrets_are_masked_and_a_missing_log_reads_empty(tmp_path):
    path = tmp_path / "driver.log"
    follower = DriverLogFollower(str(path), from_start=True, secrets=["s3cret", None])
    assert follower.new_lines() == []  # not written yet, or on another host
    path.write_text("connecting to postgresql://stream:s3cret@db/results\n")
    assert follower.new_lines() == ["connecting to postgresql://stream:***@db/results"]
    assert "s3cret" not in log_tail(str(path), secrets=["s3cret"])


def test_a_flood_is_capped_and_says_where_the_rest_is(tmp_path):
    path = tmp_path / "driver.log"
    path.write_text("".join(f"line {i}\n" for i in range(MAX_LINES_PER_READ + 50)))
    lines = DriverLogFollower(str(path), from_start=True).new_lines()
    assert len(lines) == MAX_LINES_PER_READ + 1
    assert lines[0] == f"... 50 driver log lines skipped (all are in {path})"
    assert lines[-1] == f"line {MAX_LINES_PER_READ + 49}"
