"""Bad configuration fails before anything starts, naming the field and the fix."""

from __future__ import annotations

import pytest

from airflow_stream_provider import confluent_reader, kafka_client
from airflow_stream_provider.spec import SpecError, StreamJobSpec

GOOD = {"job_id": "orders", "version": "1.0", "checkpoint_root": "/data/ckpt",
        "database_url": "postgresql+psycopg://stream@db/results",
        "kafka": {"bootstrap_servers": "k1:9092,k2:9092", "topics": ["orders"]}}


def _with(**changes):
    data = {**GOOD, "kafka": dict(GOOD["kafka"])}
    for key, value in changes.items():
        if key.startswith("kafka_"):
            data["kafka"][key[6:]] = value
        else:
            data[key] = value
    return data


def test_good_spec_round_trips():
    spec = StreamJobSpec.from_dict(GOOD)
    assert StreamJobSpec.from_json(spec.to_json()) == spec
    assert spec.checkpoint_path == "/data/ckpt/orders/gen-1"
    assert spec.with_generation(3, '{"orders":{"0":5}}').checkpoint_path == "/data/ckpt/orders/gen-3"
    # a reset's stored offsets name a second stream's topics too (declared in the job's code)
    StreamJobSpec.from_dict(_with(kafka_starting_offsets='{"orders": {"0": 5}, "orders-control": {"0": 1}}'))


@pytest.mark.parametrize(("changes", "field", "fix"), [
    ({"job_id": "../x"}, "job_id", "no '/' or '..'"),
    ({"job_id": "a/b"}, "job_id", "no '/'"),
    ({"version": ""}, "version", "git sha"),
    ({"version": "  "}, "version", "git sha"),  # blank: no version to tell two deployments apart by
    ({"database_url": "postgresql+psycopg://stream:s3cret@db/results"}, "database_url", "STREAM_DATABASE_PASSWORD"),
    ({"database_url": "mysql://db/x"}, "database_url", "sqlite://"),
    ({"kafka_bootstrap_servers": "PLAINTEXT://k1:9092"}, "kafka.bootstrap_servers", ""),
    ({"kafka_bootstrap_servers": "k1:abc"}, "kafka.bootstrap_servers", ""),
    # relative or in memory: the driver and each Airflow process would each open their own
    ({"database_url": "sqlite:///state.db"}, "database_url", "sqlite:////var/lib/stream/state.db"),
    ({"database_url": "sqlite://"}, "database_url", "four slashes"),
    ({"database_url": "postgresql+psycopg://stream@db/results?password=s3cret"}, "database_url",
     "STREAM_DATABASE_PASSWORD"),  # psycopg takes it from the query too, and the URL is on the command line
    ({"kafka_starting_offsets": '{"orders": {"0": "ten"}}'}, "kafka.starting_offsets", "earliest"),
    ({"kafka_source": "jvmm"}, "kafka.source", "auto"),
    ({"kafka_reader": "librdkafka"}, "kafka.reader", "confluent extra"),
    ({"kafka_bootstrap_servers": "nohostport"}, "kafka.bootstrap_servers", "broker1:9092"),
    ({"kafka_topics": []}, "kafka.topics", "at least one"),
    ({"kafka_topics": ["bad topic"]}, "kafka.topics", "letters"),
    ({"kafka_topics": ["orders", ".."]}, "kafka.topics", "neither '.' nor '..'"),  # Kafka refuses both names
    ({"kafka_topics": ["."]}, "kafka.topics", "neither '.' nor '..'"),
    ({"trigger_interval": "soon"}, "trigger_interval", "1 second"),
    ({"kafka_max_offsets_per_trigger": 0}, "kafka.max_offsets_per_trigger", "100000"),
    ({"kafka_max_offsets_per_trigger": True}, "kafka.max_offsets_per_trigger", "100000"),  # not 1 record a batch
    # a string or a number would be read one way by the startup check and another by the source
    ({"kafka_fail_on_data_loss": "false"}, "kafka.fail_on_data_loss", "JSON boolean"),
    ({"kafka_fail_on_data_loss": 0}, "kafka.fail_on_data_loss", "JSON boolean"),
    ({"kafka_fail_on_data_loss": None}, "kafka.fail_on_data_loss", "JSON boolean"),
    ({"kafka_read_tasks": 0}, "kafka.read_tasks", "half the cores"),
    ({"kafka_read_tasks": "2"}, "kafka.read_tasks", "e.g. 4"),
    ({"generaton": 2}, "generaton", "Known fields"),
    ({"kafka_client_options": {"sasl.jaas.config": "x"}}, "kafka.client_options", "security.protocol"),
    ({"kafka_client_options": {"request.timeout.ms": ["15000"]}}, "kafka.client_options", "by name"),
    # kafka-python fails on these only at the driver's start, which read like an unreachable broker
    ({"kafka_client_options": {"request.timeout.ms": "abc"}}, "kafka.client_options", "request.timeout.ms"),
    ({"kafka_client_options": {"ssl_check_hostname": "no"}}, "kafka.client_options", "true or false"),
    # Spark refused much of what the spec took ('500ms', '2 s', '1.5 minutes', a number) as the query started;
    # the spec takes these and hands Spark milliseconds (``spark_trigger_interval``): what it refuses is this
    ({"trigger_interval": "2 fortnights"}, "trigger_interval", "1 second"),
    # the provider archives, copies and lists checkpoints itself: a root it cannot handle failed its first
    # reset or upgrade, and a relative one each process resolves against its own directory
    ({"checkpoint_root": "s3a://bucket/ckpt"}, "checkpoint_root", "hdfs://namenode:port/path"),
    ({"checkpoint_root": "hdfs://nn:8020"}, "checkpoint_root", "absolute"),
    ({"checkpoint_root": "file://otherhost/ckpt"}, "checkpoint_root", "file:///absolute/path"),
    ({"checkpoint_root": "ckpt"}, "checkpoint_root", "absolute local path"),
    ({"checkpoint_root": 5}, "checkpoint_root", "absolute local path"),
    # a TypeError, or taken at face value
    ({"heartbeat_seconds": "2"}, "heartbeat_seconds", "JSON number"),
    ({"heartbeat_timeout_seconds": float("nan")}, "heartbeat_timeout_seconds", "JSON number"),
    ({"dry_run": "false"}, "dry_run", "upgrades set it"),
    ({"generation": True}, "generation", "start at 1"),
    ({"kafka_bootstrap_servers": 5}, "kafka.bootstrap_servers", "broker1:9092"),
    # settings the provider makes itself: kafka-python would refuse the duplicate keyword at the start
    ({"kafka_client_options": {"group.id": "mine"}}, "kafka.client_options", "stream-<job_id>"),
    ({"kafka_client_options": {"auto_offset_reset": "latest"}}, "kafka.client_options", "exact ranges"),
    ({"kafka_client_options": {"enable.auto.commit": "true"}}, "kafka.client_options", "commits offsets"),
    ({"kafka_client_options": {"bootstrap.servers": "k3:9092"}}, "kafka.client_options", "kafka.bootstrap_servers"),
    # Spark's JVM connector reads the client's key store from one file
    ({"kafka_source": "jvm", "kafka_client_options": {"ssl.certfile": "/c.pem", "ssl.keyfile": "/k.pem"}},
     "kafka.client_options", "one PEM file"),
    ({"kafka_source": "jvm", "kafka_client_options": {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                                                      "sasl.plain.username": "u"}},
     "kafka.client_options", "sasl.plain.password is missing"),
])
def test_bad_field_is_named_with_its_fix(changes, field, fix):
    with pytest.raises(SpecError) as err:
        StreamJobSpec.from_dict(_with(**changes))
    assert err.value.field == field and fix in str(err.value)


