"""Version 2 of the example job: producer re-sends of an event (same ``event_id``) within an hour are
dropped before they reach the results.

The deduplication is a stateful operator, so Spark cannot run this version on version 1's checkpoint
(STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY): the upgrade archives version 1's generation and
starts a new one from the offsets stored with the results.  Records that are not valid events keep a
key of their own (their Kafka position), so every one of them still reaches ``dead_letters``.

    spark-submit spark_jobs/events_job_v2.py --spec '<StreamJobSpec JSON>'
"""

from __future__ import annotations

import sys

# Version 1's parsing and results, from the file next to this one (the driver's script directory is on
# sys.path; in cluster deploy mode ship it with --py-files / the operator's py_files).
import events_job
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from airflow_stream_provider.runtime import StreamHarness

#: How long a re-sent event is still recognised (Kafka record time).
RESEND_WINDOW = "1 hour"


def parse(records: DataFrame) -> DataFrame:
    events = events_job.parse(records)
    position = F.concat_ws(":", "topic", "partition", "offset")
    keyed = events.withColumn(
        "dedup_key", F.when(F.col("error").isNull(), F.col("event_id")).otherwise(F.concat(F.lit("@"), position))
    )
    return (
        keyed.withWatermark("timestamp", RESEND_WINDOW)
        .dropDuplicatesWithinWatermark(["dedup_key"])
        .drop("dedup_key")
    )


if __name__ == "__main__":
    sys.exit(StreamHarness.from_argv().run(parse, events_job.results))
