"""A job's Kafka client options (kafka-python's settings) reach Spark's JVM connector in the Java client's terms.

Spark's JVM Kafka connector cannot run here (it needs Maven; ENVIRONMENT.md), so these check the properties
it would be given against the Java client's documented names; ``docker-compose.yml`` runs that source."""

from __future__ import annotations

import pytest

from airflow_stream_provider import kafka_java
from airflow_stream_provider.spec import SpecError, StreamJobSpec


def test_sasl_credentials_become_the_login_of_their_mechanism():
    found, left_out = kafka_java.java_properties({
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.plain.username": "stream",
        "sasl_plain_password": 's3"cr\\et', "request.timeout.ms": 15000})
    assert found == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "request.timeout.ms": "15000",
        # quotes and backslashes escaped as JAAS reads a quoted value
        "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                            'username="stream" password="s3\\"cr\\\\et";',
    }
    assert left_out == {}
    plain, _ = kafka_java.java_properties({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "plain",
                                           "sasl.plain.username": "u", "sasl.plain.password": "p"})
    assert plain["sasl.jaas.config"].startswith("org.apache.kafka.common.security.plain.PlainLoginModule required")


def test_kerberos_logs_in_from_the_ticket_cache_as_kafka_python_does():
    found, left_out = kafka_java.java_properties({"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI",
                                                  "sasl.kerberos.service.name": "kafka",
                                                  "sasl.kerberos.name": "stream@EXAMPLE.COM"})
    assert found["sasl.jaas.config"] == kafka_java.KERBEROS_LOGIN
    assert found["sasl.kerberos.service.name"] == "kafka"
    assert "sasl.kerberos.name" in left_out


def test_tls_files_become_pem_stores():
    found, _ = kafka_java.java_properties({"security.protocol": "SSL", "ssl.cafile": "/etc/kafka/ca.pem",
                                           "ssl.certfile": "/etc/kafka/client.pem",
                                           "ssl.keyfile": "/etc/kafka/client.pem", "ssl.password": "k3y",
                                           "ssl.check.hostname": False})
    assert found == {
        "security.protocol": "SSL",
        "ssl.truststore.type": "PEM", "ssl.truststore.location": "/etc/kafka/ca.pem",
        "ssl.keystore.type": "PEM", "ssl.keystore.location": "/etc/kafka/client.pem", "ssl.key.password": "k3y",
        "ssl.endpoint.identification.algorithm": "",
    }
    checked, _ = kafka_java.java_properties({"ssl_check_hostname": "true"})
    assert checked == {}, "the Java client checks host names unless told not to"


def test_kafka_pythons_own_settings_are_left_out_with_the_reason():
    found, left_out = kafka_java.java_properties({"api_version": "2.8", "bootstrap_timeout_ms": 2000,
                                                  "ssl.crlfile": "/crl.pem", "check.crcs": True})
    assert found == {"check.crcs": "true"}, "booleans as the Java client parses them"
    assert left_out.keys() == {"api.version", "bootstrap.timeout.ms", "ssl.crlfile"}
    assert "revocation" in left_out["ssl.crlfile"]


@pytest.mark.parametrize(("options", "named"), [
    ({"ssl.certfile": "/c.pem", "ssl.keyfile": "/k.pem"}, "one PEM file"),
    ({"ssl.keyfile": "/k.pem"}, "without ssl.certfile"),
    ({"sasl.mechanism": "SCRAM-SHA-256", "sasl.plain.password": "p"}, "sasl.plain.username is missing"),
    ({"sasl.plain.username": "u", "sasl.plain.password": "p"}, "without sasl.mechanism"),
    ({"sasl.mechanism": "OAUTHBEARER", "sasl.plain.username": "u", "sasl.plain.password": "p"}, "OAUTHBEARER"),
])
def test_what_the_java_client_cannot_take_is_named(options, named):
    with pytest.raises(ValueError, match=named):
        kafka_java.java_properties(options)


def test_a_spec_for_the_python_source_may_keep_two_tls_files():
    """Only the JVM connector needs one key store file; kafka-python and librdkafka take two."""
    spec = {"job_id": "orders", "version": "1.0", "checkpoint_root": "/data/ckpt",
            "database_url": "postgresql+psycopg://stream@db/results",
            "kafka": {"bootstrap_servers": "k1:9092", "topics": ["orders"], "source": "python",
                      "client_options": {"ssl.certfile": "/c.pem", "ssl.keyfile": "/k.pem"}}}
    StreamJobSpec.from_dict(spec)
    with pytest.raises(SpecError, match="one PEM file"):
        StreamJobSpec.from_dict({**spec, "kafka": {**spec["kafka"], "source": "jvm"}})
