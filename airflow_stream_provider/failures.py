"""Classify why a streaming query died, from the text it left behind.

Both sides of the provider need the same answer: the runtime harness picks its exit code from it, and
the Airflow side decides what to do next (restart, reset to a new checkpoint generation, report data
loss, stop a zombie driver). So the classification is a pure function of text (the exception message
plus its cause chain / JVM stack trace) and an optional Spark error class, with no pyspark and no
airflow import.

The knowledge lives in one table, :data:`SIGNATURES`, read top to bottom: the first matching row
wins. The order encodes precedence: this project's own markers first (they are deliberate), then
concurrency, data loss, checkpoint incompatibility, resources, transient outages, and user code last,
because a user function's traceback often wraps an infrastructure error that is the real cause.
"""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass

__all__ = [
    "EXIT_CHECKPOINT_INCOMPATIBLE",
    "EXIT_CONCURRENT",
    "EXIT_CONFIG",
    "EXIT_DATA_LOSS",
    "EXIT_FAILED",
    "EXIT_POISON",
    "EXIT_RESOURCE",
    "EXIT_STOPPED",
    "EXIT_TRANSIENT",
    "SIGNATURES",
    "Classification",
    "FailureKind",
    "KindFacts",
    "Recovery",
    "Signature",
    "classify",
    "exit_code_for",
    "find_error_classes",
    "kind_for_exit_code",
]

# Exit codes of the streaming driver. The process exit code is the one piece of evidence that survives
# even when the state database is unreachable, so the harness encodes the failure kind in it. Those of
# the failure kinds are among each kind's facts (below); these three belong to no single kind.
EXIT_STOPPED = 0  # clean stop
EXIT_FAILED = 1  # USER_CODE / UNKNOWN
EXIT_CONFIG = 2  # bad configuration, detected before start

_RESET = "archive this checkpoint generation and start a new one from the offsets stored in the sink"


class Recovery(enum.StrEnum):
    """What an automatic recovery does about a run that ended with a failure kind (``recovery.py``)."""

    #: a new run on the same checkpoint: Spark replays the unfinished batch, the sink skips what it has
    RESTART = "restart"
    #: archive the checkpoint generation, start a new one from the offsets stored in the sink
    RESET = "reset"
    #: none: no automatic action can be right, a person decides from the evidence
    MANUAL = "manual"


@dataclass(frozen=True)
class KindFacts:
    """What a failure kind means to both sides of the provider."""

    #: the driver's exit code: distinct per kind (USER_CODE and UNKNOWN share EXIT_FAILED), never 0 or 2,
    #: and below 128 (129..192 read as "killed by a signal")
    exit_code: int
    recovery: Recovery
    #: whether Airflow's task retries can fix a start failure of this kind: the cause passes by itself
    retryable: bool
    #: what on-call should do, where no signature's advice is more specific
    advice: str


