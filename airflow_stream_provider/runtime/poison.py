"""Poison records: a record the job's own code cannot handle (a UDF raises on it, an ANSI cast overflows,
the database refuses the row its results make) would otherwise fail its batch on every restart.

The sink isolates such records by bisection over the batch's offsets (``PositionSpace``), running the
job's code on halves: about log2(batch size) evaluations per poison record.  This module holds what
that needs apart from the sink itself: which failures can be a record's fault at all, the positions,
the poison records and the ``[STREAM_POISON_RECORD] topic/partition:offset`` error the provider reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from airflow_stream_provider import failures
from airflow_stream_provider.state import transaction
from airflow_stream_provider.state.store import ResultTableError

#: Longest dead-letter reason kept (the full error is in the driver log).
MAX_REASON_CHARS = 2000

#: What the sink does with a record the job's code cannot handle (see the module docstring).
POISON_POLICIES = ("dead_letter", "fail")

#: More failing records than this in one batch means the code, not the data, is wrong.
MAX_POISON_PER_BATCH = 5

# Failures that are nobody's record: a stop or shutdown cancelling the batch, the JVM going away.
_NOT_A_RECORD = re.compile(
    r"(?i)\bcancel|InterruptedException|SparkContext (?:was|has been) shut down|Py4JNetworkError|"
    r"Answer from Java side is empty|Error while (?:sending|receiving)"
)

#: Reads the records of one partition's offset range [start, end) as (topic, partition, offset, key,
#: value, timestamp) tuples: how the sink gets records again without the job's code.
RawReader = Callable[[str, int, int, int], Iterable[tuple]]

RAW_SCHEMA = "topic string, partition int, offset long, key binary, value binary, timestamp timestamp"

# Logical plan nodes that keep state in a streaming query (analyzed, before the optimizer turns a Distinct
# into an Aggregate), where they read a stream: a join only where both its sides do.
_STATEFUL_NODE = re.compile(
    r"Aggregate|Distinct|Deduplicate\w*|FlatMapGroups\w*|TransformWithState\w*|\w*Join|GlobalLimit|Window|"
    r"SessionWindow\w*|UpdateEventTimeWatermarkColumn"
)

class PoisonRecordError(RuntimeError):
    """A record the job cannot handle and cannot (or, by its policy, must not) dead-letter.

    The message starts with ``[STREAM_POISON_RECORD] topic/partition:offset``: the failure table
    classifies it as POISON and the provider reports the position.
    """

@dataclass(frozen=True)
class Poison:
    """One isolated record and why the job failed on it."""

    topic: str
    partition: int
    offset: int
    reason: str

    @property
    def position(self) -> str:
        return f"{self.topic}/{self.partition}:{self.offset}"

class NotIsolated(Exception):
    """The failure could not be pinned on single records."""

@dataclass(frozen=True)
class Source:
    """Where isolation takes a batch's records from: ``select(condition)`` gives the transformed records
    at the chosen positions; ``raw`` holds (key, value) by position when they were read from Kafka."""

    select: Callable[[Column], DataFrame]
    raw: dict[tuple[str, int, int], tuple[bytes | None, bytes | None]] | None = None

def keeps_state(records: DataFrame) -> bool:
    """Does this streaming query keep state (aggregation, deduplication, stream-stream joins, ...)?  Read
    from its analyzed plan; when the plan cannot be read, assume it does (the careful answer).  What reads
    no stream keeps none: a stream-static join (enrichment from a table), or an aggregate of the static
    side, leaves the query stateless, with write-behind and records dead-lettered one by one."""
    try:
        return _keeps_state(records._jdf.queryExecution().analyzed())
    except Exception:
        return True


def _keeps_state(node) -> bool:
    if not node.isStreaming():
        return False
    children = node.children()
    sides = [children.apply(i) for i in range(children.size())]
    name = node.nodeName()
    if _STATEFUL_NODE.fullmatch(name) and (not name.endswith("Join") or all(side.isStreaming() for side in sides)):
        return True
    return any(_keeps_state(side) for side in sides)

class PositionSpace:
    """The batch's fresh offsets laid end to end (partition after partition), so that a bisection can
    cut it anywhere.  Offsets missing from Kafka (compaction, transaction markers) just match nothing."""

    def __init__(self, plan: transaction.BatchPlan):
        self.ranges = sorted(
            (topic, partition, first, plan.range.end[(topic, partition)])
            for (topic, partition), first in plan.apply_from.items()
        )
        self.size = sum(end - first for _, _, first, end in self.ranges)

    def slice(self, lo: int, hi: int) -> Column:
        """The records at positions [lo, hi) of the space."""
        conditions, base = [], 0
        for topic, partition, first, end in self.ranges:
            a, b = max(lo - base, 0), min(hi - base, end - first)
            if a < b:
                conditions.append(
                    (F.col("topic") == topic)
                    & (F.col("partition") == partition)
                    & (F.col("offset") >= first + a)
                    & (F.col("offset") < first + b)
                )
            base += end - first
        return F.coalesce(reduce(lambda x, y: x | y, conditions), F.lit(False)) if conditions else F.lit(False)

    def position(self, index: int) -> tuple[str, int, int]:
        base = 0
        for topic, partition, first, end in self.ranges:
            if index < base + end - first:
                return topic, partition, first + index - base
            base += end - first
        raise IndexError(index)

def positions(at: Sequence[tuple[str, int, int]]) -> Column:
    """The records at these (topic, partition, offset) positions: false, not null, on a row with no position
    (a stateful operator's own output), so that ``~positions(...)`` keeps such rows."""
    by_partition: dict[transaction.TopicPartition, list[int]] = {}
    for topic, partition, offset in at:
        by_partition.setdefault((topic, partition), []).append(offset)
    conditions = [
        (F.col("topic") == topic) & (F.col("partition") == partition) & F.col("offset").isin(offsets)
        for (topic, partition), offsets in sorted(by_partition.items())
    ]
    return F.coalesce(reduce(lambda x, y: x | y, conditions), F.lit(False)) if conditions else F.lit(False)

def may_be_record_error(err: BaseException) -> bool:
    """Could a record be what this failure comes from?  An error in the job's code or an unclassified
    Spark error may be; an outage, a stop, a fenced run, an incompatible checkpoint are not."""
    if isinstance(err, PoisonRecordError | transaction.FencedError | transaction.ConcurrentCommitError
                  | transaction.OffsetGapError | ResultTableError):
        return False
    text = _text(err)
    if _NOT_A_RECORD.search(text):
        return False
    return failures.classify(text).kind in (failures.FailureKind.USER_CODE, failures.FailureKind.UNKNOWN)

def _text(err: BaseException) -> str:
    parts = [f"{type(err).__name__}: {err}"]
    cause = err.__cause__ or err.__context__
    while cause is not None and len(parts) < 5:
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)

def reason(err: BaseException) -> str:
    """What went wrong, in one line: the exception line of a Python traceback (a UDF's error reaches the
    driver inside Spark's message), else the message's first line."""
    text = str(err).split("\nJVM stacktrace:", 1)[0]
    lines = text.splitlines()
    line = next((ln for ln in lines if ln.strip()), type(err).__name__)
    marker = "Traceback (most recent call last):"
    if marker in text:
        after = text.rsplit(marker, 1)[1].splitlines()[1:]
        line = next((ln for ln in after if ln.strip() and not ln[0].isspace()), line)
    return re.sub(r"\s*SQLSTATE: \w+\s*$", "", line.strip())[:MAX_REASON_CHARS]

def poison_error(poison: Sequence[Poison], why: str) -> PoisonRecordError:
    first = poison[0]
    others = f" (and {', '.join(p.position for p in poison[1:])})" if len(poison) > 1 else ""
    return PoisonRecordError(
        f"[STREAM_POISON_RECORD] {first.position}{others}: {first.reason}; {why}. Inspect the record at "
        f"that position, fix the job (or the dead-letter table), then restart: the batch is replayed and "
        f"nothing is lost"
    )
