"""The few kafka-python calls both sides need: watermarks, exact-range reads, group commits.

Pure (no pyspark, no airflow).  Consumers are cached per process: Spark reuses its Python workers, so a
task that reads a range does not pay for a new connection and metadata round trip every batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

from airflow_stream_provider.kafka_offsets import Offsets

if TYPE_CHECKING:
    from kafka import KafkaConsumer, TopicPartition

# kafka-python is imported where a consumer is made, not with this module: a Python process Spark starts
# only to create or plan the data source never reads Kafka, and importing kafka costs 90 ms and 20 MB.
_CACHE: dict[tuple, KafkaConsumer] = {}
_LOCK = threading.Lock()
#: How long one range read may go without advancing before it calls the broker unreachable, unless the
#: job sets its client's request timeout (``stall_timeout_s``).  A read that advances, however slowly,
#: goes on; Spark retries a failed read task (4 attempts in local mode), so an outage that cuts a running
#: read ends the batch after about four times this.  kafka-python's own default request timeout.
STALL_TIMEOUT_S = 30.0
#: Records one poll of a range read hands out at most (bounds a Python worker's memory per poll).
MAX_POLL_RECORDS = 5000
#: Consumer settings the provider makes itself (``new_consumer``, ``confluent_reader.client_config``).
RESERVED_SETTINGS = frozenset({"bootstrap_servers", "group_id", "enable_auto_commit", "auto_offset_reset",
                               "consumer_timeout_ms", "kafka_client"})
#: kafka-python's own settings (its objects, metrics, a bootstrap timeout): no other client takes them, so
#: the other readers' translations (``confluent_reader``, ``kafka_java``) leave them out.
PYTHON_ONLY_SETTINGS = frozenset({
    "api_version", "bootstrap_timeout_ms", "default_offset_commit_callback", "enable_incremental_fetch_sessions",
    "exclude_internal_topics", "key_deserializer", "value_deserializer", "max_poll_records",
    "metric_group_prefix", "metric_reporters", "metrics_enabled", "metrics_num_samples",
    "metrics_sample_window_ms", "partition_assignment_strategy", "proxy_url", "socks5_proxy",
    "sasl_kerberos_domain_name", "sasl_oauth_token_provider", "selector", "socket_options", "ssl_context",
})


class Columns(NamedTuple):
    """One poll's records of a range, column by column; timestamps in epoch ms, -1 when unset."""

    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps: list[int]

    @classmethod
    def of(cls, records: list) -> Columns:
        """kafka-python's records as columns."""
        return cls([r.offset for r in records], [r.key for r in records], [r.value for r in records],
                   [r.timestamp for r in records])


class KafkaReadError(RuntimeError):
    """Kafka did not deliver a range the driver planned (broker down, records gone)."""


def kafka_properties(options: Mapping[str, str]) -> dict[str, str]:
    """Kafka client properties in Kafka's own dotted names from Spark-style ``kafka.*`` options
    (bootstrap handled apart)."""
    return {
        key[len("kafka.") :]: value
        for key, value in options.items()
        if key.lower().startswith("kafka.") and key.lower() != "kafka.bootstrap.servers"
    }


def client_options(options: Mapping[str, str]) -> dict[str, object]:
    """kafka-python keyword arguments from Spark-style ``kafka.*`` options (bootstrap handled apart)."""
    return python_options(kafka_properties(options))


def python_options(properties: Mapping[str, object]) -> dict[str, object]:
    """kafka-python keyword arguments from Kafka client properties, in Kafka's own dotted names
    (``request.timeout.ms``, as a job spec's ``kafka.client_options`` and Spark's connector take them) or
    kafka-python's (``request_timeout_ms``).  A spec travels as JSON text, so numbers and booleans given
    as text become numbers and booleans where kafka-python's setting is one (a user name, a password or a
    client id of digits stays text).  kafka is imported only when there are properties."""
    if not properties:
        return {}
    from kafka import KafkaConsumer

    return {_keyword(name): _value(value, KafkaConsumer.DEFAULT_CONFIG.get(_keyword(name)), _keyword(name))
            for name, value in properties.items()}


