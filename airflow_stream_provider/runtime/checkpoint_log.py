"""Reads Spark's offsets log (the write-ahead log of a checkpoint) through Hadoop's FileSystem API.

The sink needs batch N's exact range: ``offsets/N`` holds its end, ``offsets/N-1`` its start.  Going
through the JVM's FileSystem means local paths, ``hdfs://`` and object stores read alike.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.kafka_offsets import Offsets


class OffsetLog:
    def __init__(self, spark: SparkSession, checkpoint_path: str):
        jvm = spark._jvm
        self._jvm = jvm
        #: the log's directory, for messages
        self.path = f"{checkpoint_path.rstrip('/')}/offsets"
        self._dir = jvm.org.apache.hadoop.fs.Path(self.path)
        self._fs = self._dir.getFileSystem(spark._jsc.hadoopConfiguration())

    def source_offsets(self, batch_id: int) -> Offsets | None:
        """The Kafka position at the end of ``batch_id``, or None if that entry does not exist."""
        if batch_id < 0:
            return None
        path = self._jvm.org.apache.hadoop.fs.Path(self._dir, str(batch_id))
        if not self._fs.exists(path):
            return None
        stream = self._fs.open(path)
        try:
            text = self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
        finally:
            stream.close()
        return parse_entry(text)


def parse_entry(text: str) -> Offsets:
    """Parse one offsets-log file: a version line, batch metadata, then one line per source, each
    Spark's Kafka offset JSON (several when the job reads a second stream)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 3 or not lines[0].startswith("v"):
        raise ValueError(f"malformed offsets log entry: {text[:200]!r}")
    return kafka_offsets.from_offset_log(lines[2:])
