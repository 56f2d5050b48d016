"""Tests for the failure classifier: one sample per signature, real Spark texts, ordering, exit codes.

Pure: no Spark here. The real texts in ``fixtures/spark_errors`` come from ``capture.py``, run by hand
with the Spark virtualenv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_stream_provider.failures import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_STOPPED,
    SIGNATURES,
    Classification,
    FailureKind,
    Recovery,
    classify,
    exit_code_for,
    find_error_classes,
    kind_for_exit_code,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "spark_errors"

# At least one text per signature, in the shapes Spark, kafka-python, psycopg and this project print.
# A signature without an entry fails test_every_signature_has_a_sample.
SAMPLES: dict[str, tuple[str, ...]] = {
    "run-fenced": (
        "StreamRunFencedError: [STREAM_RUN_FENCED] run epoch 3 is no longer current (current epoch 4)",
    ),
    "concurrent-commit": (
        "ConcurrentCommitError: [STREAM_CONCURRENT_COMMIT] job j batch 4: stored offsets moved from "
        '{"events":{"0":4}} to {"events":{"0":9}} while the batch was being computed, though run r still '
        "holds the job's epoch 2",
    ),
    "offset-gap": ("[STREAM_OFFSET_GAP] batch starts at events/0:120 but the stored next offset is 100",),
    "poison-record": ("[STREAM_POISON_RECORD] events/0:57 could not be handled nor dead-lettered",),
    "offsets-log-mismatch": (
        "[STREAM_BATCH_RANGE_MISMATCH] job j batch 7: partition events-0: the offsets log gives the batch "
        "[100, 150) (offsets/6 to offsets/7) but the records Spark handed it span offsets 100 to 199.",
        "[STREAM_OFFSET_LOG_MISSING] job j batch 7: offsets log entry offsets/6 (where the batch starts) is "
        "missing from /ckpt/j/gen-1/offsets",
    ),
    "write-behind-unapplied": (
        "[STREAM_WRITE_BEHIND_UNAPPLIED] job j batch 7: a run that wrote behind handed the batch to its writer "
        "and ended before its commit was known; Spark logged the batch as done, and the database does not hold "
        "it (events-0 [100, 150)). This run's query keeps state, so it commits every batch in line",
    ),
    "concurrent-query": (
        (
            "[CONCURRENT_QUERY] Another instance of this query was just started by a concurrent session. "
            "SQLSTATE: 0A000"
        ),
        (
            "java.lang.IllegalStateException: Cannot start query with id 6852a503 as another query with same "
            "id is already active. Perhaps you are attempting to restart a query from checkpoint"
        ),
    ),
    "concurrent-checkpoint-writer": (
        (
            "[CONCURRENT_STREAM_LOG_UPDATE] Concurrent update to the log. Multiple streaming jobs detected for "
            "17. Please make sure only one streaming job runs on a specific checkpoint location at a time."
        ),
        (
            "org.apache.spark.SparkConcurrentModificationException: Multiple streaming queries are "
            "concurrently using file:/ckpt/offsets."
        ),
    ),
    "kafka-data-loss": (
        (  # the Python source's readers, inside a read task's Python worker traceback
            "pyspark.errors.exceptions.captured.PythonException: An exception was thrown from the Python worker.\n"
            "airflow_stream_provider.kafka_client.KafkaReadError: [KAFKA_DATA_LOSS.COULD_NOT_READ_OFFSET_RANGE] "
            "reading events-0 [230, 260): the log ends at offset 240, before the range does. Some data may have "
            "been lost because they are not available in Kafka any more: records [240, 260)"
        ),
        (
            "[KAFKA_DATA_LOSS.START_OFFSET_RESET] Some data may have been lost because they are not available "
            "in Kafka any more; either the data was aged out by Kafka or the topic may have been deleted "
            "before all the data in the topic was processed. Starting offset for events-0 was 10 but "
            "consumer reset to 40. SQLSTATE: 22000"
        ),
        (
            "java.lang.IllegalStateException: Partition events-0's offset was changed from 78 to 0, some data "
            "may have been missed."
        ),
        "kafka.errors.OffsetOutOfRangeError: {TopicPartition(topic='events', partition=0): 42}",
    ),
    "stateful-operator-schema-changed": (
        (
            "[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match existing state key "
            "schema. Please check number and type of fields."
        ),
        (
            "[STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE] Provided value schema does not match existing state "
            "value schema."
        ),
        (
            "org.apache.spark.sql.execution.streaming.state.StateSchemaNotCompatible: Provided schema doesn't "
            "match to the schema for existing state! Please note that Spark allow difference of field name"
        ),
        (
            "[STATE_STORE_INVALID_CONFIG_AFTER_RESTART] Cannot change spark.sql.streaming.stateStore.encoding "
            "from unsaferow to avro between restarts."
        ),
    ),
    "stateful-operator-changed": (
        (
            "[STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA] Streaming stateful operator name does "
            "not match with the operator in state metadata."
        ),
    ),
    "state-directory-missing": (
        (
            "[STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY] Cannot restart streaming query with stateful "
            "operators because the state directory is empty or missing."
        ),
    ),
    "source-count-changed": (
        (
            "java.lang.AssertionError: assertion failed: There are [1] sources in the checkpoint offsets and "
            "now there are [2] sources requested by the query. Cannot continue."
        ),
    ),
    "checkpoint-log-version-too-new": (
        (
            "[INVALID_LOG_VERSION.MAX_SUPPORTED_VERSION] UnsupportedLogVersion. The maximum supported log "
            "version is v2, but encountered v99."
        ),
        (
            "java.lang.IllegalStateException: UnsupportedLogVersion: maximum supported log version is v1, but "
            "encountered v2. The log file was produced by a newer version of Spark"
        ),
    ),
    "checkpoint-corrupt": (
        ("[MALFORMED_LOG_FILE] Log file was malformed: failed to read correct log version from v."),
        "java.lang.IllegalStateException: Failed to read log file file:/ckpt/offsets/2. Incomplete log file",
        (
            "[CANNOT_LOAD_STATE_STORE.CANNOT_READ_DELTA_FILE_NOT_EXISTS] An error occurred during loading "
            "state. Error reading delta file /ckpt/state/0/1/3.delta of HDFSStateStoreProvider"
        ),
        (
            "Caused by: java.util.NoSuchElementException: next on empty iterator\n"
            "\tat scala.collection.Iterator$$anon$19.next(Iterator.scala:980)\n"
            "\tat org.apache.spark.sql.execution.streaming.checkpointing.OffsetSeqLog.deserialize("
            "OffsetSeqLog.scala:71)\n"
        ),
        (
            "Caused by: com.fasterxml.jackson.core.JsonParseException: Unexpected character ('n' (code 110))\n"
            " at [Source: REDACTED; line: 1, column: 2]\n"
            "\tat org.json4s.jackson.JsonMethods.parse(JsonMethods.scala:38)\n"
            "\tat org.apache.spark.sql.execution.streaming.checkpointing.CommitLog$.deserialize(CL.scala)\n"
        ),
    ),
    "checkpoint-metadata-mismatch": (
        (
            "org.apache.spark.sql.AnalysisException: This query does not support recovering from checkpoint "
            "location. Delete /ckpt/offsets to start over."
        ),
    ),
    "jvm-out-of-memory": (
        ("Caused by: java.lang.OutOfMemoryError: Java heap space"),
        (
            "[CANNOT_LOAD_STATE_STORE.ROCKSDB_STORE_PROVIDER_OUT_OF_MEMORY] An error occurred during loading "
            "state."
        ),
    ),
    "container-killed-for-memory": (
        (
            "ExecutorLostFailure (executor 3 exited caused by one of the running tasks) Reason: Container "
            "killed by YARN for exceeding physical memory limits. 4.5 GB of 4.5 GB physical memory used."
        ),
        "The executor with id 2 exited with exit code 137(SIGKILL, possible container OOM).",
    ),
    "python-out-of-memory": (
        (
            "[PYTHON_EXCEPTION] An exception was thrown from the Python worker: Traceback (most recent call "
            'last):\n  File "job.py", line 3, in grow\nMemoryError\n'
        ),
        (
            "org.apache.spark.SparkException: Python worker exited unexpectedly (crashed): \n"
            "Fatal Python error: Cannot allocate memory\n"
        ),
    ),
    "executor-lost": (
        (
            "Job aborted due to stage failure: Task 0 in stage 3.0 failed 4 times: ExecutorLostFailure "
            "(executor 1 exited unrelated to the running tasks) Reason: Remote RPC client disassociated."
        ),
    ),
    "disk-full": ("java.io.IOException: No space left on device",),
    "kafka-unreachable": (
        ("kafka.errors.NoBrokersAvailable: NoBrokersAvailable"),
        "kafka.errors.KafkaTimeoutError: KafkaTimeoutError: Failed to update metadata after 60.0 secs.",
        "kafka.errors.KafkaConnectionError: KafkaConnectionError: Connection at 127.0.0.1:9092 closed",
        "org.apache.kafka.common.errors.TimeoutException: Timeout expired while fetching topic metadata",
        (  # the Python source's read, after the broker stayed away longer than the read timeout
            "org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 7.0 failed 4 "
            "times, most recent failure: Lost task 0.3 in stage 7.0 (TID 31) (localhost executor driver): "
            "org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the "
            "Python worker: Traceback (most recent call last):\n"
            '  File "/opt/job/airflow_stream_provider/kafka_client.py", line 108, in read_range\n'
            "    raise KafkaReadError(\n"
            "airflow_stream_provider.kafka_client.KafkaReadError: timed out reading events-0 [1500, 3000): "
            "stopped at 1500; is the broker reachable?"
        ),
    ),
    "result-table-mismatch": (
        "sqlalchemy.exc.OperationalError: (sqlite3.OperationalError) table events has no column named currency",
        "sqlite3.OperationalError: ON CONFLICT clause does not match any PRIMARY KEY or UNIQUE constraint",
        (
            'psycopg.errors.UndefinedColumn: column "currency" of relation "events" does not exist\n'
            "LINE 1: INSERT INTO events (event_id, currency) VALUES ($1, $2)"
        ),
        (
            "sqlalchemy.exc.ProgrammingError: (psycopg.errors.InvalidColumnReference) there is no unique or "
            "exclusion constraint matching the ON CONFLICT specification"
        ),
    ),
    # psycopg 3's texts, from PostgreSQL 15; they begin as an unreachable server's do
    "database-refused-the-job": (
        (
            'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 '
            'failed: FATAL:  password authentication failed for user "stream"'
        ),
        (
            'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 '
            'failed: FATAL:  role "nosuchuser" does not exist'
        ),
        (
            'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 '
            'failed: FATAL:  database "no_such_db" does not exist'
        ),
        (
            'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 '
            "failed: fe_sendauth: no password supplied"
        ),
        "sqlite3.OperationalError: unable to open database file",
        (  # a connection string naming several hosts: one line per host tried
            'psycopg.OperationalError: connection failed: connection to server at "10.0.0.1", port 5432 failed: '
            "Connection refused\n"
            'Multiple connection attempts failed. All failures were:\n- host: \'db2\', port: \'5432\', hostaddr: '
            "'10.0.0.2': connection failed: FATAL:  password authentication failed for user \"stream\""
        ),
    ),
    "database-unreachable": (
        (
            'psycopg.OperationalError: connection failed: connection to server at "127.0.0.1", port 5432 '
            "failed: Connection refused"
        ),
        "psycopg2.OperationalError: could not connect to server: No such file or directory",
        "psycopg.OperationalError: server closed the connection unexpectedly",
        "sqlite3.OperationalError: database is locked",
    ),
    "network-unreachable": (
        (
            "Caused by: java.net.ConnectException: Call From host/10.0.0.1 to namenode:8020 failed on "
            "connection exception: java.net.ConnectException: Connection refused"
        ),
        "Caused by: java.net.SocketTimeoutException: Read timed out",
        "ConnectionRefusedError: [Errno 111] Connection refused",
    ),
    "python-user-code": (
        (
            "[PYTHON_EXCEPTION] An exception was thrown from the Python worker: Traceback (most recent call "
            "last):\nValueError: invalid literal for int() with base 10: 'x1'"
        ),
        (
            "[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided function in foreach "
            "batch sink. Reason: An exception was raised by the Python Proxy. Return Message: Traceback"
        ),
        "pyspark.errors.exceptions.captured.PythonException: KeyError: 'amount'",
    ),
    "query-analysis-error": (
        (
            "[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `valeu` "
            "cannot be resolved. Did you mean one of the following? [`value`, `a`]."
        ),
        '[DATATYPE_MISMATCH.BINARY_OP_DIFF_TYPES] Cannot resolve "(a + b)" due to data type mismatch',
        "pyspark.errors.exceptions.captured.AnalysisException: Append output mode not supported",
    ),
}

# The real Spark 4.3 texts captured by fixtures/spark_errors/capture.py. A new capture without an entry
# here fails test_real_spark_error, so every real text gets a deliberate expectation.
EXPECTED_FIXTURE_KINDS: dict[str, FailureKind] = {
    "source_count_changed": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "aggregation_keys_changed": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "aggregation_value_changed": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "dedup_columns_changed": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "stateful_operator_changed": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "stateful_operator_added": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "state_dir_missing": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "metadata_file_missing": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "metadata_file_garbage": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "offsets_log_future_version": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "offsets_log_truncated": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "offsets_log_empty": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "offsets_log_garbage": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "commits_log_garbage": FailureKind.CHECKPOINT_INCOMPATIBLE,
    "concurrent_same_session": FailureKind.CONCURRENT,
    "concurrent_two_drivers": FailureKind.CONCURRENT,
    "foreach_batch_user_error": FailureKind.USER_CODE,
    "foreach_batch_db_unreachable": FailureKind.TRANSIENT,
    "foreach_batch_sqlite_locked": FailureKind.TRANSIENT,
    "foreach_batch_fenced": FailureKind.CONCURRENT,
    "foreach_batch_offset_gap": FailureKind.DATA_LOSS,
    "foreach_batch_poison": FailureKind.POISON,
    "udf_user_error": FailureKind.USER_CODE,
    "udf_memory_error": FailureKind.RESOURCE,
    # SIGKILL leaves no reason at all ("crashed): " then EOFException): nothing says it was memory.
    "python_worker_killed": FailureKind.UNKNOWN,
    "unresolved_column": FailureKind.USER_CODE,
    "python_source_no_brokers": FailureKind.TRANSIENT,
}


def in_text(evidence: str, text: str) -> bool:
    """Evidence is a line of the text, possibly cut to about 300 characters and marked with '...'."""
    return evidence.removeprefix("...").removesuffix("...") in text


def read_fixture(path: Path) -> tuple[str, str | None]:
    """Split a capture into (text, error class reported by the exception) as the runtime would see them."""
    header, _, body = path.read_text(encoding="utf-8").partition("\n\n")
    first = header.splitlines()[0]
    assert first.startswith("error_class: "), f"{path.name}: first line must be 'error_class: X'"
    error_class = first.removeprefix("error_class: ").strip()
    return body, None if error_class == "None" else error_class


# ------------------------------------------------------------------------------------------ the table


def test_every_signature_has_a_sample() -> None:
    names = [sig.name for sig in SIGNATURES]
    assert sorted(set(names) - set(SAMPLES)) == [], "add a sample text for each new signature"
    assert sorted(set(SAMPLES) - set(names)) == [], "samples for signatures that no longer exist"


@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda sig: sig.name)
def test_signature_sample_classifies_to_it(sig) -> None:
    assert SAMPLES.get(sig.name), f"no sample for {sig.name}"
    for text in SAMPLES[sig.name]:
        result = classify(text)
        assert (result.signature, result.kind) == (sig.name, sig.kind), text
        assert result.advice == sig.advice
        assert result.evidence and in_text(result.evidence, text)


def test_signature_table_is_well_formed() -> None:
    names = [sig.name for sig in SIGNATURES]
    assert len(names) == len(set(names))
    for sig in SIGNATURES:
        assert re.fullmatch(r"[a-z]+(?:-[a-z]+)*", sig.name), sig.name
        assert sig.kind is not FailureKind.UNKNOWN, "UNKNOWN is the fallback, not a signature"
        assert sig.error_classes or sig.patterns, sig.name
        assert isinstance(sig.error_classes, tuple) and isinstance(sig.patterns, tuple)
        for pattern in sig.patterns:
            re.compile(pattern)
        assert sig.advice.endswith(".") and "\n" not in sig.advice, sig.name


def test_user_code_signatures_come_last() -> None:
    kinds = [sig.kind for sig in SIGNATURES]
    first_user_code = kinds.index(FailureKind.USER_CODE)
    assert all(kind is FailureKind.USER_CODE for kind in kinds[first_user_code:])


# ------------------------------------------------------------------------------------ real Spark texts


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.txt")), ids=lambda path: path.stem)
def test_real_spark_error(path: Path) -> None:
    assert path.stem in EXPECTED_FIXTURE_KINDS, f"add {path.stem!r} to EXPECTED_FIXTURE_KINDS"
    text, error_class = read_fixture(path)
    result = classify(text, error_class)
    assert result.kind is EXPECTED_FIXTURE_KINDS[path.stem], result
    if result.kind is not FailureKind.UNKNOWN:
        assert result.signature is not None and in_text(result.evidence, text)


def test_every_expected_fixture_exists() -> None:
    missing = sorted(name for name in EXPECTED_FIXTURE_KINDS if not (FIXTURES / f"{name}.txt").exists())
    assert missing == []


@pytest.mark.parametrize(
    ("name", "signature", "error_class"),
    [
        (
            "aggregation_keys_changed",
            "stateful-operator-schema-changed",
            "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
        ),
        (
            "aggregation_value_changed",
            "stateful-operator-schema-changed",
            "STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE",
        ),
        (
            "dedup_columns_changed",
            "stateful-operator-schema-changed",
            "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE",
        ),
        (
            "stateful_operator_changed",
            "stateful-operator-changed",
            "STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA",
        ),
        (
            "offsets_log_future_version",
            "checkpoint-log-version-too-new",
            "INVALID_LOG_VERSION.MAX_SUPPORTED_VERSION",
        ),
        ("source_count_changed", "source-count-changed", "STREAM_FAILED"),
        ("offsets_log_truncated", "checkpoint-corrupt", "STREAM_FAILED"),
        ("concurrent_two_drivers", "concurrent-checkpoint-writer", "STREAM_FAILED"),
    ],
)
def test_real_spark_error_details(name: str, signature: str, error_class: str) -> None:
    """The inner error class wins over the STREAM_FAILED wrapper that getCondition() reports."""
    text, reported = read_fixture(FIXTURES / f"{name}.txt")
    result = classify(text, reported)
    assert (result.signature, result.error_class) == (signature, error_class)


# ------------------------------------------------------------------------------------------- ordering


PYTHON_PROXY = (
    "[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception: "
    "[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided function in foreach "
    "batch sink. Reason: An exception was raised by the Python Proxy. Return Message: "
    "Traceback (most recent call last):\n"
    '  File "job.py", line 12, in write_batch\n'
    "    sink.commit(batch_id)\n"
    "{error}\n"
    "JVM stacktrace:\n"
    "pyspark.errors.exceptions.captured.PythonException: An exception was thrown from the Python worker\n"
)


@pytest.mark.parametrize(
    ("error", "kind", "signature"),
    [
        ("StreamRunFencedError: [STREAM_RUN_FENCED] epoch 3 < 4", FailureKind.CONCURRENT, "run-fenced"),
        (
            "RuntimeError: [STREAM_OFFSET_GAP] events/0 starts at 120, stored 100",
            FailureKind.DATA_LOSS,
            "offset-gap",
        ),
        ("RuntimeError: [STREAM_POISON_RECORD] events/0:57", FailureKind.POISON, "poison-record"),
        (
            "airflow_stream_provider.runtime.batch_range.BatchRangeError: [STREAM_BATCH_RANGE_MISMATCH] job j batch 7",
            FailureKind.CHECKPOINT_INCOMPATIBLE,
            "offsets-log-mismatch",
        ),
        (
            "psycopg.OperationalError: connection failed: Connection refused",
            FailureKind.TRANSIENT,
            "database-unreachable",
        ),
        ("sqlite3.OperationalError: database is locked", FailureKind.TRANSIENT, "database-unreachable"),
        (
            "sqlalchemy.exc.InternalError: (psycopg.errors.IdleInTransactionSessionTimeout) terminating "
            "connection due to idle-in-transaction timeout",
            FailureKind.TRANSIENT,
            "database-unreachable",
        ),
        ("kafka.errors.NoBrokersAvailable: NoBrokersAvailable", FailureKind.TRANSIENT, "kafka-unreachable"),
        (
            "airflow_stream_provider.kafka_client.KafkaReadError: timed out reading events-2 [0, 40): stopped "
            "at 12; is the broker reachable?",
            FailureKind.TRANSIENT,
            "kafka-unreachable",
        ),
        (
            "airflow_stream_provider.kafka_client.KafkaReadError: stalled reading events-2 [0, 40): no "
            "progress for 30s at offset 12; is the broker reachable?",
            FailureKind.TRANSIENT,
            "kafka-unreachable",
        ),
        ("MemoryError", FailureKind.RESOURCE, "python-out-of-memory"),
        ("ValueError: bad row", FailureKind.USER_CODE, "python-user-code"),
    ],
)
def test_infrastructure_wrapped_in_user_code_wins(error: str, kind: FailureKind, signature: str) -> None:
    result = classify(PYTHON_PROXY.format(error=error), "STREAM_FAILED")
    assert (result.kind, result.signature) == (kind, signature)


def test_concurrent_marker_beats_data_loss_marker() -> None:
    """A fenced zombie's view of the offsets is stale: its gap report must not trigger a data-loss alarm."""
    text = "[STREAM_OFFSET_GAP] batch starts above stored offset\n[STREAM_RUN_FENCED] epoch 3 is stale"
    assert classify(text).kind is FailureKind.CONCURRENT