class FailureKind(enum.StrEnum):
    """Why a run ended badly; each kind calls for a different recovery (see DESIGN.md, "failure kind").

    A ``str`` subclass, so a kind is stored, logged and compared as its plain name. Each kind carries its
    facts (:class:`KindFacts`): the exit code, the recovery, whether a retry helps, the advice. The
    harness, the diagnosis and ``recovery.decide_recovery`` read them, so a new kind is one entry here.
    """

    def __new__(cls, value: str, facts: KindFacts) -> FailureKind:
        kind = str.__new__(cls, value)
        kind._value_ = value
        kind.facts = facts
        return kind

    CHECKPOINT_INCOMPATIBLE = "CHECKPOINT_INCOMPATIBLE", KindFacts(
        exit_code=3, recovery=Recovery.RESET, retryable=False,
        advice=f"The job's code cannot continue its checkpoint: roll back the code, or {_RESET}.")
    DATA_LOSS = "DATA_LOSS", KindFacts(
        exit_code=4, recovery=Recovery.MANUAL, retryable=False,
        advice="Records the job still needs are gone from Kafka: find the lost ranges in the evidence and "
        "decide explicitly whether to accept the loss before restarting.")
    TRANSIENT = "TRANSIENT", KindFacts(
        exit_code=6, recovery=Recovery.RESTART, retryable=True,
        advice="A service the job needs (Kafka, the database, the network) was unreachable: check it; a "
        "restart with backoff resumes from the checkpoint once it answers.")
    POISON = "POISON", KindFacts(
        exit_code=8, recovery=Recovery.MANUAL, retryable=False,
        advice="A record could not be handled nor dead-lettered: inspect it at the position in the "
        "evidence, fix the job or the dead-letter table, then restart.")
    RESOURCE = "RESOURCE", KindFacts(
        exit_code=7, recovery=Recovery.RESTART, retryable=True,
        advice="The driver or an executor ran out of memory or disk: give it more, or lower "
        "maxOffsetsPerTrigger, then restart.")
    CONCURRENT = "CONCURRENT", KindFacts(
        exit_code=5, recovery=Recovery.RESTART, retryable=False,
        advice="Another driver used this job's checkpoint: make sure only one driver of the job runs "
        "(check for a zombie driver), then restart.")
    USER_CODE = "USER_CODE", KindFacts(
        exit_code=EXIT_FAILED, recovery=Recovery.RESTART, retryable=False,
        advice="The job's code failed: fix the code shown in the traceback and deploy it; restarting the "
        "same code fails the same way.")
    UNKNOWN = "UNKNOWN", KindFacts(
        exit_code=EXIT_FAILED, recovery=Recovery.RESTART, retryable=False,
        advice="No known signature matched: read the driver log around the evidence line before "
        "restarting.")

    @property
    def exit_code(self) -> int:
        return self.facts.exit_code

    @property
    def recovery(self) -> Recovery:
        return self.facts.recovery

    @property
    def retryable(self) -> bool:
        return self.facts.retryable

    @property
    def advice(self) -> str:
        return self.facts.advice


EXIT_CHECKPOINT_INCOMPATIBLE = FailureKind.CHECKPOINT_INCOMPATIBLE.exit_code
EXIT_DATA_LOSS = FailureKind.DATA_LOSS.exit_code
EXIT_CONCURRENT = FailureKind.CONCURRENT.exit_code  # fenced / another query on the checkpoint
EXIT_TRANSIENT = FailureKind.TRANSIENT.exit_code
EXIT_RESOURCE = FailureKind.RESOURCE.exit_code
EXIT_POISON = FailureKind.POISON.exit_code

_KINDS_BY_EXIT_CODE: dict[int, FailureKind] = {
    **{kind.exit_code: kind for kind in FailureKind if kind.exit_code != EXIT_FAILED},
    EXIT_FAILED: FailureKind.UNKNOWN,  # USER_CODE and UNKNOWN share 1: the code alone cannot tell them apart
    EXIT_CONFIG: FailureKind.USER_CODE,  # the job's spec is wrong: no retry fixes it, its author does
}


def exit_code_for(kind: FailureKind) -> int:
    """The exit code the job harness uses when a run ends with ``kind``."""
    return FailureKind(kind).exit_code


def kind_for_exit_code(code: int) -> FailureKind | None:
    """Read a driver's exit code back into a failure kind.

    ``None`` when the code says nothing about a failure kind: 0 (clean stop), a negative code
    (Python's "killed by signal N") or 129..192 (a shell's 128 + signal, e.g. 137 for SIGKILL, 143 for
    SIGTERM). A killed driver left no reason; the health check decides from heartbeats and the state
    database instead. Other unexpected codes are UNKNOWN.
    """
    if code == EXIT_STOPPED or code < 0 or 128 < code <= 128 + 64:
        return None
    return _KINDS_BY_EXIT_CODE.get(code, FailureKind.UNKNOWN)


