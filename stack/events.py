"""Produce example events (some malformed) and compute what the results must be.

The producer remembers the partition and offset Kafka acknowledged for every record, so the checks
compare the database with what was really written, not with what a test meant to write.

It batches, and seals each partition's tail with a single-record produce: Tansu answers
ListOffsets(latest) from the base offset of a partition's last record *batch*, so a batched tail would stay
invisible to the job's planning until the next produce.  One record per request throughout sends 1,600
events a second here: a minute for a test's 100,000-event backlog.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

from kafka.partitioner.default import murmur2

MALFORMED_SAMPLES = (
    b"{not json",
    b'{"event_id": "x", "user_id": "u", "kind": "k", "amount": "lots", "ts": "2026-11-22T10:00:00Z"}',
    b'{"user_id": "u", "kind": "k", "amount": 1, "ts": "2026-11-22T10:00:00Z"}',
    b"\xff\xfe\x00binary garbage",
    b'{"event_id": "y", "user_id": "u", "kind": "k", "amount": 1, "ts": "yesterday"}',
    b"[1, 2, 3]",
)


@dataclass
class Produced:
    """What Kafka acknowledged: valid events by id and malformed records by (partition, offset)."""

    topic: str
    events: dict[str, dict] = field(default_factory=dict)
    malformed: dict[tuple[int, int], bytes] = field(default_factory=dict)
    end_offsets: Counter = field(default_factory=Counter)  # partition -> next offset
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total(self) -> int:
        return len(self.events) + len(self.malformed)

    def kpi_minute(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(user_id, minute ISO) -> (event_count, amount_cents), recomputed from what was produced."""
        kpi: dict[tuple[str, str], list[int]] = {}
        for event in self.events.values():
            minute = event["ts"][:16]  # "YYYY-MM-DDTHH:MM"
            entry = kpi.setdefault((event["user_id"], minute), [0, 0])
            entry[0] += 1
            entry[1] += round(event["amount"] * 100)
        return {k: (v[0], v[1]) for k, v in kpi.items()}


class EventProducer:
    CHUNK = 2_000  # records queued before their acknowledgements are awaited

    def __init__(self, broker, topic: str, *, seed: int = 7, malformed_ratio: float = 0.01):
        self.producer = broker.producer()  # one record per request: each partition's tail, send_record
        self.bulk = broker.producer(linger_ms=10, batch_size=512 * 1024, max_request_size=8 * 1024 * 1024)
        self.produced = Produced(topic)
        self.random = random.Random(seed)
        self.malformed_ratio = malformed_ratio
        self.sent = 0
        self.base = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)
        self._partitions: int | None = None

    def send(self, count: int) -> None:
        # In chunks: a record expires ``delivery_timeout_ms`` (120 s) after it was queued, and tens of
        # thousands queued at once outlast that on a busy machine.
        for start in range(0, count, self.CHUNK):
            self._send_chunk(min(self.CHUNK, count - start))

    def _next(self) -> tuple[dict | None, bytes | None, bytes]:
        """The next record: (event, key, payload), event None for a malformed one (which has no key)."""
        n = self.sent
        self.sent += 1
        if self.random.random() < self.malformed_ratio:
            return None, None, MALFORMED_SAMPLES[n % len(MALFORMED_SAMPLES)]
        event = {
            "event_id": f"e-{n}",
            "user_id": f"u-{self.random.randrange(50)}",
            "kind": self.random.choice(("view", "click", "buy")),
            "amount": round(self.random.uniform(0, 100), 2),
            "ts": (self.base + dt.timedelta(seconds=n // 7)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        return event, event["user_id"].encode(), json.dumps(event).encode()

    def _partition(self, key: bytes | None) -> int:
        """Where the record goes: by its key's hash as Kafka's default partitioner does, a keyless one
        round-robin.  Chosen here, so that the chunk's last record of each partition is known."""
        if self._partitions is None:
            self._partitions = len(self.bulk.partitions_for(self.produced.topic))
        if key is None:
            return self.sent % self._partitions
        return (murmur2(key) & 0x7FFFFFFF) % self._partitions

    def _send_chunk(self, count: int) -> None:
        routed = []  # (partition, event, key, payload)
        for _ in range(count):
            event, key, payload = self._next()
            routed.append((self._partition(key), event, key, payload))
        last = {record[0]: i for i, record in enumerate(routed)}  # each partition's last record
        self._acknowledged(self._send(self.bulk, [r for i, r in enumerate(routed) if i != last[r[0]]]))
        # sent once every batch is acknowledged: each tail lands after its partition's batches
        self._acknowledged(self._send(self.producer, [routed[i] for i in sorted(last.values())]))

    def _send(self, producer, routed: list) -> list:
        return [(producer.send(self.produced.topic, key=key, value=payload, partition=partition), event, payload)
                for partition, event, key, payload in routed]

    def _acknowledged(self, futures) -> None:
        for future, event, payload in futures:
            meta = future.get(timeout=60)
            with self.produced.lock:
                if event is None:
                    self.produced.malformed[(meta.partition, meta.offset)] = payload
                else:
                    self.produced.events[event["event_id"]] = event
                self._advance(meta)

    def send_record(self, value: bytes | None, key: bytes | None = None) -> tuple[int, int]:
        """One exact record, sent now: its (partition, offset).  Kafka's end offsets move with it; what the
        record is (an event, a malformed one) is the caller's to record."""
        meta = self.producer.send(self.produced.topic, key=key, value=value).get(timeout=60)
        with self.produced.lock:
            self._advance(meta)
        return meta.partition, meta.offset

    def _advance(self, meta) -> None:
        ends = self.produced.end_offsets
        ends[meta.partition] = max(ends[meta.partition], meta.offset + 1)

    def close(self) -> None:
        for producer in (self.bulk, self.producer):
            producer.flush()
            producer.close()


class BackgroundProducer(threading.Thread):
    """Sends ``total`` events in chunks while the test kills and restarts drivers."""

    def __init__(self, producer: EventProducer, total: int, chunk: int = 200, pause_s: float = 0.05):
        super().__init__(daemon=True)
        self.producer, self.total, self.chunk, self.pause_s = producer, total, chunk, pause_s
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while self.producer.sent < self.total and not self.done.is_set():
                self.producer.send(min(self.chunk, self.total - self.producer.sent))
                self.done.wait(self.pause_s)
        except BaseException as err:
            self.error = err
        finally:
            self.done.set()


class Trickle:
    """A steady stream of events while a DAG runs (a live topic never stops), until the block ends."""

    def __init__(self, producer: EventProducer, chunk: int = 25, pause_s: float = 0.5):
        self.background = BackgroundProducer(producer, total=10**9, chunk=chunk, pause_s=pause_s)

    def __enter__(self) -> Trickle:
        self.background.start()
        return self

    def __exit__(self, *exc) -> None:
        self.background.done.set()
        self.background.join(30)
        if self.background.error is not None:
            raise self.background.error