def test_out_of_memory_beats_the_connection_errors_it_causes() -> None:
    text = (
        "ExecutorLostFailure (executor 1 exited caused by one of the running tasks)\n"
        "Caused by: java.lang.OutOfMemoryError: Java heap space\n"
        "org.apache.spark.shuffle.FetchFailedException: java.net.ConnectException: Connection refused\n"
    )
    assert classify(text).signature == "jvm-out-of-memory"


def test_first_signature_in_table_order_wins_not_first_in_text() -> None:
    text = "psycopg.OperationalError: could not connect to server\nCaused by: java.lang.OutOfMemoryError"
    assert classify(text).kind is FailureKind.RESOURCE


# ---------------------------------------------------------------------------------------- error classes


def test_error_class_alone_is_enough() -> None:
    result = classify("", "KAFKA_DATA_LOSS.PARTITIONS_DELETED")
    assert result.kind is FailureKind.DATA_LOSS
    assert result.error_class == "KAFKA_DATA_LOSS.PARTITIONS_DELETED"
    assert result.evidence == "error class KAFKA_DATA_LOSS.PARTITIONS_DELETED"


@pytest.mark.parametrize(
    ("error_class", "kind"),
    [
        ("KAFKA_DATA_LOSS", FailureKind.DATA_LOSS),
        ("KAFKA_DATA_LOSS.START_OFFSET_RESET", FailureKind.DATA_LOSS),
        ("KAFKA_DATA_LOSS.COULD_NOT_READ_OFFSET_RANGE", FailureKind.DATA_LOSS),
        ("INVALID_LOG_VERSION.EXACT_MATCH_VERSION", FailureKind.CHECKPOINT_INCOMPATIBLE),
        ("CANNOT_LOAD_STATE_STORE.CANNOT_READ_SNAPSHOT_FILE_KEY_SIZE", FailureKind.CHECKPOINT_INCOMPATIBLE),
        ("CANNOT_LOAD_STATE_STORE.HDFS_STORE_PROVIDER_OUT_OF_MEMORY", FailureKind.RESOURCE),
        ("CANNOT_LOAD_STATE_STORE.UNCATEGORIZED", FailureKind.UNKNOWN),
        ("CONCURRENT_STREAM_LOG_UPDATE", FailureKind.CONCURRENT),
        ("UNRESOLVED_ROUTINE", FailureKind.USER_CODE),
        # exact names match their subclasses, not longer names that share the beginning
        ("KAFKA_DATA_LOSS_SOMETHING_ELSE", FailureKind.UNKNOWN),
        ("STREAM_FAILED", FailureKind.UNKNOWN),
    ],
)
def test_error_class_matching(error_class: str, kind: FailureKind) -> None:
    assert classify(f"[{error_class}] details").kind is kind
    assert classify("details", error_class).kind is kind