@dataclass(frozen=True)
class Signature:
    """One recognisable failure: how to spot it and what an operator of the job can do about it."""

    name: str
    kind: FailureKind
    # Spark error classes. "X" matches X and its subclasses "X.SUB"; a value ending in "_" or "." is a
    # plain prefix ("STATE_STORE_" matches every STATE_STORE_* class).
    error_classes: tuple[str, ...]
    # Regexes searched (re.MULTILINE) in the full text: message + cause chain / stack trace.
    patterns: tuple[str, ...]
    advice: str


@dataclass(frozen=True)
class Classification:
    """The verdict on one failure text, with the evidence an operator needs to trust or overrule it."""

    kind: FailureKind
    signature: str | None
    error_class: str | None
    evidence: str
    advice: str

    def to_dict(self) -> dict:
        """JSON-ready form, for trigger events, XCom and the state database."""
        return {**asdict(self), "kind": self.kind.value}


_CK = FailureKind.CHECKPOINT_INCOMPATIBLE
# A parse failure whose own stack frames are in Spark's checkpoint readers: a corrupt offsets/commits file,
# or the checkpoint's ``metadata`` file. Only the stack trace tells; the message is just "next on empty
# iterator" or a Jackson error.
_CORRUPT_LOG_PARSE = (
    r"(?:java\.util\.NoSuchElementException|Json\w*Exception|MismatchedInputException|MappingException)"
    r"[^\n]*\n(?:[ \t][^\n]*\n){0,60}?"
    r"\s+at org\.apache\.spark\.sql\.execution\.streaming\.\S*(?:OffsetSeq|CommitLog|HDFSMetadataLog|StreamMetadata)"
)

