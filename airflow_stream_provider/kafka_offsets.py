"""Kafka offsets in Spark's JSON form, and the arithmetic both sides need on them.

Spark writes a Kafka source position as ``{"topic": {"0": 42, "1": 7}}``: the *next* offset to read
per partition.  The runtime plans batches with these functions, the sink compares them with the stored
offsets, and the Airflow side validates stored offsets before a reset.  Pure: no pyspark, no airflow.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

#: ``{(topic, partition): next_offset}``: the internal form; Spark's JSON uses string partition keys.
Offsets = dict[tuple[str, int], int]

EARLIEST = -2  # Spark's sentinel values inside a startingOffsets JSON
LATEST = -1


def to_spark_json(offsets: Mapping[tuple[str, int], int]) -> str:
    """Render offsets as Spark's startingOffsets / offset-log JSON, stably ordered."""
    return json.dumps(to_spark_dict(offsets), sort_keys=True, separators=(",", ":"))


def to_spark_dict(offsets: Mapping[tuple[str, int], int]) -> dict[str, dict[str, int]]:
    nested: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        nested.setdefault(topic, {})[str(partition)] = int(offset)
    return nested


def from_spark_json(text: str | Mapping) -> Offsets:
    """Parse Spark's offset JSON (string or already-decoded dict) into the internal form.

    Raises ValueError naming the offending entry: a startingOffsets typo must fail before a query starts.
    """
    data = json.loads(text) if isinstance(text, str) else text
    if not isinstance(data, Mapping):
        raise ValueError(f'offsets must be a JSON object like {{"topic": {{"0": 42}}}}, got {text!r}')
    result: Offsets = {}
    for topic, partitions in data.items():
        if not isinstance(partitions, Mapping):
            raise ValueError(f"offsets for topic {topic!r} must be an object of partition -> offset")
        for partition, offset in partitions.items():
            try:
                p = int(partition)
            except (TypeError, ValueError):
                raise ValueError(f"partition {partition!r} of topic {topic!r} is not an integer") from None
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < EARLIEST or p < 0:
                raise ValueError(
                    f"offset {offset!r} for {topic}-{partition} must be an integer >= 0 "
                    f"(or {EARLIEST} for earliest, {LATEST} for latest)"
                )
            result[(topic, p)] = offset
    return result


@dataclass(frozen=True)
class LostRange:
    """Records ``[start, end)`` of one partition that can no longer be read from Kafka."""

    topic: str
    partition: int
    start: int
    end: int | None  # None: unknown end (the partition's log went backwards, e.g. the topic was recreated)
    reason: str

    def describe(self) -> str:
        end = "?" if self.end is None else str(self.end)
        return f"{self.topic}-{self.partition} [{self.start}, {end}): {self.reason}"

    def to_dict(self) -> dict:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "start": self.start,
            "end": self.end,
            "reason": self.reason,
        }


def find_lost_ranges(
    positions: Mapping[tuple[str, int], int],
    earliest: Mapping[tuple[str, int], int],
    latest: Mapping[tuple[str, int], int],
) -> list[LostRange]:
    """Compare positions (next offsets to read) with what Kafka still holds.

    A position below the partition's earliest offset fell out of retention; a position above its
    latest offset means the log went backwards (topic deleted and recreated, unclean leader election).
    A partition Kafka no longer has at all is lost from the position on.
    """
    lost = []
    for tp, position in sorted(positions.items()):
        topic, partition = tp
        if tp not in latest:
            lost.append(LostRange(topic, partition, position, None, "partition no longer exists in Kafka"))
        elif position < earliest[tp]:
            lost.append(
                LostRange(
                    topic,
                    partition,
                    position,
                    earliest[tp],
                    f"fell out of retention (earliest available offset is {earliest[tp]})",
                )
            )
        elif position > latest[tp]:
            lost.append(
                LostRange(
                    topic,
                    partition,
                    latest[tp],
                    position,
                    f"offsets went backwards: stored position {position} is beyond the latest "
                    f"offset {latest[tp]} (topic recreated or truncated)",
                )
            )
    return lost


def resolve(
    starting: str | Mapping[tuple[str, int], int],
    earliest: Mapping[tuple[str, int], int],
    latest: Mapping[tuple[str, int], int],
) -> Offsets:
    """Turn ``earliest``/``latest``/explicit offsets into concrete next offsets for every known partition.

    Partitions that the explicit offsets do not name start at earliest, as Spark's Kafka source does
    for partitions it discovers later.
    """
    if starting == "earliest":
        return dict(earliest)
    if starting == "latest":
        return dict(latest)
    resolved = dict(earliest)
    for tp, offset in starting.items():
        resolved[tp] = (
            earliest.get(tp, 0) if offset == EARLIEST else latest.get(tp, 0) if offset == LATEST else offset
        )
    return resolved