def test_find_error_classes() -> None:
    text = (
        "2024-05-01 [INFO] [main] [STREAM_FAILED] Query [id = 1] terminated with exception: "
        "[KAFKA_DATA_LOSS.START_OFFSET_RESET] Some data ... There are [1] sources. "
        "Did you mean one of the following? [`value`]\nCaused by: [KAFKA_DATA_LOSS.START_OFFSET_RESET] again "
        "[_LEGACY_ERROR_TEMP_2207] [UNRESOLVED_COLUMN.WITH_SUGGESTION]"
    )
    assert find_error_classes(text) == [
        "STREAM_FAILED",
        "KAFKA_DATA_LOSS.START_OFFSET_RESET",
        "_LEGACY_ERROR_TEMP_2207",
        "UNRESOLVED_COLUMN.WITH_SUGGESTION",
    ]
    assert find_error_classes("") == []


def test_reported_error_class_skips_the_stream_failed_wrapper_when_unknown() -> None:
    result = classify("[STREAM_FAILED] Query terminated: [SOME_NEW_CLASS] weird", "STREAM_FAILED")
    assert (result.kind, result.error_class) == (FailureKind.UNKNOWN, "SOME_NEW_CLASS")


# ----------------------------------------------------------------------------------- evidence, advice


def test_evidence_is_the_first_matching_line_stripped() -> None:
    text = (
        "Traceback (most recent call last):\n"
        "    kafka.errors.NoBrokersAvailable: NoBrokersAvailable   \n"
        "kafka.errors.KafkaTimeoutError: Failed to update metadata after 60.0 secs.\n"
    )
    result = classify(text)
    assert result.evidence == "kafka.errors.NoBrokersAvailable: NoBrokersAvailable"