SIGNATURES: tuple[Signature, ...] = (
    # -- this project's own markers, raised by the runtime sink: deliberate, so they win ---------------
    Signature(
        name="run-fenced",
        kind=FailureKind.CONCURRENT,
        error_classes=("STREAM_RUN_FENCED",),
        patterns=(),
        advice="A newer run of this job holds the current epoch: stop the stale driver; its uncommitted "
        "batch is replayed by the current run, so nothing was lost.",
    ),
    Signature(
        name="concurrent-commit",
        kind=FailureKind.CONCURRENT,
        error_classes=("STREAM_CONCURRENT_COMMIT",),
        patterns=(),
        advice="The job's stored offsets changed under a run that still holds its epoch: a second driver "
        "started with this run's id, or a hand edit of the offsets table. Find and stop the other writer "
        "before restarting; the batch wrote nothing and is replayed from the stored offsets.",
    ),
    Signature(
        name="offset-gap",
        kind=FailureKind.DATA_LOSS,
        error_classes=("STREAM_OFFSET_GAP",),
        patterns=(),
        advice="A batch started above the offsets stored in the sink: compare the evidence with Kafka's "
        "earliest offsets and decide explicitly whether to accept the gap before restarting.",
    ),
    Signature(
        name="poison-record",
        kind=FailureKind.POISON,
        error_classes=("STREAM_POISON_RECORD",),
        patterns=(),
        advice="A record could not be handled nor dead-lettered: inspect it at the topic/partition/offset "
        "in the evidence, fix the job or the dead-letter table, then restart.",
    ),
    Signature(
        name="offsets-log-mismatch",
        kind=_CK,
        error_classes=("STREAM_BATCH_RANGE_MISMATCH", "STREAM_OFFSET_LOG_MISSING"),
        patterns=(),
        advice="The checkpoint's offsets log does not say which records a batch read (an entry is missing, "
        "or was rewritten, e.g. by a second driver on the checkpoint); the sink refused the batch, so the "
        f"stored offsets still match the results: make sure only one driver runs on it, then {_RESET}.",
    ),
    Signature(
        name="write-behind-unapplied",
        kind=_CK,
        error_classes=("STREAM_WRITE_BEHIND_UNAPPLIED",),
        patterns=(),
        advice="A batch that a version writing behind handed to its writer is logged by Spark as done but is "
        "not in the database, and this run's query commits in line (it keeps state, or reads a second "
        "stream), so it cannot apply the batch from Kafka; nothing was written: "
        f"{_RESET}, which reads the batch's records again.",
    ),
    # -- two writers on one checkpoint ----------------------------------------------------------------
    Signature(
        name="concurrent-query",
        kind=FailureKind.CONCURRENT,
        error_classes=("CONCURRENT_QUERY",),
        patterns=(
            r"Another instance of this query was just started by a concurrent session",
            r"as another query with same id is already active",
        ),
        advice="Another run of this query is active on the same checkpoint: stop the other driver "
        "(or wait for it to stop) before starting this one.",
    ),
    Signature(
        name="concurrent-checkpoint-writer",
        kind=FailureKind.CONCURRENT,
        error_classes=("CONCURRENT_STREAM_LOG_UPDATE", "_LEGACY_ERROR_TEMP_2207"),
        patterns=(
            r"Concurrent update to the log\. Multiple streaming jobs detected",
            r"Multiple streaming queries are concurrently using",
        ),
        advice="Two drivers wrote to the same checkpoint: make sure only one driver of this job runs "
        "(check for a zombie driver), then restart.",
    ),
    # -- Kafka no longer has what the checkpoint points at --------------------------------------------
    Signature(
        name="kafka-data-loss",
        kind=FailureKind.DATA_LOSS,
        error_classes=("KAFKA_DATA_LOSS",),
        patterns=(
            r"[Ss]ome data may have been (?:lost|missed)",
            r"\bOffsetOutOfRangeError\b",
        ),
        advice="Offsets the job still needs are gone from Kafka (retention or a deleted topic): find the "
        "lost ranges, then resume from Kafka's earliest offsets only if losing them is acceptable.",
    ),
    # -- the new code cannot continue the old checkpoint ----------------------------------------------
    Signature(
        name="stateful-operator-schema-changed",
        kind=_CK,
        error_classes=(
            "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
            "STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE",
            "STATE_STORE_COLUMN_FAMILY_SCHEMA_INCOMPATIBLE",
            "STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION",
            "STATE_STORE_VALUE_SCHEMA_EVOLUTION_THRESHOLD_EXCEEDED",
            "STATE_STORE_STATE_SCHEMA_FILES_THRESHOLD_EXCEEDED",
            "STATE_STORE_INVALID_VARIABLE_TYPE_CHANGE",
            "STATE_STORE_INVALID_CONFIG_AFTER_RESTART",
        ),
        patterns=(
            r"Provided (?:key |value )?schema does(?:n't| not) match (?:to the schema for )?existing state",
            r"StateSchemaNotCompatible",
        ),
        advice=f"The keys or values of a stateful operator changed: roll back the code, or {_RESET}.",
    ),
    Signature(
        name="stateful-operator-changed",
        kind=_CK,
        error_classes=("STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA",),
        patterns=(r"Streaming stateful operator name does not match with the operator in state metadata",),
        advice=f"A stateful operator was added, removed or replaced: roll back the code, or {_RESET}.",
    ),
    Signature(
        name="state-directory-missing",
        kind=_CK,
        error_classes=("STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY",),
        patterns=(r"state directory is empty or missing",),
        advice="The checkpoint has no state for the query's stateful operators (operator added to a "
        f"stateless job, or state files lost): restore the state directory, or {_RESET}.",
    ),
    Signature(
        name="source-count-changed",
        kind=_CK,
        error_classes=(),
        patterns=(
            (
                r"There are \[\d+\] sources in the checkpoint offsets and now there are \[\d+\] sources "
                r"requested by the query"
            ),
        ),
        advice=f"The number of streaming sources changed: roll back the code, or {_RESET}.",
    ),
    Signature(
        name="checkpoint-log-version-too-new",
        kind=_CK,
        error_classes=(
            "INVALID_LOG_VERSION",
            "CANNOT_LOAD_STATE_STORE.INVALID_CHANGE_LOG_READER_VERSION",
            "CANNOT_LOAD_STATE_STORE.INVALID_CHANGE_LOG_WRITER_VERSION",
        ),
        patterns=(r"UnsupportedLogVersion", r"maximum supported log version is v\d+"),
        advice=f"A newer Spark wrote this checkpoint: run the job on that Spark version, or {_RESET}.",
    ),
    Signature(
        name="checkpoint-corrupt",
        kind=_CK,
        error_classes=(
            "MALFORMED_LOG_FILE",
            "STREAMING_CHECKPOINT_MISSING_METADATA_FILE",
            "CHECKPOINT_FILE_CHECKSUM_VERIFICATION_FAILED",
            "STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY",
            "STATE_STORE_KEY_ROW_FORMAT_VALIDATION_FAILURE",
            "STATE_STORE_VALUE_ROW_FORMAT_VALIDATION_FAILURE",
            "STATE_STORE_ROW_CHECKSUM_VERIFICATION_FAILED",
            "CANNOT_LOAD_STATE_STORE.CANNOT_READ_",
            "CANNOT_LOAD_STATE_STORE.CANNOT_FIND_BASE_SNAPSHOT_CHECKPOINT",
            "CANNOT_LOAD_STATE_STORE.AUTO_SNAPSHOT_REPAIR_FAILED",
            "CANNOT_LOAD_STATE_STORE.INVALID_CHECKPOINT_LINEAGE",
            "CANNOT_LOAD_STATE_STORE.KEY_ROW_FORMAT_VALIDATION_FAILURE",
            "CANNOT_LOAD_STATE_STORE.VALUE_ROW_FORMAT_VALIDATION_FAILURE",
            "CANNOT_LOAD_STATE_STORE.SNAPSHOT_PARTITION_ID_NOT_FOUND",
            "CANNOT_LOAD_STATE_STORE.UNEXPECTED_FILE_SIZE",
            "CANNOT_LOAD_STATE_STORE.UNEXPECTED_VERSION",
        ),
        patterns=(
            r"Log file was malformed",
            r"Incomplete log file",
            r"Failed to read log file \S*/(?:offsets|commits)/\d+",
            r"Error reading (?:delta|snapshot|streaming state) file",
            r"ChecksumException: Checksum error: \S*/(?:offsets|commits|state|sources|metadata)\b",
            _CORRUPT_LOG_PARSE,
        ),
        advice="A checkpoint file is unreadable or missing: restore it from a copy if there is one, "
        f"otherwise {_RESET}.",
    ),
    Signature(
        name="checkpoint-metadata-mismatch",
        kind=_CK,
        error_classes=(
            "STREAMING_QUERY_EVOLUTION_ERROR.CANNOT_ENABLE_ON_EXISTING_CHECKPOINT",
            "STREAMING_UNFINISHED_REPARTITION_DETECTED",
        ),
        patterns=(
            r"This query does not support recovering from checkpoint location",
            r"we detected a possible problem with the location of your checkpoint",
        ),
        advice=f"The checkpoint's metadata does not fit this query or Spark version: {_RESET}.",
    ),
    # -- the machine ran out of something ------------------------------------------------------------
    Signature(
        name="jvm-out-of-memory",
        kind=FailureKind.RESOURCE,
        error_classes=(
            "CANNOT_LOAD_STATE_STORE.HDFS_STORE_PROVIDER_OUT_OF_MEMORY",
            "CANNOT_LOAD_STATE_STORE.ROCKSDB_STORE_PROVIDER_OUT_OF_MEMORY",
            "AGGREGATE_OUT_OF_MEMORY",
            "UNABLE_TO_ACQUIRE_MEMORY",
            "SPILL_OUT_OF_MEMORY",
            "POINTER_ARRAY_OUT_OF_MEMORY",
        ),
        patterns=(r"java\.lang\.OutOfMemoryError",),
        advice="A JVM ran out of memory: raise driver/executor memory or lower maxOffsetsPerTrigger, "
        "then restart.",
    ),
    Signature(
        name="container-killed-for-memory",
        kind=FailureKind.RESOURCE,
        error_classes=(),
        patterns=(
            r"Container killed by YARN for exceeding (?:physical |virtual )?memory limits",
            r"possible container OOM",
            r"\bOOMKilled\b",
            r"exited with exit code 137\b",
        ),
        advice="The cluster manager killed a container for using too much memory: raise the memory "
        "overhead (spark.executor.memoryOverhead) or lower the batch size, then restart.",
    ),
    Signature(
        name="python-out-of-memory",
        kind=FailureKind.RESOURCE,
        error_classes=(),
        patterns=(
            r"^[ \t]*MemoryError\b",
            (
                r"Python worker exited unexpectedly \(crashed\)[^\n]*(?:\n[^\n]*){0,30}?"
                r"(?:MemoryError|Cannot allocate memory|[Oo]ut of memory|std::bad_alloc)"
            ),
        ),
        advice="A Python worker ran out of memory: raise spark.executor.pyspark.memory or the executor "
        "memory overhead, or lower the batch size, then restart.",
    ),
    Signature(
        name="executor-lost",
        kind=FailureKind.RESOURCE,
        error_classes=(),
        patterns=(r"\bExecutorLostFailure\b",),
        advice="An executor died during a batch (often memory, sometimes a lost node): check the executor "
        "logs for OOM kills, give executors more memory if so, then restart.",
    ),
    Signature(
        name="disk-full",
        kind=FailureKind.RESOURCE,
        error_classes=(),
        patterns=(r"No space left on device", r"\bENOSPC\b"),
        advice="A disk is full (checkpoint, spark.local.dir or the sink): free space or move it, then "
        "restart.",
    ),
    # -- something the job talks to was briefly away -------------------------------------------------
    Signature(
        name="kafka-unreachable",
        kind=FailureKind.TRANSIENT,
        error_classes=(),
        patterns=(
            # kafka-python; "(?!\()" skips traceback source lines such as "raise Errors.KafkaTimeoutError("
            r"\b(?:NoBrokersAvailable|KafkaTimeoutError|KafkaConnectionError)\b(?!\()",
            r"Failed to update metadata",
            r"Unable to bootstrap from",
            r"org\.apache\.kafka\.common\.errors\.(?:TimeoutException|NetworkException|DisconnectException)",
            # The Python Kafka source's executor side gave up waiting for a range the driver planned. It
            # reaches the driver inside a Python worker traceback, which the user-code row below would
            # otherwise claim; records that left Kafka show up as OffsetOutOfRangeError (data loss) instead.
            r"\bKafkaReadError: (?:stalled|timed out) reading\b",  # "timed out": the wording of earlier drivers
        ),
        advice="Kafka was unreachable: check the brokers and the bootstrap servers; a restart with "
        "backoff resumes from the checkpoint once they answer.",
    ),
    Signature(
        name="database-unreachable",
        kind=FailureKind.TRANSIENT,
        error_classes=(),
        patterns=(
            (
                # psycopg 3 begins a refusal of the job's credentials with "connection failed" too: that is
                # "database-refused-the-job", no outage
                r"(?i)OperationalError\b(?!(?s:.*)(?:FATAL:\s+(?:password authentication|role \"|database \"|no pg_hba)"
                r"|fe_sendauth))"
                r".*(?:connection refused|could not connect|server closed the connection "
                r"unexpectedly|connection failed|connection timed out|timeout expired)"
            ),
            r"(?i)OperationalError\b.*database is locked",
            r"\bpsycopg2?\.errors\.(?:AdminShutdown|CannotConnectNow|SerializationFailure|DeadlockDetected)\b",
            # the server ended a session frozen inside its transaction (``dialect.IDLE_IN_TRANSACTION_TIMEOUT_S``)
            r"\bpsycopg2?\.errors\.IdleInTransactionSessionTimeout\b",
        ),
        advice="The sink/state database was unreachable or busy: check it; a restart with backoff replays "
        "the uncommitted batch and the sink skips what it already has.",
    ),
    Signature(
        name="network-unreachable",
        kind=FailureKind.TRANSIENT,
        error_classes=(),
        patterns=(
            r"java\.net\.(?:ConnectException|SocketTimeoutException|NoRouteToHostException)",
            r"\b(?:ConnectionRefusedError|ConnectionResetError)\b",
        ),
        advice="A network connection failed (HDFS, a database, a broker): check the service named in the "
        "evidence; a restart with backoff resumes from the checkpoint.",
    ),
    # -- the job's results and the tables they go to -----------------------------------------------------
    Signature(
        name="database-refused-the-job",
        kind=FailureKind.USER_CODE,
        error_classes=(),
        patterns=(
            r"\bFATAL:\s+(?:password authentication failed|role \"[^\"]*\" does not exist|database \"[^\"]*\" "
            r"does not exist|no pg_hba\.conf entry)",
            r"\bfe_sendauth: no password supplied\b",
            r"(?i)OperationalError\b.*unable to open database file",
        ),
        advice="The sink/state database refused the job's connection (its user, password, database name or "
        "file path): fix the spec's database_url or the state connection's password; a restart with the same "
        "settings fails the same way.",
    ),
    Signature(
        name="result-table-mismatch",
        kind=FailureKind.USER_CODE,
        error_classes=(),
        patterns=(
            r"\btable \S+ has no column named \S+",  # SQLite
            r"\bno such column: \S+",
            r"\bON CONFLICT clause does not match any PRIMARY KEY or UNIQUE constraint",
            r"\bpsycopg2?\.errors\.(?:UndefinedColumn|InvalidColumnReference)\b",  # PostgreSQL
            r'\bcolumn "[^"]+" of relation "[^"]+" does not exist',
            r"\bno unique or exclusion constraint matching the ON CONFLICT specification",
        ),
        advice="The job's results do not fit the result table they go to: a column the table lacks, or a key "
        "it has no unique constraint on. The table was made by an earlier version of the job, and an existing "
        "table is left as it is. Migrate it (ALTER TABLE ... ADD COLUMN, a unique index on the new key), or "
        "write the new results to a table of a new name. The failed batch committed nothing: a restart after "
        "the migration applies it.",
    ),
    # -- the job's own code: last, so that the infrastructure errors it wraps win --------------------
    Signature(
        name="python-user-code",
        kind=FailureKind.USER_CODE,
        error_classes=(
            "PYTHON_EXCEPTION",
            "FOREACH_BATCH_USER_FUNCTION_ERROR",
            "FOREACH_USER_FUNCTION_ERROR",
            "FLATMAPGROUPSWITHSTATE_USER_FUNCTION_ERROR",
            "TRANSFORM_WITH_STATE_USER_FUNCTION_ERROR",
        ),
        patterns=(
            r"An exception was thrown from the Python worker",
            r"An exception was raised by the Python Proxy",
            r"pyspark\.errors\.exceptions\.captured\.PythonException",
        ),
        advice="The job's Python code raised an exception (UDF or foreachBatch): fix the code shown in the "
        "traceback and deploy it; restarting the same code fails the same way.",
    ),
    Signature(
        name="query-analysis-error",
        kind=FailureKind.USER_CODE,
        error_classes=(
            "UNRESOLVED_",
            "DATATYPE_MISMATCH",
            "AMBIGUOUS_REFERENCE",
            "INVALID_EXTRACT_",
            "STREAMING_OUTPUT_MODE",
            "UNSUPPORTED_STREAMING_OPERATOR_WITHOUT_WATERMARK",
            "NON_TIME_WINDOW_NOT_SUPPORTED_IN_STREAMING",
            "CALL_ON_STREAMING_DATASET_UNSUPPORTED",
        ),
        patterns=(r"(?:pyspark\.errors\.exceptions\.captured|org\.apache\.spark\.sql)\.AnalysisException",),
        advice="Spark rejected the query the job built (unknown column, type mismatch, unsupported "
        "streaming operation): fix the job code and deploy it.",
    ),
)

