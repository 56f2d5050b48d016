"""The example job with the least parsing a JSON event needs: the reference that says what the example
job's strict validation costs.

Same source, same transactional sink, same result tables; the parse is one ``from_json`` into the
event's fields, and a record is a dead letter only when a field is missing or will not convert.  It
does not tell a number from a string (``from_json`` turns a JSON number into text for a string field),
keys that appear twice, or text over the limits, which the example job refuses with a reason: for
measuring only.

    spark-submit benchmarks/jobs/events_minimal_parse.py --spec '<StreamJobSpec JSON>'
"""

from __future__ import annotations

import sys
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # spark_jobs/ (driver side only: no UDFs)

from airflow_stream_provider.runtime import StreamHarness
from spark_jobs.events_job import TEXT_FIELDS, results

EVENT_SCHEMA = "event_id string, user_id string, kind string, amount double, ts string"


def parse(records: DataFrame) -> DataFrame:
    event = F.from_json(F.col("value").cast("string"), EVENT_SCHEMA)
    parsed = records.select("*", event.alias("_event")).select("*", "_event.*").drop("_event")
    parsed = parsed.withColumn("ts", F.expr("try_cast(ts AS TIMESTAMP)"))
    missing = [F.col(name).isNull() for name in (*TEXT_FIELDS, "amount", "ts")]
    incomplete = missing[0]
    for other in missing[1:]:
        incomplete = incomplete | other
    return parsed.withColumn("error", F.when(incomplete, "not a complete event"))


if __name__ == "__main__":
    sys.exit(StreamHarness.from_argv().run(parse, results))