def test_evidence_of_a_long_line_is_cut_around_the_match() -> None:
    text = (
        "x" * 1000
        + " There are [1] sources in the checkpoint offsets and now there are [2] sources "
        + ("requested by the query. Cannot continue. " + "y" * 1000)
    )
    result = classify(text)
    assert result.signature == "source-count-changed"
    assert len(result.evidence) <= 310
    assert "There are [1] sources in the checkpoint offsets" in result.evidence


def test_advice_is_specific_and_actionable() -> None:
    text, error_class = read_fixture(FIXTURES / "aggregation_keys_changed.txt")
    result = classify(text, error_class)
    assert "new one from the offsets stored in the sink" in result.advice
    assert "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE" in result.evidence
    assert classify("sqlite3.OperationalError: database is locked").advice != result.advice


def test_unknown_fallback() -> None:
    result = classify("\n\n  java.lang.IllegalStateException: something new  \nat foo\n")
    assert result == Classification(
        kind=FailureKind.UNKNOWN,
        signature=None,
        error_class=None,
        evidence="java.lang.IllegalStateException: something new",
        advice=result.advice,
    )
    assert "driver log" in result.advice
    assert classify("").kind is FailureKind.UNKNOWN
    assert classify("").evidence == ""


def test_to_dict_is_json_ready() -> None:
    result = classify("[KAFKA_DATA_LOSS.PARTITIONS_DELETED] Partitions [events-0] have been deleted.")
    data = json.loads(json.dumps(result.to_dict()))
    assert data == {
        "kind": "DATA_LOSS",
        "signature": "kafka-data-loss",
        "error_class": "KAFKA_DATA_LOSS.PARTITIONS_DELETED",
        "evidence": "[KAFKA_DATA_LOSS.PARTITIONS_DELETED] Partitions [events-0] have been deleted.",
        "advice": result.advice,
    }