# Generic wrappers: reported as the error class only when nothing more specific is in the text.
_WRAPPER_CLASSES = frozenset({"STREAM_FAILED"})
_ERROR_CLASS = re.compile(r"\[(_?[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+(?:\.[A-Z][A-Z0-9_]*)*)\]")
_COMPILED = {sig.name: tuple(re.compile(p, re.MULTILINE) for p in sig.patterns) for sig in SIGNATURES}
_EVIDENCE_CHARS = 300


def find_error_classes(text: str) -> list[str]:
    """Every ``[ERROR_CLASS]`` / ``[ERROR_CLASS.SUB]`` in the text, once each, in order of appearance.

    Spark prefixes a SparkThrowable's message with its class in brackets, and a streaming failure nests
    several (``[STREAM_FAILED] ... [STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] ...``), so the text carries
    the cause chain's classes even when the caller only knows the outer one. At least one underscore is
    required, which keeps out log levels such as ``[INFO]``.
    """
    return list(dict.fromkeys(_ERROR_CLASS.findall(text or "")))


def _class_matches(found: str, wanted: str) -> bool:
    if wanted.endswith(("_", ".")):
        return found.startswith(wanted)
    return found == wanted or found.startswith(wanted + ".")


def _evidence_at(text: str, pos: int) -> str:
    """The stripped line holding text[pos], cut around the match when the line is long."""
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : end if end != -1 else len(text)]
    col = pos - start
    stripped = line.strip()
    if len(stripped) <= _EVIDENCE_CHARS:
        return stripped
    col -= len(line) - len(line.lstrip())
    begin = max(0, min(col - 80, len(stripped) - _EVIDENCE_CHARS))
    cut = stripped[begin : begin + _EVIDENCE_CHARS]
    return ("..." if begin else "") + cut + ("..." if begin + _EVIDENCE_CHARS < len(stripped) else "")


