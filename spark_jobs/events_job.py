"""Example stream job: JSON events from Kafka into per-event rows and per-minute KPIs, exactly once.

Input records look like ``{"event_id": "e-1", "user_id": "u-7", "kind": "click", "amount": 12.5,
"ts": "2026-11-22T10:15:03Z"}``.  Anything else lands in ``dead_letters`` with the reason.

    spark-submit spark_jobs/events_job.py --spec '<StreamJobSpec JSON>'
"""

from __future__ import annotations

import sys

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from airflow_stream_provider.runtime import Result, StreamHarness

EVENT_SCHEMA = (
    "event_id STRING, user_id STRING, kind STRING, amount STRING, ts STRING, _corrupt_record STRING"
)


def parse(records: DataFrame) -> DataFrame:
    """Kafka records -> events; ``error`` says why a record is not a valid event (null when it is)."""
    text = F.col("value").cast("string")
    event = F.from_json(text, EVENT_SCHEMA, {"columnNameOfCorruptRecord": "_corrupt_record"})
    parsed = records.select("*", event.alias("e")).select(
        "*",
        F.col("e.event_id").alias("event_id"),
        F.col("e.user_id").alias("user_id"),
        F.col("e.kind").alias("kind"),
        F.expr("try_cast(e.amount AS DOUBLE)").alias("amount"),
        F.expr("try_to_timestamp(e.ts)").alias("ts"),
    )
    error = (
        F.when(F.col("value").isNull(), "empty value")
        .when(F.col("e").isNull() | F.col("e._corrupt_record").isNotNull(), "malformed JSON")
        .when(F.coalesce(F.length("event_id"), F.lit(0)) == 0, "missing event_id")
        .when(F.coalesce(F.length("user_id"), F.lit(0)) == 0, "missing user_id")
        .when(F.col("kind").isNull(), "missing kind")
        .when(F.col("amount").isNull(), "amount missing or not a number")
        .when(F.col("ts").isNull(), "ts missing or not an ISO-8601 timestamp")
    )
    return parsed.withColumn("error", error).drop("e")


def results(events: DataFrame) -> list[Result]:
    """Good events -> the ``events`` table (idempotent by event_id) and ``kpi_minute`` increments."""
    rows = events.select("event_id", "user_id", "kind", "amount", "ts", "topic", "partition", "offset")
    per_minute = events.groupBy("user_id", F.date_trunc("minute", "ts").alias("minute")).agg(
        F.count("*").alias("event_count"),
        F.sum(F.round(F.col("amount") * 100).cast("long")).alias("amount_cents"),
    )
    return [
        Result("events", rows, key=("event_id",)),
        Result(
            "kpi_minute", per_minute, key=("user_id", "minute"), increments=("event_count", "amount_cents")
        ),
    ]


if __name__ == "__main__":
    sys.exit(StreamHarness.from_argv().run(parse, results))
