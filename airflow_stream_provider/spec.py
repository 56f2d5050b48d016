"""The stream job spec: one declarative description of a job, validated once, shared by both sides.

The Airflow side builds it (from connections, Variables and params) and hands it to the driver as JSON
on the command line; the runtime parses and re-validates it.  What it serializes therefore holds no
secret: the database password travels in the driver's environment (``DATABASE_PASSWORD_ENV``), and so do
the Kafka client's (``KAFKA_SECRETS_ENV``), which a serialized spec leaves out.  Pure module.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, urlsplit

from airflow_stream_provider import kafka_client, kafka_java, kafka_offsets

DATABASE_PASSWORD_ENV = "STREAM_DATABASE_PASSWORD"
#: The spec's Kafka client secrets (``KafkaSpec.secret_options``, as JSON) in the driver's environment: a
#: serialized spec leaves them out, so they are on no command line, log or record.
KAFKA_SECRETS_ENV = "STREAM_KAFKA_SECRETS"
CHECKPOINT_MANAGER_CONF = "spark.sql.streaming.checkpointFileManagerClass"
#: For a checkpoint on the local file system.  Spark's default manager goes through Hadoop's FileContext,
#: whose local implementation (without Hadoop's native library, as pip-installed Spark runs) forks a
#: ``readlink`` for every status it reads and a ``chmod`` for every file it creates: about 15 processes
#: per micro-batch, 55 ms of a tiny batch's 430 ms here.  This one uses the FileSystem API, which still
#: forks the ``chmod`` (about 4 processes, 10 ms a batch; benchmarks/README.md).  On a local
#: disk both rename a temporary file into place after checking that the target is absent, so nothing is
#: given up; HDFS keeps Spark's default (there a FileContext rename is one atomic NameNode call).
LOCAL_CHECKPOINT_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
SOURCE_KINDS = ("auto", "jvm", "python")
#: The Python source's read-task client: kafka-python, or librdkafka through the ``confluent`` extra.
READERS = ("kafka-python", "confluent-kafka")
#: A job id names checkpoint folders and asset URIs: no separators, no leading dot.
JOB_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
_JOB_ID = re.compile(f"^{JOB_ID_PATTERN}$")
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_INTERVAL = re.compile(r"^\s*(\d+(\.\d+)?)\s*(ms|milliseconds?|s|seconds?|m|minutes?|h|hours?)\s*$")


class SpecError(ValueError):
    """A job spec field is wrong.  The message names the field and how to fix it."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field = field_name
        super().__init__(f"job spec field '{field_name}': {problem}. {fix}")


def jvm_client_properties(options: Mapping[str, object]) -> tuple[dict[str, str], dict[str, str]]:
    """``kafka.client_options`` in the Java client's terms for Spark's JVM Kafka connector, and those left
    out with why (``kafka_java``); SpecError when they cannot be said in its terms."""
    try:
        return kafka_java.java_properties(options)
    except ValueError as err:
        raise SpecError("kafka.client_options", str(err), "Spark's JVM Kafka connector takes them in the Java "
                        "client's terms, which the provider writes from kafka-python's") from None


@dataclass(frozen=True)
class KafkaSpec:
    bootstrap_servers: str
    topics: tuple[str, ...]
    #: "jvm" needs spark-sql-kafka on the classpath; "python" is the kafka-python data source;
    #: "auto" picks jvm when its connector is present.
    source: str = "auto"
    #: The most records one batch reads.  The Python source reads at most 10,000 in a run's first batch,
    #: then up to this (``kafka_offsets.batch_limit``): big batches drain a backlog, a small one recovers fast.
    max_offsets_per_trigger: int | None = 100_000
    #: Where a *new generation* starts: "earliest", "latest" or Spark's offset JSON.  Spark ignores it
    #: for a query that already has a checkpoint, which is why a reset always means a new generation.
    starting_offsets: str = "earliest"
    fail_on_data_loss: bool = True
    #: The Python source's read tasks decode records with this client.  "confluent-kafka" (the
    #: ``confluent`` extra, installed where Spark runs Python) decodes in C, several times faster.
    reader: str = "kafka-python"
    #: How many tasks read a batch (the Python source).  None: half the cores in local mode (at least one),
    #: where the read tasks' Python decoding and the JVM's work share the driver's cores; one task per
    #: partition elsewhere, as Spark's Kafka connector plans.
    read_tasks: int | None = None
    #: Extra Kafka client properties (security, timeouts) in Kafka's own names, without the "kafka."
    #: prefix: ``{"security.protocol": "SSL", "request.timeout.ms": "15000"}``.  Spark's connector and
    #: librdkafka take them as they are; kafka-python (the driver's own calls and the Python source) in its
    #: spelling, ``python_options``.
    client_options: Mapping[str, str] = field(default_factory=dict)

    @property
    def secret_options(self) -> dict[str, object]:
        """The client options that hold secrets (``kafka_client.is_secret``): left out of a serialized spec."""
        return {k: v for k, v in self.client_options.items() if kafka_client.is_secret(k)}

    def consumer_group(self, job_id: str) -> str:
        return f"stream-{job_id}"

    @property
    def python_options(self) -> dict[str, object]:
        """``client_options`` as kafka-python's keyword arguments."""
        return kafka_client.python_options(self.client_options)


