"""Where a generation's batch 0 starts (``runtime.generation_start``), on a real broker and a real state
database (SQLite and PostgreSQL), without a Spark driver.

The checkpoint's offsets log is read by a function the harness hands in; here it returns what a lost,
restored or unreadable checkpoint's log would say, the cases Spark cannot be made to produce on demand.
The drivers that go through them end to end are in ``tests/e2e/test_checkpoint_edges.py``."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from airflow_stream_provider import failures, kafka_offsets
from airflow_stream_provider.runtime.generation_start import GenerationStart
from airflow_stream_provider.runtime.startup import StartupError
from airflow_stream_provider.state import schema
from stack.jobs import make_spec


def _no_batch():
    return None


@pytest.fixture
def spec(broker, topic, job_id, database_url, tmp_path):
    with broker.producer() as producer:
        for partition in range(3):
            for _ in range(5 + partition):
                producer.send(topic, value=b"{}", partition=partition)
    return make_spec(job_id, broker.bootstrap, topic, database_url, tmp_path / "checkpoints")


def _with_start(spec, starting_offsets: str, **changes):
    return replace(spec, kafka=replace(spec.kafka, starting_offsets=starting_offsets), **changes)


def _store_offsets(store, job_id: str, topic: str, offsets: dict[int, int]) -> None:
    with store.engine.begin() as conn:
        conn.execute(schema.offsets.insert(), [
            {"job_id": job_id, "topic": topic, "partition": p, "next_offset": o, "generation": 1, "batch_id": 3}
            for p, o in offsets.items()])


def test_a_new_generation_records_its_start_and_a_restart_plans_the_same_batch_0(spec, store, broker, topic):
    first = GenerationStart(spec, store, _no_batch)
    assert first.job_topics() == {(topic, 0): 0, (topic, 1): 0, (topic, 2): 0}
    first.record()
    recorded = store.get_generation(spec.job_id, spec.generation)
    assert kafka_offsets.from_spark_json(recorded["starting_offsets"]) == first.offsets

    # a restart before batch 0 committed, after more records arrived, even if asked for the latest ones
    with broker.producer() as producer:
        producer.send(topic, value=b"{}", partition=0)
    again = GenerationStart(_with_start(spec, "latest"), store, _no_batch)
    assert again.job_topics() == first.offsets
    again.record()
    assert store.get_generation(spec.job_id, spec.generation) == recorded


def test_latest_resolves_to_each_partitions_end(spec, store, topic):
    start = GenerationStart(_with_start(spec, "latest"), store, _no_batch)
    assert start.job_topics() == {(topic, 0): 5, (topic, 1): 6, (topic, 2): 7}


def test_a_reset_takes_the_stored_offsets_it_names_and_warns_of_topics_no_stream_reads(spec, store, topic, caplog):
    named = kafka_offsets.to_spark_json({(topic, 0): 2, (topic, 1): 6, (topic, 2): 1, ("dropped-stream", 0): 9})
    start = GenerationStart(_with_start(spec, named, generation=2), store, _no_batch)
    assert start.job_topics() == {(topic, 0): 2, (topic, 1): 6, (topic, 2): 1}
    with caplog.at_level(logging.WARNING, "airflow_stream_provider.harness"):
        start.record()
    assert "names topics no stream of this job reads: ['dropped-stream']" in caplog.text


def test_a_second_stream_joins_batch_0_and_is_recorded_with_the_job_topics(spec, store, broker, topic):
    other = f"{topic}-control"
    broker.create_topic(other, 1)
    start = GenerationStart(spec, store, _no_batch)
    start.job_topics()
    assert start.stream([other], "latest", "topics of the job's second stream") == {(other, 0): 0}
    start.record()
    recorded = kafka_offsets.from_spark_json(store.get_generation(spec.job_id, 1)["starting_offsets"])
    assert recorded == {(topic, 0): 0, (topic, 1): 0, (topic, 2): 0, (other, 0): 0}


def test_a_lost_checkpoint_starts_past_the_stored_offsets(spec, store, topic, caplog):
    store.ensure_generation(spec.job_id, 1, spec.checkpoint_path,
                            kafka_offsets.to_spark_json({(topic, p): 0 for p in range(3)}))
    _store_offsets(store, spec.job_id, topic, {0: 4, 1: 6})
    with caplog.at_level(logging.WARNING, "airflow_stream_provider.harness"):
        start = GenerationStart(spec, store, _no_batch).job_topics()
    assert start == {(topic, 0): 4, (topic, 1): 6, (topic, 2): 0}
    assert "holds no batch although the generation committed up to" in caplog.text


def test_a_restored_checkpoint_replays_from_the_recorded_start_and_says_so(spec, store, topic, caplog):
    recorded = {(topic, p): 0 for p in range(3)}
    store.ensure_generation(spec.job_id, 1, spec.checkpoint_path, kafka_offsets.to_spark_json(recorded))
    _store_offsets(store, spec.job_id, topic, {0: 4, 1: 6, 2: 7})
    older_copy = {(topic, 0): 2, (topic, 1): 6, (topic, 2): 3}
    with caplog.at_level(logging.WARNING, "airflow_stream_provider.harness"):
        start = GenerationStart(spec, store, lambda: older_copy).job_topics()
    assert start == recorded  # Spark plans from its checkpoint; the sink skips what lies below the stored offsets
    assert "behind the stored offsets (restored from an older copy?)" in caplog.text
    assert f'"{topic}":{{"0":2,"2":3}}' in caplog.text.replace(" ", "")


def test_an_unreadable_offsets_log_is_left_to_spark_to_report(spec, store, topic, caplog):
    recorded = {(topic, p): 1 for p in range(3)}
    store.ensure_generation(spec.job_id, 1, spec.checkpoint_path, kafka_offsets.to_spark_json(recorded))

    def unreadable():
        raise ValueError("offsets/7: unexpected end of input")

    with caplog.at_level(logging.WARNING, "airflow_stream_provider.harness"):
        assert GenerationStart(spec, store, unreadable).job_topics() == recorded
    assert "could not read the offsets log" in caplog.text and "unexpected end of input" in caplog.text


def test_a_dry_run_records_nothing(spec, store):
    start = GenerationStart(replace(spec, dry_run=True), store, _no_batch)
    start.job_topics()
    start.record()
    assert store.get_generation(spec.job_id, spec.generation) is None


def test_a_topic_that_does_not_exist_is_a_configuration_error_that_names_it(spec, store):
    missing = _with_start(spec, "earliest")
    missing = replace(missing, kafka=replace(missing.kafka, topics=(spec.kafka.topics[0], "no-such-topic")))
    with pytest.raises(StartupError) as raised:
        GenerationStart(missing, store, _no_batch).job_topics()
    assert raised.value.exit_code == failures.EXIT_CONFIG
    assert raised.value.kind is failures.FailureKind.USER_CODE, "the run would be recorded without a kind"
    assert "kafka.topics: topics ['no-such-topic'] do not exist" in str(raised.value)
    assert store.get_generation(spec.job_id, spec.generation) is None


def test_settings_the_kafka_client_refuses_are_a_configuration_error(spec, store):
    """They were TRANSIENT, "check the broker list and that the brokers are up": restarted with backoff until
    the budget ran out.  (The spec refuses this one; a spec built in code reaches the driver unchecked.)"""
    refused = replace(spec, kafka=replace(spec.kafka, client_options={"request.timeout.ms": "abc"}))
    with pytest.raises(StartupError) as raised:
        GenerationStart(refused, store, _no_batch).job_topics()
    assert raised.value.exit_code == failures.EXIT_CONFIG, raised.value
    assert "the Kafka client refused the job's settings (kafka.client_options)" in str(raised.value)


def test_an_unreachable_broker_is_transient(spec, store):
    unreachable = replace(spec, kafka=replace(spec.kafka, bootstrap_servers="127.0.0.1:9",
                                              client_options={"bootstrap.timeout.ms": 1000}))
    with pytest.raises(StartupError) as raised:
        GenerationStart(unreachable, store, _no_batch).job_topics()
    assert raised.value.kind is failures.FailureKind.TRANSIENT
    assert "cannot read partitions of" in str(raised.value) and "127.0.0.1:9" in str(raised.value)
