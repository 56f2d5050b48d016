"""Example stream job: JSON events from Kafka into per-event rows and per-minute KPIs, exactly once.

Input records look like ``{"event_id": "e-1", "user_id": "u-7", "kind": "click", "amount": 12.5,
"ts": "2026-11-22T10:15:03Z"}``; the Kafka key is not used (it may be null).  Anything else lands in
``dead_letters`` with a reason that says what is wrong with it:

* no value (a tombstone), an empty value, a value over the size limit, bytes that are not UTF-8 text;
* text that is not JSON, or JSON that is not an object;
* a field missing, null or of the wrong JSON type (the ids and kind are strings, amount a number, ts
  an ISO-8601 timestamp string);
* an id or kind that is empty, holds a NUL character or is longer than ``MAX_TEXT_CHARS`` (they are
  key columns of the result tables: PostgreSQL cannot index a key beyond about 2.7 kB, and its text
  columns refuse NUL), an amount beyond ``MAX_AMOUNT`` (its sums in cents must fit a 64-bit integer).

The size limit is ``DEFAULT_MAX_VALUE_BYTES``; a job spec can change it with the Spark setting
``spark.stream.events.maxValueBytes`` in its ``spark_conf``.

    spark-submit spark_jobs/events_job.py --spec '<StreamJobSpec JSON>'
"""

from __future__ import annotations

import sys

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from airflow_stream_provider.runtime import Result, StreamHarness

MAX_VALUE_BYTES_CONF = "spark.stream.events.maxValueBytes"
DEFAULT_MAX_VALUE_BYTES = 64 * 1024
MAX_TEXT_CHARS = 200
MAX_AMOUNT = 1_000_000_000
TEXT_FIELDS = ("event_id", "user_id", "kind")
FIELDS = (*TEXT_FIELDS, "amount", "ts")
#: the variant type names of a JSON number, besides DECIMAL(p,s)
NUMBER_TYPES = ("TINYINT", "SMALLINT", "INT", "BIGINT", "FLOAT", "DOUBLE")


def _max_value_bytes(setting: str) -> int:
    """The size limit; anything but a positive number of bytes is refused (0 would dead-letter every record)."""
    if not setting.strip().isdigit() or int(setting) < 1:
        raise ValueError(f"{MAX_VALUE_BYTES_CONF}={setting!r} is not a positive number of bytes: give e.g. "
                         f"{DEFAULT_MAX_VALUE_BYTES} in the job spec's spark_conf")
    return int(setting)


def parse(records: DataFrame) -> DataFrame:
    """Kafka records -> events; ``error`` says why a record is not a valid event (null when it is)."""
    max_bytes = _max_value_bytes(records.sparkSession.conf.get(MAX_VALUE_BYTES_CONF, str(DEFAULT_MAX_VALUE_BYTES)))
    text = F.col("value").cast("string")
    # VARIANT keeps each field's JSON type, so a number where a string belongs is seen, not coerced.
    doc = F.when(F.octet_length("value") <= max_bytes, F.expr("try_parse_json(CAST(value AS STRING))"))
    # Each field is looked up in the document once, as a variant; its JSON type and its typed value are
    # read from that (a lookup per use, and the whole document's schema for the object check, cost the
    # parse 10-26% more of the JVM's CPU).
    fields = records.select("*", doc.alias("_doc")).select(
        "*", *[F.expr(f"variant_get(_doc, '$.{name}')").alias(f"_v_{name}") for name in FIELDS],
    )
    parsed = fields.select(
        "*",
        *[F.expr(f"schema_of_variant(_v_{name})").alias(f"_type_{name}") for name in FIELDS],
        *[F.expr(f"try_variant_get(_v_{name}, '$', 'string')").alias(name) for name in TEXT_FIELDS],
        F.expr("try_variant_get(_v_amount, '$', 'double')").alias("amount"),
        F.expr("try_variant_get(_v_ts, '$', 'string')").alias("_ts_text"),
    ).withColumn("ts", F.expr("try_to_timestamp(_ts_text)"))
    size = F.octet_length("value")
    error = (
        F.when(F.col("value").isNull(), "null value (a tombstone): every record must hold a JSON event")
        .when(size == 0, "empty value")
        .when(size > max_bytes, F.format_string(
            "value is %d bytes, over the limit of %d bytes (" + MAX_VALUE_BYTES_CONF + ")", size, F.lit(max_bytes)))
        .when(~F.expr("is_valid_utf8(CAST(value AS STRING))"), "value is not UTF-8 text (binary data?)")
        .when(F.col("_doc").isNull() & F.get_json_object(text, "$").isNotNull(),
              "malformed JSON: a key appears twice")
        .when(F.col("_doc").isNull(), "malformed JSON")
        # only an object casts to a struct; its type's name is worked out for the message alone
        .when(F.expr("try_variant_get(_doc, '$', 'struct<>')").isNull(),
              F.format_string("JSON value is %s, not an object", _json_name(F.expr("schema_of_variant(_doc)"))))
    )
    for name in TEXT_FIELDS:
        error = _check_type(error, name, "string").when(
            F.length(name) == 0, f"empty {name}"
        ).when(
            F.length(name) > MAX_TEXT_CHARS,
            F.format_string(f"{name} is %d characters, over the limit of {MAX_TEXT_CHARS}", F.length(name)),
        ).when(F.instr(name, "\u0000") > 0, f"{name} contains a NUL character")
    error = _check_type(error, "amount", "number").when(
        F.col("amount").isNull() | F.isnan("amount") | (F.abs("amount") > MAX_AMOUNT),
        F.format_string(f"amount %s is out of range (at most {MAX_AMOUNT:,} either way)",
                        F.expr("try_variant_get(_v_amount, '$', 'string')")),
    )
    error = _check_type(error, "ts", "string").when(
        F.col("ts").isNull(),
        F.format_string("ts '%s' is not an ISO-8601 timestamp", F.substring("_ts_text", 1, 100)),
    )
    helpers = [c for c in parsed.columns if c.startswith("_")]
    return parsed.withColumn("error", error).drop(*helpers)


def _json_name(t: Column) -> Column:
    """A Spark variant type name (``schema_of_variant``) as the JSON type a person writes."""
    return (
        F.when(t == "VOID", "null")
        .when(t == "STRING", "a string")
        .when(t == "BOOLEAN", "a boolean")
        .when(t.startswith("OBJECT"), "an object")
        .when(t.startswith("ARRAY"), "an array")
        .otherwise("a number")
    )


def _check_type(error: Column, name: str, wanted: str) -> Column:
    """Add the checks that field ``name`` is present, not null and of JSON type ``wanted``."""
    t = F.col(f"_type_{name}")
    is_wanted = (t == "STRING") if wanted == "string" else (t.isin(*NUMBER_TYPES) | t.startswith("DECIMAL"))
    return (
        error.when(t.isNull() | (t == "VOID"), f"missing {name}")
        .when(~is_wanted, F.format_string(f"{name} must be a JSON {wanted}, got %s", _json_name(t)))
    )


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
