"""What any producer wrote reads back exactly: record batches compressed with each codec Kafka has, read
from a real broker by the Python source's default reader (kafka-python) and by the fast one
(confluent-kafka), with each batch's CRC checked in C."""

from __future__ import annotations

import uuid

import kafka.record.util
import pytest
from kafka import KafkaProducer

from airflow_stream_provider import confluent_reader, kafka_client
from airflow_stream_provider.kafka_client import Columns

RECORDS = 500


@pytest.fixture(scope="module", params=["gzip", "snappy", "lz4", "zstd"])
def compressed(request, broker):
    """One partition written in compressed batches of many records each (batching on, as producers run)."""
    topic = f"codec-{request.param}-{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, compression_type=request.param, linger_ms=20,
                             batch_size=16 * 1024)
    values = [f'{{"n": {n}, "codec": "{request.param}"}}'.encode() * (1 + n % 5) for n in range(RECORDS)]
    for value in values:
        producer.send(topic, value=value, partition=0)
    producer.flush()
    producer.close()
    yield broker.bootstrap, topic, values
    for consumer in confluent_reader._CACHE.values():  # cached per process, as in a Spark worker
        consumer.close()
    confluent_reader._CACHE.clear()


def test_kafka_python_checks_batch_crcs_in_c():
    """Installed with the package (kafka-python's crc32c extra): in Python the check was half of decoding."""
    assert kafka.record.util.crc32c_c is not None


@pytest.mark.parametrize("start,end", [(0, RECORDS), (123, 377)])
def test_every_codec_reads_back_exactly_through_both_readers(compressed, start, end):
    bootstrap, topic, values = compressed
    polls = kafka_client.read_range_batches(bootstrap, {}, topic, 0, start, end)
    read = [Columns.of(records) for records in polls]
    assert [o for c in read for o in c.offsets] == list(range(start, end))
    assert [v for c in read for v in c.values] == values[start:end]
    fast = list(confluent_reader.read_range_columns(confluent_reader.client_config(bootstrap, {}), topic, 0, start,
                                                    end))
    assert [o for c in fast for o in c.offsets] == list(range(start, end))
    assert [v for c in fast for v in c.values] == values[start:end]