# ------------------------------------------------------------------------------------------ exit codes


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda kind: kind.value)
def test_exit_code_round_trip(kind: FailureKind) -> None:
    code = exit_code_for(kind)
    assert code not in (EXIT_STOPPED, EXIT_CONFIG)
    expected = FailureKind.UNKNOWN if kind is FailureKind.USER_CODE else kind  # both exit with 1
    assert kind_for_exit_code(code) is expected


def test_exit_codes_are_distinct_except_user_code_and_unknown() -> None:
    codes = {kind: exit_code_for(kind) for kind in FailureKind}
    assert codes[FailureKind.USER_CODE] == codes[FailureKind.UNKNOWN] == EXIT_FAILED
    shared = (FailureKind.USER_CODE, FailureKind.UNKNOWN)
    others = [code for kind, code in codes.items() if kind not in shared]
    assert len(others) == len(set(others)) and EXIT_FAILED not in others
    assert sorted({*codes.values(), EXIT_STOPPED, EXIT_CONFIG}) == list(range(9))


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda kind: kind.value)
def test_every_kind_carries_complete_facts(kind: FailureKind) -> None:
    """A kind is one entry: its exit code, its recovery, whether a retry helps and its advice."""
    assert kind.value == kind.name and str(kind) == kind.name  # stored and compared as its plain name
    assert isinstance(kind.exit_code, int) and 0 < kind.exit_code < 128 and kind.exit_code != EXIT_CONFIG
    assert isinstance(kind.recovery, Recovery) and isinstance(kind.retryable, bool)
    assert kind.advice.strip() and kind.advice.endswith(".") and "\n" not in kind.advice
    if kind.exit_code != EXIT_FAILED:  # USER_CODE and UNKNOWN share 1, which reads back as UNKNOWN
        assert kind_for_exit_code(kind.exit_code) is kind


