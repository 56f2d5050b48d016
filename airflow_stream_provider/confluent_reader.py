"""Exact-range reads through confluent-kafka (librdkafka): the Python source's optional fast reader.

kafka-python decodes record batches in Python, about 16 us of a core per record here; librdkafka does it
in C, about 1 us of the calling thread per record (``make bench``'s throughput section measures both).
The contract is ``kafka_client.read_range_batches``'s: the records of ``[start, end)`` of one partition,
in offset order, as columns a poll at a time, ending on the position (offsets may have holes) and
failing with ``KafkaReadError`` when the broker stalls or the range is gone.  Planning (watermarks,
offsets) stays on kafka-python; only the read tasks use this module, when the spec says
``kafka.reader: confluent-kafka`` and the ``confluent`` extra is installed where Spark runs Python.

Pure: no pyspark, no airflow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping

from airflow_stream_provider.kafka_client import (
    LOG_END_TIMEOUT_MS,
    MAX_POLL_RECORDS,
    PYTHON_ONLY_SETTINGS,
    Columns,
    KafkaReadError,
    kafka_properties,
    read_below_start,
    read_failed,
    read_stalled,
    read_truncated,
    stall_timeout_s,
)

READER = "confluent-kafka"
#: librdkafka prefetches up to 64 MB per partition by default; a read task needs its range, not more.
QUEUED_KBYTES = 8192

_CACHE: dict[tuple, object] = {}
_LOCK = threading.Lock()


def available() -> bool:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return True


#: librdkafka's name for each kafka-python setting a job spec may give (``kafka.client_options`` are checked
#: against kafka-python's, which plans every batch) where the two differ; None: kafka-python's alone (its
#: own objects, metrics, a bootstrap timeout), not passed on.  The rest are Kafka's dotted names in both.
LIBRDKAFKA_NAMES: dict[str, str | None] = {
    "ssl_cafile": "ssl.ca.location", "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location", "ssl_password": "ssl.key.password", "ssl_crlfile": "ssl.crl.location",
    "ssl_ciphers": "ssl.cipher.suites", "ssl_check_hostname": "ssl.endpoint.identification.algorithm",
    "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
    "sasl_kerberos_name": "sasl.kerberos.principal", "fetch_max_wait_ms": "fetch.wait.max.ms",
    "receive_buffer_bytes": "socket.receive.buffer.bytes", "send_buffer_bytes": "socket.send.buffer.bytes",
    "max_in_flight_requests_per_connection": "max.in.flight.requests.per.connection",
    **dict.fromkeys(PYTHON_ONLY_SETTINGS),
}


def librdkafka_properties(properties: Mapping[str, object]) -> dict[str, object]:
    """A job's Kafka client properties (kafka-python's settings, in either spelling) in librdkafka's names,
    so that one ``kafka.client_options`` serves the planning and this reader: TLS files and SASL
    credentials are named differently in each."""
    found: dict[str, object] = {}
    for name, value in properties.items():
        keyword = name.replace(".", "_")
        target = LIBRDKAFKA_NAMES.get(keyword, keyword.replace("_", "."))
        if target is None:
            continue
        if keyword == "ssl_check_hostname":  # a boolean in kafka-python, an algorithm in librdkafka
            value = "https" if str(value).lower() in ("true", "1") else "none"
        found[target] = value
    return found


def client_config(bootstrap: str, options: Mapping[str, str]) -> dict[str, object]:
    """librdkafka settings from Spark-style ``kafka.*`` options (``librdkafka_properties``)."""
    config: dict[str, object] = {
        "bootstrap.servers": bootstrap,
        "group.id": "airflow-stream-provider-reader",  # required by librdkafka; nothing is committed
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "error",
        "queued.max.messages.kbytes": QUEUED_KBYTES,
        # What kafka-python plans with (and Spark's JVM source reads): librdkafka's own default,
        # read_committed, stops at an open transaction, short of the planned end, which then looks like
        # records gone (data loss).  A job that sets isolation.level plans and reads with its own.
        "isolation.level": "read_uncommitted",
    }
    return {**config, **librdkafka_properties(kafka_properties(options))}


def _consumer(config: dict[str, object]):
    from confluent_kafka import Consumer

    key = tuple(sorted((k, str(v)) for k, v in config.items()))
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is None:
            cached = _CACHE[key] = Consumer(config)
        return cached


def read_range_columns(config: dict[str, object], topic: str, partition: int, start: int, end: int
                       ) -> Iterator[Columns]:
    """The records of ``[start, end)`` of one partition, a poll at a time (see the module docstring)."""
    from confluent_kafka import KafkaError, TopicPartition

    client = _consumer(config)
    client.assign([TopicPartition(topic, partition, start)])
    stall_s = stall_timeout_s(config)
    try:
        position, advanced_at = start, time.monotonic()
        while position < end:
            messages = client.consume(num_messages=min(MAX_POLL_RECORDS, end - position), timeout=0.5)
            columns = Columns([], [], [], [])
            for message in messages:
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        if message.offset() < end:  # planned from the log's end: records are gone
                            raise read_truncated(topic, partition, start, end, message.offset())
                        # a range planned up to the log's end is complete (trailing transaction
                        # markers leave no record to see)
                        position = end
                        continue
                    if error.code() == KafkaError._AUTO_OFFSET_RESET:  # Kafka answered OFFSET_OUT_OF_RANGE
                        raise _gone(client, topic, partition, start, end) or read_failed(
                            topic, partition, start, end, f"OffsetOutOfRangeError: {error}")
                    raise read_failed(topic, partition, start, end, str(error))
                offset = message.offset()
                if offset >= end:  # the rest belongs to the next batch
                    position = end
                    break
                position = offset + 1
                if offset < start:
                    continue
                columns.offsets.append(offset)
                columns.keys.append(message.key())
                columns.values.append(message.value())
                kind, timestamp = message.timestamp()
                columns.timestamps.append(timestamp if kind else -1)  # kind 0: no timestamp set
            if columns.offsets:
                advanced_at = time.monotonic()
                yield columns
            elif time.monotonic() - advanced_at > stall_s:
                raise _gone(client, topic, partition, start, end) or read_stalled(
                    topic, partition, start, end, position, stall_s)
    finally:
        client.unassign()


def _gone(client, topic: str, partition: int, start: int, end: int) -> KafkaReadError | None:
    """Data loss when the partition's log no longer holds the range (it ends before the range does, or
    starts after it begins), as ``kafka_client`` reads it; None when the broker does not answer either (a
    stall) or holds the range.  Asked of the broker, not taken from the last fetch."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        low, high = client.get_watermark_offsets(TopicPartition(topic, partition),
                                                 timeout=LOG_END_TIMEOUT_MS / 1000, cached=False)
    except KafkaException:
        return None
    if high < end:
        return read_truncated(topic, partition, start, end, high)
    if low > start:
        return read_below_start(topic, partition, start, end, low)
    return None