def _match(sig: Signature, text: str, classes: list[str]) -> tuple[int, str | None] | None:
    """Where ``sig`` first matches (-1: only by a class absent from the text) and the class it matched."""
    positions: list[int] = []
    matched_class = None
    for found in classes:
        if any(_class_matches(found, wanted) for wanted in sig.error_classes):
            matched_class = matched_class or found
            positions.append(text.find(found))
    positions += [m.start() for m in (p.search(text) for p in _COMPILED[sig.name]) if m]
    if not positions:
        return None
    in_text = [p for p in positions if p >= 0]
    return (min(in_text) if in_text else -1), matched_class


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return _evidence_at(line, 0)
    return ""


def classify(text: str, error_class: str | None = None) -> Classification:
    """Classify one failure.

    ``text`` should be everything known: the exception message and its cause chain / JVM stack trace
    (PySpark's ``str(exc)`` with ``spark.sql.pyspark.jvmStacktrace.enabled``). Several checkpoint
    failures are only recognisable from the stack frames. ``error_class`` is what the exception itself
    reported (``getCondition()``), which for a dead query is usually just ``STREAM_FAILED``.
    """
    text = text or ""
    parsed = find_error_classes(text)
    classes = list(dict.fromkeys([error_class, *parsed] if error_class else parsed))
    for sig in SIGNATURES:
        hit = _match(sig, text, classes)
        if hit is None:
            continue
        pos, matched_class = hit
        evidence = _evidence_at(text, pos) if pos >= 0 else f"error class {matched_class}"
        return Classification(
            kind=sig.kind,
            signature=sig.name,
            error_class=matched_class or _reported_class(classes),
            evidence=evidence,
            advice=sig.advice,
        )
    return Classification(
        kind=FailureKind.UNKNOWN,
        signature=None,
        error_class=_reported_class(classes),
        evidence=_first_line(text),
        advice=FailureKind.UNKNOWN.advice,
    )


def _reported_class(classes: list[str]) -> str | None:
    specific = [c for c in classes if c not in _WRAPPER_CLASSES]
    return (specific or classes or [None])[0]
