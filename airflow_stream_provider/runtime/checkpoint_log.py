"""Reads Spark's offsets log (the write-ahead log of a checkpoint) through Hadoop's FileSystem API, and
keeps the sink's write-behind marks beside it.

The sink needs batch N's exact range: ``offsets/N`` holds its end, ``offsets/N-1`` its start.  Going
through the JVM's FileSystem means local paths, ``hdfs://`` and object stores read alike.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.kafka_offsets import Offsets


class _CheckpointDir:
    """One directory of the checkpoint, on whatever file system the checkpoint lives."""

    def __init__(self, spark: SparkSession, checkpoint_path: str, name: str):
        jvm = spark._jvm
        self._jvm = jvm
        self.checkpoint_path = checkpoint_path
        #: the directory, for messages
        self.path = f"{checkpoint_path.rstrip('/')}/{name}"
        self._dir = jvm.org.apache.hadoop.fs.Path(self.path)
        self._fs = self._dir.getFileSystem(spark._jsc.hadoopConfiguration())

    def _file(self, batch_id: int):
        return self._jvm.org.apache.hadoop.fs.Path(self._dir, str(batch_id))

    def _paths(self) -> list:
        """The directory's files (none when it does not exist)."""
        if not self._fs.exists(self._dir):
            return []
        return [status.getPath() for status in self._fs.listStatus(self._dir)]

    def batch_ids(self) -> list[int]:
        """The batch ids the directory holds a file for, in order (none when it does not exist)."""
        return sorted(int(path.getName()) for path in self._paths() if path.getName().isdigit())

    def remove_unfinished(self) -> list[str]:
        """Delete the temporary files of entries a killed driver was writing (``.N.<uuid>.tmp`` and their
        ``.crc``); returns their paths."""
        removed = []
        for path in self._paths():
            if path.getName().startswith(".") and ".tmp" in path.getName():
                self._fs.delete(path, False)
                removed.append(path.toString())
        return removed


def remove_unfinished_first_entry(spark: SparkSession, offset_log: OffsetLog) -> list[str]:
    """Delete what a driver killed while writing a generation's first log entry left: its temporary
    files in ``offsets/`` and ``commits/``, when the offsets log holds no entry.  Spark takes such a
    checkpoint for a new one and refuses it as not empty ([STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY]).
    Only for the run that holds the job's epoch, before its query starts: no other driver writes the
    checkpoint then.  Returns the paths removed."""
    if offset_log.batch_ids():
        return []
    commits = _CheckpointDir(spark, offset_log.checkpoint_path, "commits")
    return offset_log.remove_unfinished() + commits.remove_unfinished()


class OffsetLog(_CheckpointDir):
    def __init__(self, spark: SparkSession, checkpoint_path: str):
        super().__init__(spark, checkpoint_path, "offsets")

    def source_offsets(self, batch_id: int) -> Offsets | None:
        """The Kafka position at the end of ``batch_id``, or None if that entry does not exist."""
        if batch_id < 0:
            return None
        path = self._file(batch_id)
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            text = self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
        finally:
            stream.close()
        return parse_entry(text)

    def batch_done(self, batch_id: int) -> bool:
        """Spark logged the batch as done (``commits/N``): a restart does not run it again."""
        return bool(self._fs.exists(self._jvm.org.apache.hadoop.fs.Path(
            f"{self.checkpoint_path.rstrip('/')}/commits", str(batch_id))))

    def newest_position(self) -> Offsets | None:
        """The end of the newest batch in the log; None when it holds no batch."""
        ids = self.batch_ids()
        return self.source_offsets(ids[-1]) if ids else None


class WriteBehindMarks(_CheckpointDir):
    """``write-behind/N``: batch N's results were handed to the sink's writer, so Spark may log the batch
    as done (``commits/N``) before the database holds it.  A mark outlives a killed driver; the next run
    finds the batch's range in the offsets log and applies it from Kafka if the stored offsets still
    stop at its start.  Spark ignores the directory."""

    def __init__(self, spark: SparkSession, checkpoint_path: str):
        super().__init__(spark, checkpoint_path, "write-behind")

    def mark(self, batch_id: int) -> None:
        self._fs.create(self._file(batch_id), True).close()  # empty: the batch id is the name

    def clear(self, batch_id: int) -> None:
        self._fs.delete(self._file(batch_id), False)

    def marked(self) -> list[int]:
        return self.batch_ids()


def parse_entry(text: str) -> Offsets:
    """Parse one offsets-log file: a version line, batch metadata, then one line per source, each
    Spark's Kafka offset JSON (several when the job reads a second stream)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 3 or not lines[0].startswith("v"):
        raise ValueError(f"malformed offsets log entry: {text[:200]!r}")
    return kafka_offsets.from_offset_log(lines[2:])