def limit_range(
    start: Mapping[tuple[str, int], int], latest: Mapping[tuple[str, int], int], max_records: int | None
) -> Offsets:
    """The end offsets of the next batch: up to ``latest``, at most ``max_records`` in total.

    Like Spark's Kafka source, the budget is shared in proportion to each partition's backlog so a
    busy partition cannot starve the others; every partition with a backlog gets at least one record.
    """
    end = {tp: max(latest.get(tp, off), off) for tp, off in start.items()}
    backlog = {tp: end[tp] - start[tp] for tp in end}
    total = sum(backlog.values())
    if max_records is None or total <= max_records:
        return end
    budget = max(max_records, 1)
    shares = {tp: min(lag, max(lag * budget // total, 1 if lag else 0)) for tp, lag in backlog.items()}
    # what rounding down left (less than one record a partition) goes to the partitions with the most
    # still unread, so a limited batch reads exactly its budget
    left = budget - sum(shares.values())
    unread = sorted((tp for tp in backlog if shares[tp] < backlog[tp]), key=lambda tp: shares[tp] - backlog[tp])
    for tp in unread[: max(left, 0)]:
        shares[tp] += 1
    return {tp: start[tp] + share for tp, share in shares.items()}


#: A run's first batch, and the first after the source caught up, read at most this many records.
FIRST_BATCH_RECORDS = 10_000


def batch_limit(previous_records: int | None, ceiling: int | None) -> int | None:
    """How many records the next batch may read: at most ``FIRST_BATCH_RECORDS`` for a run's first batch
    and for one after a batch that read fewer (the source had caught up), else the ``ceiling``
    (``maxOffsetsPerTrigger``; None: no limit).

    Most of a micro-batch's cost is fixed (planning and scheduling its Spark jobs, the Python source's
    tasks, one database transaction), so a backlog drains fastest in batches of the ceiling; a small
    first batch lets a restart on a backlog, or the start of a burst, commit as soon as it would have with
    small batches.  Each step between the two sizes would cost a batch's fixed time: one step is enough."""
    if ceiling is None:
        return None
    return ceiling if (previous_records or 0) >= FIRST_BATCH_RECORDS else min(ceiling, FIRST_BATCH_RECORDS)


def records_between(start: Mapping[tuple[str, int], int], end: Mapping[tuple[str, int], int]) -> int:
    """Offsets from ``start`` to ``end`` summed over partitions (a partition new in ``end`` from 0)."""
    return sum(max(stop - start.get(tp, 0), 0) for tp, stop in end.items())


def plan_batch_end(position: Mapping[tuple[str, int], int], earliest: Mapping[tuple[str, int], int],
                   latest: Mapping[tuple[str, int], int], max_records: int | None) -> Offsets:
    """The end of the next batch from the current position: partitions that appeared since the last
    batch join at their earliest offset (nothing of theirs is skipped), then the admission limit applies."""
    start = dict(position)
    for tp, first in earliest.items():
        start.setdefault(tp, first)
    return limit_range(start, latest, max_records)


def read_tasks(ranges: Mapping[tuple[str, int], tuple[int, int]], tasks: int | None) -> list[list[tuple[str, int]]]:
    """The partitions of a batch's ``ranges`` (``{tp: (start, end)}``) grouped into at most ``tasks`` read
    tasks of about equal records, each group in topic-partition order; None: one task per partition, as
    Spark's Kafka connector plans.  The largest range goes first to the task with the fewest records."""
    order = sorted(ranges)
    if tasks is None or tasks >= len(order):
        return [[tp] for tp in order]
    groups: list[list[tuple[str, int]]] = [[] for _ in range(tasks)]
    load = [0] * tasks
    for tp in sorted(order, key=lambda tp: (-(ranges[tp][1] - ranges[tp][0]), tp)):
        least = load.index(min(load))
        groups[least].append(tp)
        load[least] += ranges[tp][1] - ranges[tp][0]
    return [sorted(group) for group in groups if group]


def from_offset_log(lines: list[str]) -> Offsets:
    """The Kafka positions in one offsets-log entry's source lines (after the version and metadata lines).

    A job may read more than one Kafka stream (the harness's ``kafka_stream``); their positions are
    merged, keyed by topic and partition.  ``-`` (a source with no offset yet) contributes nothing.
    """
    merged: Offsets = {}
    for line in lines:
        if line.strip() in ("", "-"):
            continue
        for tp, offset in from_spark_json(line).items():
            if tp in merged:
                raise ValueError(f"{tp[0]}-{tp[1]} is read by two sources of the same query")
            merged[tp] = offset
    return merged