@dataclass(frozen=True)
class StreamJobSpec:
    job_id: str
    version: str
    kafka: KafkaSpec
    checkpoint_root: str
    #: SQLAlchemy URL of the state/sink database, without a password.
    database_url: str
    generation: int = 1
    trigger_interval: str = "1 second"
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    #: How often the driver writes a heartbeat and checks for a stop request.
    heartbeat_seconds: float = 2.0
    #: A running driver silent for this long is dead, where its process cannot be checked (a standby on
    #: another host; the same host checks the process).
    heartbeat_timeout_seconds: float = 30.0
    #: Keep a warm standby driver that takes over within seconds when the active one dies (local and
    #: client deploy mode: the standby must run where the active driver can be checked).
    standby: bool = False
    #: Old batches Spark keeps in the checkpoint (spark.sql.streaming.minBatchesToRetain).
    min_batches_to_retain: int = 100
    #: Preflight mode: run batches until one with id >= 1 ran (it reads state), write nothing, stop.
    dry_run: bool = False

    # -- derived -----------------------------------------------------------------------------------
    @property
    def job_root(self) -> str:
        return f"{self.checkpoint_root.rstrip('/')}/{self.job_id}"

    @property
    def checkpoint_path(self) -> str:
        return generation_path(self.job_root, self.generation)

    @property
    def checkpoint_is_local(self) -> bool:
        return urlsplit(self.checkpoint_root).scheme in ("", "file")

    def session_defaults(self) -> dict[str, str]:
        """The driver's Spark SQL defaults for this job: what the deployment's spark-submit conf sets wins
        over them (``runtime.harness.unless_submitted``), and :meth:`session_conf` over both."""
        defaults = {
            "spark.sql.session.timeZone": "UTC",
            "spark.sql.shuffle.partitions": "4",
            # The sink caches each batch for that batch only.  Compressing the cache gathers dictionary
            # and run-length statistics over every column value to save a few MB for one batch: draining
            # 100,000-record batches, read_parse took 0.79 of the time without it, same peak RSS.
            "spark.sql.inMemoryColumnarStorage.compressed": "false",
        }
        if self.checkpoint_is_local:
            defaults[CHECKPOINT_MANAGER_CONF] = LOCAL_CHECKPOINT_MANAGER
        return defaults

    def session_conf(self) -> dict[str, str]:
        """The driver's Spark SQL settings the spec itself gives, over any default or spark-submit conf: its
        ``min_batches_to_retain`` and ``spark_conf``."""
        return {"spark.sql.streaming.minBatchesToRetain": str(self.min_batches_to_retain), **self.spark_conf}

    @property
    def trigger_seconds(self) -> float:
        return parse_interval(self.trigger_interval)

    @property
    def spark_trigger_interval(self) -> str:
        """The trigger interval as Spark's processing-time trigger takes it: Spark refuses much of what the
        spec accepts ('500ms', '2 s', '1.5 minutes', a number), and failed the query's start on it."""
        return f"{max(1, round(self.trigger_seconds * 1000))} milliseconds"

    def with_generation(self, generation: int, starting_offsets: str | None = None) -> StreamJobSpec:
        kafka = (
            self.kafka if starting_offsets is None else replace(self.kafka, starting_offsets=starting_offsets)
        )
        return replace(self, generation=generation, kafka=kafka)

    # -- serialisation -----------------------------------------------------------------------------
    def with_kafka_secrets(self, secrets: Mapping[str, object]) -> StreamJobSpec:
        """The spec with the Kafka client secrets a serialized spec leaves out (a driver's, from its
        environment: ``KAFKA_SECRETS_ENV``)."""
        if not secrets:
            return self
        return replace(self, kafka=replace(self.kafka, client_options={**self.kafka.client_options, **secrets}))

    def to_dict(self) -> dict[str, Any]:
        """The spec as data, without its Kafka client secrets: what a command line, a log or a record holds."""
        data = asdict(self)
        data["kafka"]["topics"] = list(self.kafka.topics)
        data["kafka"]["client_options"] = {k: v for k, v in self.kafka.client_options.items()
                                           if not kafka_client.is_secret(k)}
        data["spark_conf"] = dict(self.spark_conf)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StreamJobSpec:
        data = dict(data)
        kafka = dict(data.pop("kafka", None) or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise SpecError(
                sorted(unknown)[0], "is not a known field", f"Known fields: {', '.join(sorted(known))}"
            )
        unknown = set(kafka) - set(KafkaSpec.__dataclass_fields__)
        if unknown:
            raise SpecError(
                f"kafka.{sorted(unknown)[0]}",
                "is not a known field",
                f"Known fields: {', '.join(sorted(KafkaSpec.__dataclass_fields__))}",
            )
        topics = kafka.get("topics", ())
        kafka["topics"] = (topics,) if isinstance(topics, str) else tuple(topics)
        try:
            spec = cls(kafka=KafkaSpec(**kafka), **data)
        except TypeError as err:  # a required field is missing
            raise SpecError(
                "spec",
                str(err),
                "Give every required field: job_id, version, kafka.bootstrap_servers, "
                "kafka.topics, checkpoint_root, database_url",
            ) from None
        spec.validate()
        return spec

    @classmethod
    def from_json(cls, text: str) -> StreamJobSpec:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise SpecError(
                "spec", f"is not valid JSON ({err})", "Pass the spec as produced by to_json()"
            ) from None
        return cls.from_dict(data)

    # -- validation --------------------------------------------------------------------------------
    def validate(self) -> StreamJobSpec:
        """Check every field; raise SpecError naming the first wrong one.  Returns self for chaining."""
        if not isinstance(self.job_id, str) or not _JOB_ID.match(self.job_id):
            raise SpecError(
                "job_id",
                f"{self.job_id!r} is not a safe name",
                "Use letters, digits, '.', '_' or '-' (no '/' or '..'); it names checkpoint folders",
            )
        if ".." in self.job_id:
            raise SpecError("job_id", f"{self.job_id!r} contains '..'", "Choose a name without '..'")
        if not isinstance(self.version, str) or not self.version.strip():
            raise SpecError("version", "is empty", "Give the code version, e.g. '1.4.0' or a git sha")
        _validate_checkpoint_root(self.checkpoint_root)
        if isinstance(self.generation, bool) or not isinstance(self.generation, int) or self.generation < 1:
            raise SpecError(
                "generation", f"{self.generation!r} is not a positive integer", "Generations start at 1"
            )
        _validate_database_url(self.database_url)
        try:
            if parse_interval(self.trigger_interval) <= 0:
                raise ValueError
        except ValueError:
            raise SpecError(
                "trigger_interval",
                f"{self.trigger_interval!r} is not a positive interval",
                "Write e.g. '500 milliseconds', '1 second' or '2 minutes'",
            ) from None
        for name in ("heartbeat_seconds", "heartbeat_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise SpecError(name, f"{value!r} is not a number of seconds", "Give a JSON number, e.g. 2.0")
        if self.heartbeat_seconds <= 0:
            raise SpecError("heartbeat_seconds", "must be positive", "Use e.g. 2.0")
        if self.heartbeat_timeout_seconds < 2 * self.heartbeat_seconds:
            raise SpecError("heartbeat_timeout_seconds",
                            f"{self.heartbeat_timeout_seconds} is under two heartbeats ({self.heartbeat_seconds}s each)",
                            "A driver would be found dead while it lives; use e.g. 30")
        if not isinstance(self.dry_run, bool):  # "false" would make a deploy a dry run
            raise SpecError("dry_run", f"{self.dry_run!r} is not true or false", "Leave it out: upgrades set it")
        if not isinstance(self.standby, bool):
            raise SpecError("standby", f"{self.standby!r} is not true or false", "Use true to keep a warm standby")
        if not isinstance(self.min_batches_to_retain, int) or self.min_batches_to_retain < 2:
            raise SpecError(
                "min_batches_to_retain",
                "must be an integer >= 2",
                "Spark needs the previous batch to replay the current one; 100 is Spark's default",
            )
        _validate_kafka(self.kafka)
        return self


def generation_path(job_root: str, generation: int) -> str:
    return f"{job_root.rstrip('/')}/gen-{generation}"


def parse_interval(text: str | float | int) -> float:
    """Seconds in a trigger interval such as '500 milliseconds' or '2 minutes'."""
    if isinstance(text, int | float):
        return float(text)
    match = _INTERVAL.match(str(text))
    if not match:
        raise ValueError(f"not an interval: {text!r}")
    value, unit = float(match.group(1)), match.group(3)
    if unit == "ms" or unit.startswith("milli"):
        return value / 1000
    if unit.startswith("h"):
        return value * 3600
    return value * 60 if unit.startswith("m") else value


def _validate_checkpoint_root(root: object) -> None:
    """What the provider's checkpoint handling takes (``hooks.checkpoint``), checked before anything starts:
    the job would run, and its first reset or upgrade, in an incident maybe, would fail on the root."""
    fix = "Give an absolute local path, a file:///absolute/path URI or an hdfs://namenode:port/path URI"
    if not isinstance(root, str) or not root.strip():
        raise SpecError("checkpoint_root", f"{root!r} is not a path", fix)
    parts = urlsplit(root)
    if parts.scheme not in ("", "file", "hdfs"):
        raise SpecError("checkpoint_root", f"{root!r} uses scheme {parts.scheme!r}, which the provider cannot "
                        "archive, copy or list", fix)
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise SpecError("checkpoint_root", f"{root!r} names host {parts.netloc!r}", fix)
    if not (parts.path if parts.scheme else root).startswith("/"):
        # relative: each process (the driver, a task, the triggerer) would resolve it against its own directory
        raise SpecError("checkpoint_root", f"{root!r} is not an absolute path", fix)


def _validate_database_url(url: str) -> None:
    if not url or "://" not in url:
        raise SpecError(
            "database_url",
            f"{url!r} is not a database URL",
            "Use e.g. sqlite:////var/lib/stream/state.db or postgresql+psycopg://user@host/db",
        )
    scheme = url.split("://", 1)[0]
    if not (scheme.startswith("sqlite") or scheme.startswith("postgresql")):
        raise SpecError(
            "database_url", f"scheme {scheme!r} is not supported", "Use sqlite:// or postgresql+psycopg://"
        )
    if scheme.startswith("sqlite"):
        database = urlsplit(url.split("?", 1)[0]).path[1:]  # SQLAlchemy's form: sqlite:///<path>
        if not database.startswith("/"):
            # each process (the driver, a task, the triggerer, the api-server) would open its own file, or its
            # own memory: the driver's heartbeats would go where Airflow never looks
            raise SpecError("database_url", f"{url!r} names no absolute SQLite file ({database or 'in memory'!r})",
                            "Give an absolute path, with four slashes: sqlite:////var/lib/stream/state.db")
    parts = urlsplit(url)
    if parts.password or "password" in {k.lower() for k in parse_qs(parts.query)}:
        raise SpecError(
            "database_url",
            "contains a password",
            f"Remove it: the URL is visible in process listings. Put the password in the "
            f"{DATABASE_PASSWORD_ENV} environment variable of the driver",
        )


def _host_port(server: str) -> bool:
    """host:port, as kafka-python and Spark's connector take a broker (no scheme, a numeric port)."""
    host, _, port = server.strip().rpartition(":")
    return bool(host) and "/" not in host and port.isdigit()


def _validate_kafka(kafka: KafkaSpec) -> None:
    if not isinstance(kafka.bootstrap_servers, str) or not kafka.bootstrap_servers or not all(
        _host_port(s) for s in kafka.bootstrap_servers.split(",")
    ):
        raise SpecError(
            "kafka.bootstrap_servers",
            f"{kafka.bootstrap_servers!r} is not host:port[,host:port]",
            "Give the broker list, e.g. 'broker1:9092,broker2:9092'",
        )
    if not kafka.topics:
        raise SpecError("kafka.topics", "is empty", "Name at least one topic")
    for topic in kafka.topics:
        if not isinstance(topic, str) or not _TOPIC.match(topic) or topic in (".", ".."):
            raise SpecError(
                "kafka.topics",
                f"{topic!r} is not a valid Kafka topic name",
                "Topic names use letters, digits, '.', '_' and '-', and are neither '.' nor '..'",
            )
    if kafka.source not in SOURCE_KINDS:
        raise SpecError(
            "kafka.source",
            f"{kafka.source!r} is not one of {', '.join(SOURCE_KINDS)}",
            "Use 'auto' unless you need to force one source",
        )
    if kafka.reader not in READERS:
        raise SpecError(
            "kafka.reader",
            f"{kafka.reader!r} is not one of {', '.join(READERS)}",
            "Use 'kafka-python' (the default) or 'confluent-kafka' with the confluent extra installed",
        )
    if kafka.max_offsets_per_trigger is not None and (
        isinstance(kafka.max_offsets_per_trigger, bool) or not isinstance(kafka.max_offsets_per_trigger, int)
        or kafka.max_offsets_per_trigger < 1
    ):
        raise SpecError(
            "kafka.max_offsets_per_trigger",
            f"{kafka.max_offsets_per_trigger!r} is not a positive integer or null",
            "Bound each batch, e.g. 100000 (the default), so memory stays flat on a backlog",
        )
    if not isinstance(kafka.fail_on_data_loss, bool):
        # The startup check and the source would read a string or a number differently (``"false"`` is
        # truthy): one would skip lost records that the other fails on.
        raise SpecError(
            "kafka.fail_on_data_loss",
            f"{kafka.fail_on_data_loss!r} is not true or false",
            "Give a JSON boolean: true (the default) fails on offsets Kafka no longer has, false skips them "
            "and records the loss",
        )
    if kafka.read_tasks is not None and (
        isinstance(kafka.read_tasks, bool) or not isinstance(kafka.read_tasks, int) or kafka.read_tasks < 1
    ):
        raise SpecError(
            "kafka.read_tasks",
            f"{kafka.read_tasks!r} is not a positive integer or null",
            "Leave it null (half the cores in local mode, one task per partition on a cluster) or give "
            "the number of tasks that read a batch, e.g. 4",
        )
    if not isinstance(kafka.client_options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool) for k, v in kafka.client_options.items()
    ):
        raise SpecError(
            "kafka.client_options",
            f"{kafka.client_options!r} is not a mapping of property names to values",
            'Give Kafka client properties by name, e.g. {"security.protocol": "SSL"}',
        )
    if reserved := kafka_client.reserved_options(kafka.client_options):
        raise SpecError(
            "kafka.client_options",
            f"sets {', '.join(map(repr, reserved))}, which the provider sets itself",
            "Remove them: the brokers come from kafka.bootstrap_servers, the consumer group is "
            "stream-<job_id>, and the sink commits offsets after the results; reads follow exact ranges",
        )
    if unknown := kafka_client.unknown_options(kafka.client_options):
        raise SpecError(
            "kafka.client_options",
            f"kafka-python has no setting {', '.join(map(repr, unknown))}",
            "The driver plans batches and commits the consumer group through kafka-python, whatever the source: "
            "use the properties it knows (security.protocol, sasl.mechanism, sasl.plain.username, "
            "ssl.cafile, request.timeout.ms, ...; its KafkaConsumer settings, with dots or underscores)",
        )
    if mistyped := kafka_client.mistyped_options(kafka.client_options):
        raise SpecError(
            "kafka.client_options",
            ", ".join(f"{name}={kafka.client_options[name]!r}" for name in mistyped)
            + " is not of the kind kafka-python's setting takes",
            'Give a number where the setting is one (e.g. "request.timeout.ms": 15000) and true or false '
            "where it is a flag",
        )
    if kafka.source == "jvm":  # "auto" is decided where the driver runs, which checks it then
        jvm_client_properties(kafka.client_options)
    if kafka.starting_offsets not in ("earliest", "latest"):
        try:
            kafka_offsets.from_spark_json(kafka.starting_offsets)
        except ValueError as err:
            raise SpecError(
                "kafka.starting_offsets",
                str(err),
                'Use "earliest", "latest" or Spark\'s JSON form {"topic": {"0": 42}}',
            ) from None
        # Topics beyond kafka.topics are allowed: a reset resumes from the stored offsets of every stream
        # the sink accounts for, and a second stream (``StreamHarness.kafka_stream``) is declared in the
        # job's code, not here.  The harness warns about offsets that no stream of the job reads.