def unknown_options(properties: Mapping[str, object]) -> list[str]:
    """The properties kafka-python has no setting for (it refuses a consumer that names one).  kafka is
    imported only when there are properties to check."""
    if not properties:
        return []
    from kafka import KafkaConsumer

    return [name for name in properties if _keyword(name) not in KafkaConsumer.DEFAULT_CONFIG]


def mistyped_options(properties: Mapping[str, object]) -> list[str]:
    """The properties whose value is not of the kind kafka-python's setting takes: a number where its default
    is one (it compares them), true or false where its default is a flag.  kafka-python would fail on them
    only as the driver starts, in a way that reads like an unreachable broker."""
    if not properties:
        return []
    from kafka import KafkaConsumer

    wrong = []
    for name, value in properties.items():
        default = KafkaConsumer.DEFAULT_CONFIG.get(_keyword(name))
        given = _value(value, default, _keyword(name))
        if isinstance(default, bool):
            fits = isinstance(given, bool)
        elif isinstance(default, int | float):
            fits = isinstance(given, int | float) and not isinstance(given, bool)
        else:
            fits = True
        if not fits:
            wrong.append(name)
    return wrong


def reserved_options(properties: Mapping[str, object]) -> list[str]:
    """The properties that name a setting ``new_consumer`` and the readers make themselves (brokers, group,
    offset handling): kafka-python would refuse the duplicate keyword, and a reader must not reset or commit."""
    return [name for name in properties if _keyword(name).lower() in RESERVED_SETTINGS]


def is_secret(name: str) -> bool:
    """A client property that holds a secret (``sasl.plain.password``, ``ssl.password``): it reaches a driver
    in its environment, never on its command line (``spec.KAFKA_SECRETS_ENV``)."""
    return "password" in _keyword(name).lower()


def _keyword(name: str) -> str:
    return name.replace(".", "_")


#: kafka-python's numeric settings whose default is None (the operating system's)
NUMBERS_WITHOUT_DEFAULT = frozenset({"receive_buffer_bytes", "send_buffer_bytes"})


def _value(value: object, default: object, keyword: str) -> object:
    """Text as the kind of value kafka-python's setting takes: the kind of its default."""
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        return {"true": True, "false": False}.get(value.lower(), value)
    if (isinstance(default, int | float) or keyword in NUMBERS_WITHOUT_DEFAULT) and value.isdigit():
        return int(value)
    return value


def stall_timeout_s(options: Mapping[str, object] | None) -> float:
    """How long a range read may go without advancing: the client's request timeout where the job sets one
    (``request.timeout.ms``, in Kafka's or kafka-python's spelling), the time after which the client itself
    stops waiting for an answer, so that a job that shortens it to notice an outage sooner has its reads
    give up on the same scale as its planning; ``STALL_TIMEOUT_S`` otherwise."""
    options = options or {}
    value = options.get("request_timeout_ms", options.get("request.timeout.ms"))
    return float(value) / 1000 if value is not None else STALL_TIMEOUT_S


def read_failed(topic: str, partition: int, start: int, end: int, why: str) -> KafkaReadError:
    return KafkaReadError(f"reading {topic}-{partition} [{start}, {end}) failed: {why}")


def read_truncated(topic: str, partition: int, start: int, end: int, log_end: int) -> KafkaReadError:
    """The partition's log ends before a range planned earlier does (a replay after retention, an unclean
    leader election or a recreated topic): data loss, in the words of Spark's own Kafka source, not an
    unreachable broker that a restart would wait out."""
    return KafkaReadError(
        f"[KAFKA_DATA_LOSS.COULD_NOT_READ_OFFSET_RANGE] reading {topic}-{partition} [{start}, {end}): the log "
        f"ends at offset {log_end}, before the range does. Some data may have been lost because they are not "
        f"available in Kafka any more: records [{max(log_end, start)}, {end}) (retention, an unclean leader "
        f"election, or a recreated topic)"
    )


