"""A job's Kafka client properties in the Java client's names, for Spark's JVM Kafka connector.

``kafka.client_options`` are checked against kafka-python's settings, because kafka-python plans every
batch and commits the consumer group whatever the source.  Most of them are named alike in both clients
(``security.protocol``, ``sasl.mechanism``, ``request.timeout.ms``); security is not.  The Java client
takes SASL credentials as a JAAS login line (``sasl.jaas.config``) and TLS files as a trust store and a key
store; given kafka-python's names it logs "isn't a known config" and connects without them, so a secured
cluster refused the JVM source.  This module writes them in the Java client's terms:

* ``sasl.plain.username`` and ``sasl.plain.password``: ``sasl.jaas.config`` with the login module of
  ``sasl.mechanism`` (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512); GSSAPI logs in from the ticket cache, as
  kafka-python does;
* ``ssl.cafile``: a PEM trust store; ``ssl.certfile`` (and a ``ssl.keyfile`` that is the same file): a PEM
  key store, whose key ``ssl.password`` unlocks; ``ssl.check.hostname`` false: no endpoint identification;
* kafka-python's own settings (``api_version``, ``bootstrap_timeout_ms``, ...) and those the Java client
  has no counterpart for (``ssl.crlfile``, OpenSSL cipher names) are left out, with the reason.

What cannot be said in the Java client's terms raises ``ValueError`` naming the property and what to give.

Pure (no pyspark, no airflow): the harness builds the JVM source's options with it.
"""

from __future__ import annotations

from collections.abc import Mapping

from airflow_stream_provider.kafka_client import PYTHON_ONLY_SETTINGS

#: The JAAS login module for each SASL mechanism that logs in with a user name and a password.
LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
#: GSSAPI as kafka-python does it: the ticket ``kinit`` left in the cache.
KERBEROS_LOGIN = "com.sun.security.auth.module.Krb5LoginModule required useTicketCache=true;"
#: kafka-python settings the Java client has no counterpart for, and why they are left out.
NOT_IN_JAVA = {
    "ssl_crlfile": "the Java client checks revocation through the JVM's PKIX settings, not a CRL file",
    "ssl_ciphers": "OpenSSL's cipher names are not Java's: set ssl.cipher.suites in the cluster's JVM instead",
    "sasl_kerberos_name": "the Java client logs in as the principal of the ticket cache",
}
#: Settings this module writes itself from the ones above.
_CREDENTIALS = ("sasl_plain_username", "sasl_plain_password")
_KEY_STORE = ("ssl_certfile", "ssl_keyfile", "ssl_password")


def java_properties(properties: Mapping[str, object]) -> tuple[dict[str, str], dict[str, str]]:
    """The Java client's properties for ``properties`` (kafka-python's settings, in either spelling), and
    the ones left out with why."""
    given = {name.replace(".", "_"): value for name, value in properties.items()}
    found: dict[str, str] = {}
    left_out: dict[str, str] = {}
    for keyword, value in given.items():
        if keyword in PYTHON_ONLY_SETTINGS:
            left_out[keyword.replace("_", ".")] = "kafka-python's own setting"
        elif keyword in NOT_IN_JAVA:
            left_out[keyword.replace("_", ".")] = NOT_IN_JAVA[keyword]
        elif keyword == "ssl_cafile":
            found.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": str(value)})
        elif keyword == "ssl_check_hostname":
            if str(value).lower() in ("false", "0"):
                found["ssl.endpoint.identification.algorithm"] = ""
        elif keyword not in (*_CREDENTIALS, *_KEY_STORE):
            found[keyword.replace("_", ".")] = _text(value)
    found.update(_key_store(given))
    if jaas := _jaas(given):
        found["sasl.jaas.config"] = jaas
    return found, left_out


def _text(value: object) -> str:
    """A value as the Java client parses it: booleans in lower case."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _key_store(given: Mapping[str, object]) -> dict[str, str]:
    """The client certificate as a PEM key store: Spark's connector passes the Java client a key store's
    location, one file with the certificate chain and the private key (kafka-python's ``ssl.certfile`` may
    hold both).  A key in a file of its own would have to travel as text in the query's options."""
    certfile, keyfile = given.get("ssl_certfile"), given.get("ssl_keyfile")
    if certfile is None:
        if keyfile is not None:
            raise ValueError("ssl.keyfile is given without ssl.certfile; give the client "
                             "certificate's file as ssl.certfile")
        return {}
    if keyfile is not None and str(keyfile) != str(certfile):
        raise ValueError(
            f"ssl.certfile {certfile!r} and ssl.keyfile {keyfile!r} are two files, and "
            "Spark's JVM Kafka connector reads the client's key store from one: join them into one PEM file "
            "(the certificate chain and the private key, in PKCS#8) and give it as ssl.certfile, or use "
            'the Python source (kafka.source "python")')
    found = {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(certfile)}
    if given.get("ssl_password") is not None:
        found["ssl.key.password"] = str(given["ssl_password"])
    return found


def _jaas(given: Mapping[str, object]) -> str | None:
    """``sasl.jaas.config`` for the mechanism and credentials given; None when there is nothing to log in
    with."""
    mechanism = str(given.get("sasl_mechanism", "")).upper()
    user, password = given.get("sasl_plain_username"), given.get("sasl_plain_password")
    if mechanism == "GSSAPI":
        return KERBEROS_LOGIN if str(given.get("security_protocol", "")).upper().startswith("SASL") else None
    if user is None and password is None:
        return None
    if not mechanism:
        # No default to guess: kafka-python has none and the Java client's is GSSAPI, which ignores both.
        raise ValueError(f"sasl.plain.username and sasl.plain.password are given without sasl.mechanism; "
                         f"set sasl.mechanism to one of {', '.join(LOGIN_MODULES)}")
    if user is None or password is None:
        missing = "sasl.plain.username" if user is None else "sasl.plain.password"
        raise ValueError(f"{missing} is missing; SASL {mechanism} logs in with both a "
                         "user name and a password")
    module = LOGIN_MODULES.get(mechanism)
    if module is None:
        raise ValueError(
            f"sasl.mechanism {mechanism!r} does not log in with a user name and a password; "
            f"the JVM Kafka connector's login is written for {', '.join(LOGIN_MODULES)} and GSSAPI")
    return f"{module} required username={_quoted(user)} password={_quoted(password)};"


def _quoted(value: object) -> str:
    """A JAAS option value: in double quotes, with backslashes and quotes escaped."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
