"""Offset arithmetic shared by the source, the sink and the reset path."""

from __future__ import annotations

import pytest

from airflow_stream_provider.kafka_offsets import (
    FIRST_BATCH_RECORDS,
    batch_limit,
    find_lost_ranges,
    from_spark_json,
    limit_range,
    plan_batch_end,
    read_tasks,
    records_between,
    resolve,
    to_spark_json,
)

A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)


def test_spark_json_round_trip():
    offsets = {A0: 42, A1: 7, B0: 0}
    assert to_spark_json(offsets) == '{"a":{"0":42,"1":7},"b":{"0":0}}'
    assert from_spark_json(to_spark_json(offsets)) == offsets


@pytest.mark.parametrize("bad", ['{"a": {"x": 1}}', '{"a": {"0": -5}}', '{"a": 3}', "[1]", '{"a": {"0": true}}'])
def test_malformed_offsets_are_refused(bad):
    with pytest.raises(ValueError):
        from_spark_json(bad)


def test_lost_ranges_retention_backwards_and_vanished():
    lost = find_lost_ranges({A0: 5, A1: 90, B0: 3}, earliest={A0: 20, A1: 0}, latest={A0: 50, A1: 30})
    assert [(r.topic, r.partition, r.start, r.end) for r in lost] == [("a", 0, 5, 20), ("a", 1, 30, 90),
                                                                     ("b", 0, 3, None)]
    assert "fell out of retention" in lost[0].reason and "went backwards" in lost[1].reason
    assert find_lost_ranges({A0: 20}, {A0: 20}, {A0: 50}) == []


def test_resolve_sentinels_and_unnamed_partitions():
    earliest, latest = {A0: 2, A1: 3}, {A0: 10, A1: 11}
    assert resolve("earliest", earliest, latest) == earliest
    assert resolve("latest", earliest, latest) == latest
    assert resolve({A0: -1}, earliest, latest) == {A0: 10, A1: 3}


def test_limit_shares_the_budget_by_backlog():
    end = limit_range({A0: 0, A1: 0, B0: 0}, {A0: 900, A1: 100, B0: 0}, 100)
    assert end == {A0: 90, A1: 10, B0: 0}
    assert limit_range({A0: 0}, {A0: 5}, 100) == {A0: 5}
    assert limit_range({A0: 0, A1: 0}, {A0: 1000, A1: 1}, 10) == {A0: 9, A1: 1}  # no partition starves
    # shares rounded down: the records left over go to the partitions with the most unread
    assert limit_range({A0: 0, A1: 0, B0: 0}, {A0: 100, A1: 100, B0: 100}, 100) == {A0: 34, A1: 33, B0: 33}


def test_new_partitions_join_at_their_earliest_offset():
    end = plan_batch_end({A0: 10}, earliest={A0: 0, A1: 4}, latest={A0: 12, A1: 9}, max_records=None)
    assert end == {A0: 12, A1: 9}
    start_of_new = plan_batch_end({A0: 12}, earliest={A0: 0, A1: 4}, latest={A0: 12, A1: 4}, max_records=None)
    assert start_of_new[A1] == 4


def test_a_run_starts_with_a_small_batch_then_reads_up_to_the_ceiling():
    """A run's first batch is small (a restart commits quickly); after a full one, batches read up to the
    ceiling while the backlog lasts; a caught-up batch makes the next small again (the start of a burst)."""
    ceiling, backlog, position, sizes = 100_000, 400_000, {A0: 0, A1: 0}, []
    latest = {A0: backlog // 2, A1: backlog // 2}
    previous = None
    while position != latest:
        end = plan_batch_end(position, {A0: 0, A1: 0}, latest, batch_limit(previous, ceiling))
        previous = records_between(position, end)
        sizes.append(previous)
        position = end
    assert sizes == [FIRST_BATCH_RECORDS, 100_000, 100_000, 100_000, 90_000]
    assert batch_limit(FIRST_BATCH_RECORDS, ceiling) == ceiling
    assert batch_limit(300, ceiling) == FIRST_BATCH_RECORDS  # caught up: back to the first size
    assert batch_limit(None, 1_500) == 1_500  # a ceiling below the first size is the size
    assert batch_limit(None, None) is None and batch_limit(5, None) is None  # no ceiling: all available


def test_records_between_counts_new_partitions_from_zero():
    assert records_between({A0: 10}, {A0: 15, A1: 3}) == 8
    assert records_between({A0: 10}, {A0: 10}) == 0


def test_read_tasks_group_partitions_by_records():
    ranges = {A0: (0, 900), A1: (100, 400), B0: (0, 500)}
    assert read_tasks(ranges, None) == [[A0], [A1], [B0]], "one task per partition, as Spark's connector plans"
    assert read_tasks(ranges, 3) == read_tasks(ranges, 8) == [[A0], [A1], [B0]]
    assert read_tasks(ranges, 1) == [[A0, A1, B0]]
    assert read_tasks(ranges, 2) == [[A0], [A1, B0]], "the largest range alone, the other two together"
    assert read_tasks({}, 1) == []
    four = {("t", p): (0, n) for p, n in enumerate([10, 10, 10, 10])}
    assert sorted(map(len, read_tasks(four, 2))) == [2, 2]