def test_the_exit_code_names_come_from_the_kinds() -> None:
    from airflow_stream_provider import failures

    for kind in FailureKind:
        name = f"EXIT_{kind.name}"
        if hasattr(failures, name):
            assert getattr(failures, name) == kind.exit_code, name
    assert failures.EXIT_CONCURRENT == 5 and failures.EXIT_POISON == 8


def test_only_passing_causes_are_retried() -> None:
    assert {kind for kind in FailureKind if kind.retryable} == {FailureKind.TRANSIENT, FailureKind.RESOURCE}


@pytest.mark.parametrize("code", [0, -9, -15, 137, 143, 130])
def test_exit_codes_without_a_kind(code: int) -> None:
    assert kind_for_exit_code(code) is None


def test_other_exit_codes() -> None:
    assert kind_for_exit_code(EXIT_CONFIG) is FailureKind.USER_CODE
    assert kind_for_exit_code(42) is FailureKind.UNKNOWN
    assert kind_for_exit_code(255) is FailureKind.UNKNOWN


# -------------------------------------------------------------------------------------------- purity


def test_module_imports_neither_pyspark_nor_airflow() -> None:
    """Both sides import this module; it must load in the driver (no airflow) and in Airflow (no pyspark)."""
    code = (
        "import sys, airflow_stream_provider.failures\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'airflow', 'py4j'))\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)
