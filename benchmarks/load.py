"""Backlogs for the benchmarks: many events fast, with every acknowledged position remembered.

The tests' producer sends one record per request (slow, exact end offsets); a benchmark backlog of
hundreds of thousands of events needs batching.  Tansu answers ListOffsets(latest) from the last record
*batch*, so a batched tail would stay invisible to the job's planning until the next produce: every
backlog ends with one single-record produce per partition, which makes the end offsets exact.
"""

from __future__ import annotations

import json

from kafka import KafkaProducer

from stack.events import MALFORMED_SAMPLES, EventProducer, Produced


class BacklogProducer(EventProducer):
    """``EventProducer`` with batching; ``send`` returns once Kafka acknowledged every record."""

    def __init__(self, broker, topic: str, *, partitions: int, seed: int = 7, malformed_ratio: float = 0.01):
        super().__init__(broker, topic, seed=seed, malformed_ratio=malformed_ratio)
        self.partitions = partitions
        self.single = self.producer  # one record per request: seals each partition's tail
        self.producer = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=10, batch_size=512 * 1024,
                                      acks="all", max_request_size=8 * 1024 * 1024)

    def send(self, count: int) -> None:
        bulk = max(0, count - self.partitions)
        super().send(bulk)
        self.producer.flush()
        batched, self.producer = self.producer, self.single
        try:
            for partition in range(min(count, self.partitions)):
                self._send_one_to(partition)
        finally:
            self.producer = batched

    def _send_one_to(self, partition: int) -> None:
        n = self.sent
        self.sent += 1
        event = {"event_id": f"e-{n}", "user_id": f"u-{self.random.randrange(50)}", "kind": "view",
                 "amount": 1.25, "ts": (self.base.isoformat().replace("+00:00", "Z"))}
        meta = self.producer.send(self.produced.topic, value=json.dumps(event).encode(),
                                  partition=partition).get(timeout=60)
        with self.produced.lock:
            self.produced.events[event["event_id"]] = event
            self.produced.end_offsets[partition] = max(self.produced.end_offsets[partition], meta.offset + 1)

    def close(self) -> None:
        self.producer.close()
        self.single.close()


__all__ = ["BacklogProducer", "MALFORMED_SAMPLES", "Produced"]
