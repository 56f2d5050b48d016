"""A job's result tables: what its ``results`` function returns, and the SQL table each becomes.

The sink creates a result's table from its frame's Spark schema the first time the result appears, with
the result's key as the primary key, and upserts each batch's rows into it (``state.bulk``).  Names must be
plain SQL identifiers and every column a type with a SQL mapping: a job that breaks either fails its
first batch with the reason, before anything of the batch is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql import types as T
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Float,
    LargeBinary,
    MetaData,
    Numeric,
    Table,
    Text,
)

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Result:
    """One result table the job writes: ``frame``'s rows are upserted on ``key``; ``increments`` columns
    are added to what is stored (per-batch partial aggregates), the others overwritten."""

    table: str
    frame: DataFrame
    key: tuple[str, ...]
    increments: tuple[str, ...] = ()


def table_for(result: Result, metadata: MetaData) -> Table:
    """The SQL table of ``result``, from its frame's Spark schema: the key columns its primary key."""
    fields = result.frame.schema.fields
    for name in (result.table, *(f.name for f in fields)):
        if not _IDENTIFIER.match(name):
            raise ValueError(
                f"result table/column name {name!r} is not a plain SQL identifier "
                f"(letters, digits, underscore; not starting with a digit)"
            )
    missing = set(result.key) - {f.name for f in fields}
    if missing:
        raise ValueError(f"result {result.table!r}: key columns {sorted(missing)} are not in the frame")
    return Table(
        result.table,
        metadata,
        *[
            Column(f.name, sql_type(f.dataType), primary_key=f.name in result.key, nullable=f.name not in result.key)
            for f in fields
        ],
    )


def sql_type(spark_type: T.DataType):
    """The SQL column type a Spark column is stored as."""
    if isinstance(spark_type, T.StringType):
        return Text()
    if isinstance(spark_type, T.LongType | T.IntegerType | T.ShortType | T.ByteType):
        return BigInteger()
    if isinstance(spark_type, T.DoubleType | T.FloatType):
        return Float(53)
    if isinstance(spark_type, T.DecimalType):
        return Numeric(spark_type.precision, spark_type.scale)
    if isinstance(spark_type, T.BooleanType):
        return Boolean()
    if isinstance(spark_type, T.TimestampType | T.TimestampNTZType):
        return DateTime()
    if isinstance(spark_type, T.DateType):
        return Date()
    if isinstance(spark_type, T.BinaryType):
        return LargeBinary()
    raise ValueError(
        f"result column type {spark_type.simpleString()} has no SQL mapping; cast it to a "
        f"string, number, boolean, date, timestamp or binary column"
    )