@pytest.mark.parametrize(("interval", "spark"), [
    ("500ms", "500 milliseconds"), ("2 s", "2000 milliseconds"), ("1 m", "60000 milliseconds"),
    ("1.5 minutes", "90000 milliseconds"), (5, "5000 milliseconds"), ("1 hour", "3600000 milliseconds"),
    ("1 second", "1000 milliseconds"),
])
def test_a_trigger_interval_reaches_spark_in_a_form_it_takes(interval, spark):
    assert StreamJobSpec.from_dict(_with(trigger_interval=interval)).spark_trigger_interval == spark


def test_client_options_in_either_spelling_reach_kafka_python_as_its_keywords():
    """A spec travels as JSON text: its options' numbers and booleans may come as text.  kafka-python
    refuses a dotted name and compares a timeout given as text with a number, so the driver's own Kafka
    calls take them converted."""
    options = {"request.timeout.ms": "15000", "security_protocol": "PLAINTEXT", "ssl.check.hostname": "false",
               "retry.backoff.ms": 200}
    spec = StreamJobSpec.from_json(StreamJobSpec.from_dict(_with(kafka_client_options=options)).to_json())
    assert spec.kafka.client_options == options
    assert spec.kafka.python_options == {"request_timeout_ms": 15000, "security_protocol": "PLAINTEXT",
                                         "ssl_check_hostname": False, "retry_backoff_ms": 200}