def read_below_start(topic: str, partition: int, start: int, end: int, log_start: int) -> KafkaReadError:
    """The partition's log now starts after a range planned earlier begins (retention): data loss, as
    ``read_truncated``."""
    return KafkaReadError(
        f"[KAFKA_DATA_LOSS.COULD_NOT_READ_OFFSET_RANGE] reading {topic}-{partition} [{start}, {end}): the log "
        f"starts at offset {log_start}, after the range begins. Some data may have been lost because they are "
        f"not available in Kafka any more: records [{start}, {min(log_start, end)}) (retention)"
    )


def read_stalled(topic: str, partition: int, start: int, end: int, position: int, seconds: float
                 ) -> KafkaReadError:
    return KafkaReadError(
        f"stalled reading {topic}-{partition} [{start}, {end}): no progress for {seconds:.0f}s at offset "
        f"{position}; is the broker reachable?"
    )


def consumer(
    bootstrap: str, options: Mapping[str, object] | None = None, group_id: str | None = None
) -> KafkaConsumer:
    """A cached consumer: for the driver and Spark's reused Python workers."""
    key = (bootstrap, group_id, tuple(sorted((options or {}).items())))
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is None:
            cached = _CACHE[key] = new_consumer(bootstrap, options, group_id)
        return cached


def new_consumer(
    bootstrap: str, options: Mapping[str, object] | None = None, group_id: str | None = None
) -> KafkaConsumer:
    """A new consumer; the caller closes it.  One that cannot reach its brokers raises and leaves nothing
    running.

    kafka-python 3 starts a client's network thread before its first bootstrap, and a constructor that
    then fails (no broker within ``bootstrap_timeout_ms``) returns no object to close: the thread would go
    on reconnecting and logging for the life of the process.  In a triggerer or API server that checks an
    unreachable Kafka every poll, that is a thread and a socket per check.  The network clients made here
    are closed when the constructor fails.

    A request timeout set without a bootstrap timeout bounds the bootstrap too (kafka-python's defaults
    are both 30 s): a job that shortens it to notice an outage sooner would otherwise still wait 30 s
    wherever a consumer must connect again, as a retried read task's does."""
    from kafka import KafkaConsumer

    options = dict(options or {})
    if reserved := reserved_options(options):
        raise ValueError(f"Kafka client settings {', '.join(map(repr, reserved))} are the provider's own: the "
                         f"brokers, group and offset handling are set here. Remove them from the client options")
    if "request_timeout_ms" in options:
        options.setdefault("bootstrap_timeout_ms", options["request_timeout_ms"])
    made: list = []
    default_client = KafkaConsumer.DEFAULT_CONFIG["kafka_client"]

    def network_client(**configs):
        made.append(default_client(**configs))
        return made[-1]

    try:
        return KafkaConsumer(
            bootstrap_servers=bootstrap.split(","),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="none",
            consumer_timeout_ms=1000,
            kafka_client=network_client,
            **options,
        )
    except BaseException:
        for client in made:
            client.close()
        raise


def partitions(client: KafkaConsumer, topics: Iterable[str]) -> list[TopicPartition]:
    from kafka import TopicPartition

    found = []
    for topic in topics:
        ids = client.partitions_for_topic(topic)
        if ids is None:  # metadata may be stale right after a topic was created
            client._client.cluster.request_update()
            ids = client.partitions_for_topic(topic) or set()
        found.extend(TopicPartition(topic, p) for p in sorted(ids))
    return found


def watermarks(client: KafkaConsumer, topics: Iterable[str]) -> tuple[Offsets, Offsets]:
    """(earliest, latest) next offsets of every partition of ``topics`` that exists now."""
    tps = partitions(client, topics)
    if not tps:
        return {}, {}
    earliest = client.beginning_offsets(tps)
    latest = client.end_offsets(tps)
    return (
        {(tp.topic, tp.partition): o for tp, o in earliest.items()},
        {(tp.topic, tp.partition): o for tp, o in latest.items()},
    )


