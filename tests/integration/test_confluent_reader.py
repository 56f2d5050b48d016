"""The fast reader (confluent-kafka) against the default (kafka-python) on a real broker: the same
records of every range, column for column, and a clear error for a range the broker no longer has, or no
longer has in full."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaProducer

from airflow_stream_provider import confluent_reader, failures, kafka_client
from airflow_stream_provider.failures import FailureKind
from airflow_stream_provider.kafka_client import Columns, KafkaReadError
from airflow_stream_provider.spec import StreamJobSpec
from tests.integration.ranges import joined, read_kafka_python

RECORDS = 240


@pytest.fixture(scope="module")
def log(broker):
    """One partition of RECORDS records: null keys, a tombstone, binary values, a set timestamp."""
    topic = f"reader-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, batch_size=0, linger_ms=0)
    for n in range(RECORDS):
        key = None if n % 3 == 0 else f"k{n}".encode()
        value = None if n == 7 else bytes([n % 256, 0, 255]) + f"value {n}".encode()
        producer.send(topic, key=key, value=value, partition=0, timestamp_ms=1_700_000_000_000 + n)
    producer.flush()
    producer.close()
    yield broker.bootstrap, topic
    _close_cached_readers()


def _close_cached_readers() -> None:
    for consumer in confluent_reader._CACHE.values():  # cached per process, as in a Spark worker
        consumer.close()
    confluent_reader._CACHE.clear()


def _confluent(bootstrap: str, topic: str, start: int, end: int) -> Columns:
    config = confluent_reader.client_config(bootstrap, {})
    return joined(confluent_reader.read_range_columns(config, topic, 0, start, end))


@pytest.mark.parametrize("start,end", [(0, RECORDS), (3, 17), (RECORDS - 5, RECORDS), (100, 101)])
def test_the_fast_reader_reads_exactly_what_kafka_python_reads(log, start, end):
    bootstrap, topic = log
    expected = read_kafka_python(bootstrap, topic, start, end)
    assert expected.offsets == list(range(start, end))
    assert _confluent(bootstrap, topic, start, end) == expected
    assert _confluent(bootstrap, topic, start, end) == expected  # the cached consumer, reassigned


@pytest.mark.parametrize("read", [read_kafka_python, _confluent], ids=["kafka-python", "confluent-kafka"])
def test_a_range_past_the_logs_end_is_data_loss_not_a_hang(log, monkeypatch, read):
    """A range that begins past the log's end (records gone, a recreated topic): this broker answers with
    nothing rather than an out-of-range error, so the read stalls; after the stall timeout (shortened
    here) it asks where the log ends and fails as data loss naming the range, where the fast reader used to
    report an unreachable broker, which the job restarts again and again."""
    monkeypatch.setattr(kafka_client, "STALL_TIMEOUT_S", 3.0)
    bootstrap, topic = log
    asked = time.monotonic()
    with pytest.raises(KafkaReadError) as raised:
        read(bootstrap, topic, RECORDS + 10, RECORDS + 20)
    assert time.monotonic() - asked < 15
    message = str(raised.value)
    assert f"reading {topic}-0 [{RECORDS + 10}, {RECORDS + 20}): the log ends at offset {RECORDS}" in message
    found = failures.classify(f"KafkaReadError: {message}")
    assert (found.kind, found.signature) == (FailureKind.DATA_LOSS, "kafka-data-loss"), found


@pytest.mark.parametrize("read", [read_kafka_python, _confluent], ids=["kafka-python", "confluent-kafka"])
def test_a_range_that_ends_past_the_log_is_data_loss_not_an_unreachable_broker(log, monkeypatch, read):
    """A replayed batch whose records the log no longer holds in full (retention, an unclean leader
    election, a recreated topic): the read fails as data loss, naming the records gone, and the job is not
    restarted again and again as if Kafka were away."""
    monkeypatch.setattr(kafka_client, "STALL_TIMEOUT_S", 3.0)  # both readers' default
    bootstrap, topic = log
    with pytest.raises(KafkaReadError) as raised:
        read(bootstrap, topic, RECORDS - 10, RECORDS + 20)
    message = str(raised.value)
    assert f"reading {topic}-0 [{RECORDS - 10}, {RECORDS + 20}): the log ends at offset {RECORDS}" in message
    assert f"records [{RECORDS}, {RECORDS + 20}) (retention" in message
    found = failures.classify(f"KafkaReadError: {message}")
    assert (found.kind, found.signature) == (FailureKind.DATA_LOSS, "kafka-data-loss"), found


def test_a_partition_with_transactions_reads_as_kafka_python_plans_it(broker):
    """A transactional producer's aborted transaction, then one left open: the batch's end is planned by
    kafka-python (read_uncommitted, the log's end), and the fast reader reads the same records up to it.
    With librdkafka's default (read_committed) it stopped at the open transaction and failed the batch as
    data loss."""
    topic = f"reader-txn-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    plain = broker.producer()
    for n in range(3):
        plain.send(topic, value=f"plain {n}".encode(), partition=0)
    plain.flush()
    plain.close()
    transactional = broker.producer(transactional_id=f"tx-{topic}", enable_idempotence=True)
    transactional.init_transactions()
    for outcome in ("aborted", "open"):
        transactional.begin_transaction()
        for n in range(2):
            transactional.send(topic, value=f"{outcome} {n}".encode(), partition=0)
        transactional.flush()
        if outcome == "aborted":
            transactional.abort_transaction()
    try:
        _, latest = kafka_client.watermarks(kafka_client.consumer(broker.bootstrap), [topic])
        end = latest[(topic, 0)]
        expected = read_kafka_python(broker.bootstrap, topic, 0, end)
        assert [v.decode().split()[0] for v in expected.values].count("open") == 2, expected
        assert _confluent(broker.bootstrap, topic, 0, end) == expected
    finally:
        transactional.abort_transaction()
        transactional.close()
        _close_cached_readers()


class _Watermarks:
    """A consumer whose partition log holds [low, high).  A stand-in: this broker keeps every record (no
    retention, no DeleteRecords), so a log that starts after a range begins cannot be made here."""

    def __init__(self, low: int, high: int):
        self.bounds = (low, high)

    def get_watermark_offsets(self, tp, timeout, cached):
        return self.bounds


def test_a_range_that_begins_below_the_logs_start_is_data_loss_naming_the_records_gone():
    """What the fast reader raises when Kafka answers a read with OFFSET_OUT_OF_RANGE (librdkafka's
    ``_AUTO_OFFSET_RESET``, auto.offset.reset=error) or a read stalls: the lost records, as data loss."""
    below = confluent_reader._gone(_Watermarks(100, 300), "orders", 2, 40, 160)
    assert str(below).startswith("[KAFKA_DATA_LOSS.COULD_NOT_READ_OFFSET_RANGE] reading orders-2 [40, 160)")
    assert "records [40, 100) (retention)" in str(below)
    found = failures.classify(f"KafkaReadError: {below}")
    assert (found.kind, found.signature) == (FailureKind.DATA_LOSS, "kafka-data-loss"), found
    assert "records [150, 160)" in str(confluent_reader._gone(_Watermarks(0, 150), "orders", 2, 40, 160))
    assert confluent_reader._gone(_Watermarks(0, 300), "orders", 2, 40, 160) is None  # held: a stall


def test_one_set_of_client_options_serves_the_planning_and_the_fast_reader():
    """A job's TLS and SASL settings in kafka-python's names (which plans every batch, and which the spec
    checks them against) reach librdkafka in its own: it refused ``sasl.plain.username`` and
    ``ssl.cafile`` ("No such configuration property"), so the fast reader could not reach a secured
    cluster.  librdkafka checks the names when the consumer is made, before it connects."""
    import certifi
    from confluent_kafka import Consumer

    options = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.plain.username": "reader",
               "sasl_plain_password": "secret", "ssl.cafile": certifi.where(),  # a CA bundle librdkafka loads
               "ssl.check.hostname": "false", "fetch.max.wait.ms": "100", "bootstrap.timeout.ms": "5000",
               "request.timeout.ms": "12000"}
    spec = StreamJobSpec.from_dict({"job_id": "secured", "version": "1", "checkpoint_root": "/tmp/c",
                                    "database_url": "sqlite:////tmp/x.db", "kafka": {
                                        "bootstrap_servers": "127.0.0.1:9", "topics": ["t"], "client_options": options}})
    config = confluent_reader.client_config("127.0.0.1:9", {f"kafka.{k}": str(v)  # as the harness hands them
                                                            for k, v in spec.kafka.client_options.items()})
    assert {k: config[k] for k in ("sasl.username", "sasl.password", "ssl.ca.location",
                                   "ssl.endpoint.identification.algorithm", "fetch.wait.max.ms")} == {
        "sasl.username": "reader", "sasl.password": "secret", "ssl.ca.location": certifi.where(),
        "ssl.endpoint.identification.algorithm": "none", "fetch.wait.max.ms": "100"}
    assert "bootstrap.timeout.ms" not in config  # kafka-python's own
    assert kafka_client.stall_timeout_s(config) == 12.0
    Consumer(config).close()
