"""A broker that stops answering in the middle of a range read, with kafka-python, the default reader.

The read must neither hang nor hand out a partial range: it fails once it has not advanced for
the stall timeout (shortened here), naming the range, and Spark then runs the read task again in the
same Python worker, whose cached consumer still holds the stalled connection.  That second attempt,
begun while the broker is still silent, must return exactly the range once the broker answers again.

The broker's silence is a real one: Tansu's proxy stands between the consumer and the broker and is
paused with SIGSTOP, so its sockets stay open and nothing answers (a broker in a long GC pause, or a
network that drops packets), unlike a killed proxy, whose connections the client sees close.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid

import pytest
from kafka import KafkaProducer

from airflow_stream_provider import kafka_client
from airflow_stream_provider.kafka_client import KafkaReadError
from stack.outages import KafkaProxy
from tests.integration.ranges import read_kafka_python

#: In the log when the read starts; the rest of the range is produced once the proxy is paused, so the
#: read cannot have fetched it already (a fetch may hold the partition's whole log).
BEFORE = 3_000
RECORDS = 5_000
VALUE = b"x" * 400
STALL_S = 6.0
#: How long the proxy stays paused once the read goes on: longer than one stall, so the retry starts while
#: it is silent, and shorter than two, as in the end-to-end stall (18 s against 12).  Seconds of margin each
#: way, for a loaded machine.
SILENT_S = 9.0


def _produce(bootstrap: str, topic: str, numbers: range) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    for n in numbers:
        producer.send(topic, key=str(n).encode(), value=VALUE, partition=0)
    producer.flush()
    producer.close()


@pytest.fixture
def topic(broker):
    name = f"stall-{uuid.uuid4().hex[:8]}"
    broker.create_topic(name, 1)
    _produce(broker.bootstrap, name, range(BEFORE))
    return name


@pytest.fixture
def proxy(broker, tmp_path):
    instance = KafkaProxy(broker.bootstrap, tmp_path / "kafka-proxy.log").start()
    yield instance
    instance.process.send_signal(signal.SIGCONT)
    # the cached consumer talks to this proxy only: closed before it goes, not left reconnecting
    for key in [key for key in kafka_client._CACHE if key[0] == instance.bootstrap]:
        kafka_client._CACHE.pop(key).close()
    instance.stop()


def test_a_read_the_broker_stops_answering_fails_named_and_its_retry_reads_the_exact_range(
        broker, topic, proxy, monkeypatch):
    monkeypatch.setattr(kafka_client, "STALL_TIMEOUT_S", STALL_S)
    first = kafka_client.read_range_batches(proxy.bootstrap, {}, topic, 0, 0, RECORDS)
    offsets = [record.offset for record in next(first)]
    assert offsets, "the first poll hands out records before the pause"  # only BEFORE of RECORDS exist yet

    proxy.process.send_signal(signal.SIGSTOP)
    _produce(broker.bootstrap, topic, range(BEFORE, RECORDS))  # straight to the broker, not through the proxy
    resumed = time.monotonic()  # the read goes on from here; the proxy answers again SILENT_S later
    thaw = threading.Timer(SILENT_S, proxy.process.send_signal, (signal.SIGCONT,))
    thaw.start()
    try:
        with pytest.raises(KafkaReadError, match=rf"{topic}-0 \[0, {RECORDS}\)"):
            for records in first:  # what the fetches before the pause buffered, then nothing
                offsets.extend(record.offset for record in records)
        failed_s = time.monotonic() - resumed
        assert failed_s < SILENT_S, "the read must give up while the broker is still silent"
        assert offsets == list(range(BEFORE)), "what was fetched before the pause is handed out, in order"

        # Spark's retry of the read task: the same worker, the same cached consumer, the broker still silent.
        retry = read_kafka_python(proxy.bootstrap, topic, 0, RECORDS)
        retried_s = time.monotonic() - resumed
    finally:
        thaw.join()
    assert retried_s > SILENT_S, "the retry must have waited for the broker"
    assert retry.offsets == list(range(RECORDS))
    assert retry.keys == [str(n).encode() for n in range(RECORDS)]
    assert set(retry.values) == {VALUE}


def test_a_read_whose_consumer_must_connect_to_a_gone_broker_gives_up_after_the_request_timeout():
    """Spark's retry of a read task in a new Python worker makes its consumer anew.  With the broker gone,
    kafka-python's constructor waits ``bootstrap_timeout_ms`` (30 s by default); a job that set a shorter
    request timeout to notice an outage sooner gets that bound here too, not 30 s per retry."""
    from kafka.errors import KafkaTimeoutError

    with socket.socket() as probe:  # a port nothing listens on: connections are refused, as to a dead broker
        probe.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
        next(kafka_client.read_range_batches(gone, {"request_timeout_ms": 2_000}, "events", 0, 0, 10))
    assert time.monotonic() - started < kafka_client.STALL_TIMEOUT_S / 2, "bootstrapped for the default 30 s"
    assert not [key for key in kafka_client._CACHE if key[0] == gone], "a consumer that never connected is not kept"
