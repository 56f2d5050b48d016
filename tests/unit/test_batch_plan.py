"""What a batch's plan says about its records: which are replays of records already in the results."""

from __future__ import annotations

from airflow_stream_provider.state.transaction import BatchPlan, BatchRange

T = "events"


def _plan(start: dict, end: dict, apply_from: dict) -> BatchPlan:
    return BatchPlan(BatchRange(7, start, end), stored={}, apply_from=apply_from)


def test_a_fresh_batch_replays_nothing():
    assert _plan({(T, 0): 10}, {(T, 0): 20}, {(T, 0): 10}).replayed == 0


def test_a_batch_replayed_in_part_counts_the_committed_records_of_each_partition():
    plan = _plan({(T, 0): 10, (T, 1): 0, (T, 2): 5}, {(T, 0): 20, (T, 1): 8, (T, 2): 9},
                 {(T, 0): 14})  # partition 0 from 14 on; 1 and 2 wholly committed before the restart
    assert plan.replayed == 4 + 8 + 4
    assert not plan.is_replay


def test_a_new_partition_and_a_log_that_went_backwards_replay_nothing():
    plan = _plan({(T, 0): 50}, {(T, 0): 30, (T, 1): 6}, {(T, 0): 0, (T, 1): 0})  # recreated, and new
    assert plan.replayed == 0