def read_range(
    bootstrap: str, options: Mapping[str, object], topic: str, partition: int, start: int, end: int
) -> Iterator:
    """Yield the records of ``[start, end)`` of one partition, then stop."""
    for records in read_range_batches(bootstrap, options, topic, partition, start, end):
        yield from records


def read_range_batches(
    bootstrap: str, options: Mapping[str, object], topic: str, partition: int, start: int, end: int
) -> Iterator[list]:
    """The records of ``[start, end)`` of one partition as lists, one per poll (at most
    ``MAX_POLL_RECORDS``): a caller that builds columns takes them a list at a time.

    Offsets may have holes (compaction, transaction markers), so the loop ends on the consumer's
    position, not on a record count.

    Each poll asks for no more records than the range still holds: a fetch returns up to
    ``max_partition_fetch_bytes`` of the log, and kafka-python decodes records only as it hands them
    out, so an uncapped poll would decode the whole fetch (thousands of records past a 3-record range,
    about 80 ms here).  What is left stays buffered and serves the next range that starts there.
    """
    from kafka import TopicPartition
    from kafka.errors import KafkaError

    client = consumer(bootstrap, options)
    tp = TopicPartition(topic, partition)
    client.assign([tp])
    client.seek(tp, start)
    stall_s = stall_timeout_s(options)
    position, advanced_at = start, time.monotonic()
    while (now := client.position(tp)) < end:
        if now > position:
            position, advanced_at = now, time.monotonic()
        elif time.monotonic() - advanced_at > stall_s:
            raise _log_ended(client, tp, start, end) or read_stalled(
                topic, partition, start, end, position, stall_s)
        try:
            batch = client.poll(timeout_ms=500, max_records=min(MAX_POLL_RECORDS, end - now))
        except KafkaError as err:
            raise read_failed(topic, partition, start, end, repr(err)) from err
        records = batch.get(tp)
        if not records:
            continue
        if records[0].offset < start or records[-1].offset >= end:
            # the rest of this fetch belongs to the next batch (records come in offset order)
            records = [r for r in records if start <= r.offset < end]
        if records:
            yield records
        if batch[tp][-1].offset >= end - 1:
            return


#: How long a stalled read asks the broker where the partition's log ends: briefly, since a silent broker
#: will not answer this either, and the read's failure should not wait on it.
LOG_END_TIMEOUT_MS = 1_000


def _log_ended(client: KafkaConsumer, tp, start: int, end: int) -> KafkaReadError | None:
    """Why a read stopped advancing when it is not the broker: its log ends before the range does.  Asked
    of the broker, not taken from the consumer's last fetch: records may have arrived since."""
    from kafka.errors import KafkaError

    try:
        log_end = client.end_offsets([tp], timeout_ms=LOG_END_TIMEOUT_MS)[tp]
    except KafkaError:  # the broker does not answer that either: the read stalled
        return None
    return read_truncated(tp.topic, tp.partition, start, end, log_end) if log_end < end else None


#: How long a consumer-group commit may take.  kafka-python retries a retriable error (a deleted topic's
#: UnknownTopicOrPartitionError, a coordinator moving) for 30 s by default, which held the job that long,
#: for an informational write, after every batch that committed such a partition.
GROUP_COMMIT_TIMEOUT_MS = 5_000


def commit_group(bootstrap: str, options: Mapping[str, object], group_id: str, positions: Offsets) -> None:
    """Commit next offsets to a consumer group so standard lag tools (kafka-consumer-groups, Burrow) see
    the job's progress.  Informational only: the stored offsets in the database are the truth; a commit
    that does not succeed within ``GROUP_COMMIT_TIMEOUT_MS`` raises (KafkaTimeoutError)."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    client = consumer(bootstrap, options, group_id=group_id)
    client.commit({TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in positions.items()},
                  timeout_ms=GROUP_COMMIT_TIMEOUT_MS)