def test_text_settings_of_digits_stay_text():
    """A password, a user name or a client id of digits became a number: kafka-python's SASL then failed
    joining them as text, in the driver, after its launch (and "007" lost its zeros)."""
    options = {"sasl.plain.username": "007", "sasl.plain.password": "0123456", "client.id": "42",
               "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "receive.buffer.bytes": "65536"}
    spec = StreamJobSpec.from_dict(_with(kafka_client_options=options))
    assert spec.kafka.python_options == {"sasl_plain_username": "007", "sasl_plain_password": "0123456",
                                         "client_id": "42", "security_protocol": "SASL_PLAINTEXT",
                                         "sasl_mechanism": "PLAIN", "receive_buffer_bytes": 65536}


def test_a_consumer_refuses_settings_the_provider_makes_before_it_connects():
    """A Kafka connection's extra reaches the Airflow side's consumers without a spec: a setting the provider
    makes itself is named there too, instead of kafka-python's "multiple values for keyword argument"."""
    with pytest.raises(ValueError, match="'group_id'.* the provider's own"):
        kafka_client.new_consumer("127.0.0.1:1", {"group_id": "mine", "request_timeout_ms": 1000})


def test_a_read_stalls_for_the_request_timeout_the_spec_sets_in_either_reader():
    """A job that shortens its client's request timeout to notice an outage sooner has its range reads
    give up on the same scale; without one, both readers wait kafka-python's default, 30 s."""
    for client_options, seconds in (({"request.timeout.ms": "12000"}, 12.0), ({}, kafka_client.STALL_TIMEOUT_S)):
        spec = StreamJobSpec.from_dict(_with(kafka_client_options=client_options))
        spark_options = {f"kafka.{k}": str(v) for k, v in spec.kafka.client_options.items()}  # as the harness
        assert kafka_client.stall_timeout_s(kafka_client.client_options(spark_options)) == seconds
        config = confluent_reader.client_config("broker:9092", spark_options)
        assert kafka_client.stall_timeout_s(config) == seconds


@pytest.mark.parametrize(("root", "local"), [
    ("/data/ckpt", True), ("file:///data/ckpt", True), ("hdfs://nn:8020/ckpt", False),
])
def test_local_checkpoints_get_the_forkless_checkpoint_manager(root, local):
    from airflow_stream_provider.spec import CHECKPOINT_MANAGER_CONF, LOCAL_CHECKPOINT_MANAGER

    spec = StreamJobSpec.from_dict(_with(checkpoint_root=root))
    defaults = spec.session_defaults()
    assert (defaults.get(CHECKPOINT_MANAGER_CONF) == LOCAL_CHECKPOINT_MANAGER) is local
    assert defaults["spark.sql.session.timeZone"] == "UTC"
    assert defaults["spark.sql.inMemoryColumnarStorage.compressed"] == "false"  # a batch's cache lives one batch
    assert spec.session_conf()["spark.sql.streaming.minBatchesToRetain"] == "100"


def test_the_jobs_own_spark_conf_wins_over_the_defaults():
    own = {"spark.sql.shuffle.partitions": "64", "spark.sql.streaming.checkpointFileManagerClass": "x.Mine"}
    spec = StreamJobSpec.from_dict(_with(spark_conf=own))
    conf = {**spec.session_defaults(), **spec.session_conf()}  # as the harness merges them
    assert conf["spark.sql.shuffle.partitions"] == "64"
    assert conf["spark.sql.streaming.checkpointFileManagerClass"] == "x.Mine"


def test_a_spec_that_rendered_to_text_fails_naming_the_dag_setting():
    """Without native rendering a templated spec is text: it failed with "dictionary update sequence element
    #0 has length 1", and was retried."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator

    operator = SubmitStreamingJobOperator(task_id="submit", spec=str(GOOD))
    with pytest.raises(AirflowFailException, match="render_template_as_native_obj=True"):
        _ = operator.job  # validated when first read


def test_a_cluster_launch_not_registered_yet_is_picked_up_by_a_retry_not_launched_again():
    """A cluster's application may wait in its queue: nothing on this host can see its process, and a retry
    that launched again started a second driver on the same checkpoint."""
    from airflow_stream_provider.operators.base import _still_starting

    launch = {"run_id": "r1", "pid": None, "host": None, "submission_id": "application_1_0001", "submitted_at": 0}
    assert _still_starting(None, launch)


def test_a_kafka_secret_in_the_spec_is_left_out_of_what_it_serializes():
    """A SASL or key password in ``kafka.client_options`` went with the spec onto the driver's command line
    (``ps``), its log and the run's record; it reaches the driver in its environment instead."""
    from airflow_stream_provider.hooks.driver import StreamDriverHook

    options = {"security.protocol": "SASL_SSL", "sasl.plain.username": "u", "sasl.plain.password": "hunter2",
               "ssl_password": "k3y"}
    spec = StreamJobSpec.from_dict(_with(kafka_client_options=options))
    assert spec.kafka.secret_options == {"sasl.plain.password": "hunter2", "ssl_password": "k3y"}
    arguments = " ".join(StreamDriverHook.driver_arguments(spec, "r1", "/tmp/r1.log"))
    assert "hunter2" not in arguments and "k3y" not in arguments and "sasl.plain.username" in arguments
    assert "hunter2" not in spec.to_json()
    again = StreamJobSpec.from_json(spec.to_json()).with_kafka_secrets(spec.kafka.secret_options)
    assert again == spec and again.kafka.python_options["sasl_plain_password"] == "hunter2"
